"""A flooding connection's fair-share yield (server/edges/connection.py `yield_turn`): it lets every client that is
ready take its turn first, and it comes back even when the loop never goes idle."""

from __future__ import annotations

from collections.abc import Iterator

import gevent
import gevent.socket
import pytest

from mqks.server.edges.connection import yield_turn

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def busy_loop() -> Iterator[None]:
    """A greenlet with work in every turn of the loop, as a busy broker has: the loop is never idle."""
    def spin() -> None:
        while True:
            gevent.sleep(0)

    spinner = gevent.spawn(spin)
    yield
    spinner.kill()


def test_the_yield_comes_back_when_the_loop_is_never_idle(busy_loop):
    # gevent.idle() waited here for good: CI's flooding client was then never read again nor cut off
    with gevent.Timeout(5, AssertionError("yield_turn did not come back beside a busy greenlet")):
        for _ in range(100):
            yield_turn()


@pytest.mark.parametrize("loop_busy", [False, True], ids=["idle-loop", "busy-loop"])
def test_a_client_ready_when_the_flooder_yields_runs_before_it_resumes(request, loop_busy):
    if loop_busy:
        request.getfixturevalue("busy_loop")
    ready, sender = gevent.socket.socketpair()
    served: list[bytes] = []
    reader = gevent.spawn(lambda: served.append(ready.recv(16)))
    gevent.sleep(0.01)  # the reader waits on its socket, as a client's read loop does
    sender.sendall(b"ping")
    yield_turn()
    assert served == [b"ping"]
    reader.join(timeout=5)
    ready.close()
    sender.close()
