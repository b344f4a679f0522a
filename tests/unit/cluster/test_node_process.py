"""A cluster node's process holding several groups (server/cluster/node_process.py), in process with stand-in servers:
which groups a process holds, a group made again after it ends, and a stop that drains owners and ends standbys."""

from __future__ import annotations

import gevent
from gevent.event import Event

from mqks.server.cluster.node_process import NodeProcess, groups_of
from mqks.server.edges.config import FENCED_EXIT_CODE, Config


class StandIn:
    """A group's server: stands by until `won` is set, then serves until `shutdown`; ends with `exit_code`."""

    def __init__(self, config: Config, made: list[StandIn]) -> None:
        self.group = config.worker_index
        self.exit_code = 0
        self.won = Event()
        self.stopped = Event()
        self.serving = False
        self.shutdowns = 0
        self.released = False
        made.append(self)

    def serve_forever(self, own_signals: bool = True) -> None:
        assert not own_signals  # the host handles the signals
        self.won.wait()
        self.serving = True
        self.stopped.wait()

    def takes_shutdown(self) -> bool:
        return self.serving

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.stopped.set()

    def reload_tokens(self) -> None:
        pass

    def release(self) -> None:
        self.released = True


def node_process_of(made: list[StandIn], process_index: int = 1, processes: int = 2, groups: int = 6) -> NodeProcess:
    config = Config(cluster="c", node="a", workers=groups, processes=processes, process_index=process_index,
                    run_dir=".")
    return NodeProcess(config, lambda group_config: StandIn(group_config, made))


def wait_until(condition, seconds: float = 5.0) -> None:
    with gevent.Timeout(seconds):
        while not condition():
            gevent.idle()  # not gevent.sleep: a test below records the host's sleeps


def test_process_p_of_p_holds_every_pth_group_and_together_they_hold_each_group_once():
    assert groups_of(1, 2, 6) == [1, 3, 5]
    assert groups_of(0, 3, 16) == [0, 3, 6, 9, 12, 15]
    held = sorted(group for index in range(3) for group in groups_of(index, 3, 16))
    assert held == list(range(16))
    assert groups_of(2, 4, 2) == []  # more processes than groups: the last ones hold nothing


def test_a_group_that_ends_is_made_again_here_and_its_old_server_released(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made: list[StandIn] = []
    host = node_process_of(made)
    runner = gevent.spawn(host.run)
    wait_until(lambda: sorted(server.group for server in made) == [1, 3, 5])
    first = next(server for server in made if server.group == 3)
    (tmp_path / "owns-3").write_text("pid")  # what an owner writes in the node's run dir
    first.won.set()
    wait_until(lambda: first.serving)
    first.exit_code = FENCED_EXIT_CODE  # taken over: it stands by again
    first.stopped.set()
    wait_until(lambda: len(made) == 4)
    assert made[3].group == 3 and first.released
    assert not (tmp_path / "owns-3").exists()  # the node no longer counts the group as its own
    assert host.servers[3] is made[3]
    runner.kill()


def test_a_stop_drains_the_owners_and_ends_the_standbys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made: list[StandIn] = []
    host = node_process_of(made)
    runner = gevent.spawn(host.run)
    wait_until(lambda: len(made) == 3)
    owner = made[0]
    owner.won.set()
    wait_until(lambda: owner.serving)
    host.stop()
    assert runner.get(timeout=5) == 0
    assert owner.shutdowns == 1  # drained
    assert all(server.shutdowns == 0 for server in made[1:])  # standing by: nothing to drain, just ended
    assert all(server.released for server in made) and len(made) == 3  # nothing made again while stopping


def keeps_ending_at_once(tmp_path, monkeypatch, exit_code: int) -> list[float]:
    """The waits of a process whose one group's server ends at once with `exit_code`, again and again."""
    monkeypatch.chdir(tmp_path)
    waits: list[float] = []
    monkeypatch.setattr("mqks.server.cluster.node_process.gevent.sleep",
                        lambda seconds=0: waits.append(seconds) or gevent.idle())
    made: list[StandIn] = []

    def ending_at_once(config: Config) -> StandIn:
        server = StandIn(config, made)
        server.won.set()
        server.exit_code = exit_code
        server.stopped.set()
        return server

    config = Config(cluster="c", node="a", workers=1, processes=1, process_index=0, run_dir=".")
    host = NodeProcess(config, ending_at_once)
    runner = gevent.spawn(host.run)
    wait_until(lambda: len(made) >= 6)
    host.stop()
    runner.join(timeout=5)
    return waits


def test_a_group_that_keeps_failing_at_once_is_made_again_after_a_growing_wait(tmp_path, monkeypatch):
    waits = keeps_ending_at_once(tmp_path, monkeypatch, 1)
    assert waits[:5] == [0.1, 0.5, 1.0, 2.0, 5.0]  # the first comes back at once, then each waits longer


def test_a_group_not_owned_here_stands_by_again_within_a_second_however_often_it_ends(tmp_path, monkeypatch):
    """Issue 56: after a heal, JetStream answered 503 for 4-9 s while NATS elected its leaders; each standby's start
    ended at once, its back-off grew to 5 s, and the healed node stood by (and balanced) up to 5 s after NATS was
    back. A standby's start is a few API calls: it tries again each second, and a crashing group still backs off."""
    waits = keeps_ending_at_once(tmp_path, monkeypatch, FENCED_EXIT_CODE)
    assert waits[:5] == [0.1, 0.5, 1.0, 1.0, 1.0]


class Unavailable(Exception):
    """What nats-py raises for JetStream's 503 while NATS elects its leaders (an APIError: not an OSError)."""


def test_a_group_whose_server_cannot_be_made_is_tried_again_not_dropped(tmp_path, monkeypatch):
    """Issue 56: right after a heal, a standby's start met JetStream's 503 in the stream's open; the exception ended
    the group's greenlet, and the node never stood by for that group again until it was restarted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("mqks.server.cluster.node_process.gevent.sleep", lambda seconds=0: gevent.idle())
    made: list[StandIn] = []
    refusals = [Unavailable("nats: ServiceUnavailableError: code=503"), OSError("no servers available")]

    def refusing_first(config: Config) -> StandIn:
        if refusals:
            raise refusals.pop(0)
        return StandIn(config, made)

    config = Config(cluster="c", node="a", workers=1, processes=1, process_index=0, run_dir=".")
    host = NodeProcess(config, refusing_first)
    runner = gevent.spawn(host.run)
    wait_until(lambda: len(made) == 1)
    assert not refusals and host.servers[0] is made[0]  # standing by for it after both refusals
    host.stop()
    assert runner.get(timeout=5) == 0
