"""The dispatcher (server/dispatch/actions.py: run_lines) on hostile and broken lines, in process: every bad line
costs only its own error answer and the lines around it still run; a protected action is refused unless the
session may run it; an HTTP request closes the session; before `auth`, at most a few lines are answered. The
session is this file's; the process, its broker and the handler tables are the real ones."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from mqks.server.dispatch.actions import MAX_UNAUTHENTICATED_LINES, ONE_PROCESS, actions_for, run_lines
from mqks.server.dispatch.process import Process
from mqks.server.wire.outbox import Outbox
from mqks.server.wire.protocol import delivery_tail, format_ok

pytestmark = pytest.mark.timeout(10)


class Session:
    """What a handler may use of a client (dispatch/actions.py's Session), over a real Process and Outbox."""

    peer = "127.0.0.1:50000"
    peer_is_loopback = True
    eval_refusal = None
    said_hello = False
    tls = False
    ttl_seconds = None
    relay = None

    def __init__(self, process: Process, authenticated: bool = True, eval_enabled: bool = False,
                 token: bytes | None = None) -> None:
        self.process = process
        self.publisher = process.publisher
        self.outbox = Outbox(process.pending)
        self.consumers_by_id = self.outbox.consumers_by_id
        self.eval_enabled = eval_enabled
        self.authenticated = authenticated
        self.unauthenticated_lines = 0
        self.token = token
        self.closed = False
        self.errors: list[tuple[bytes, str]] = []
        self.use_tables()

    def use_tables(self) -> None:
        self.actions = actions_for(self.eval_enabled, self.peer_is_loopback, self.authenticated)
        self.handlers = ONE_PROCESS.for_session(self.eval_enabled, self.peer_is_loopback, self.authenticated)

    def write(self, data: bytes) -> None:
        self.outbox.write(data)

    def ok(self, rid: bytes, data: bytes = b"") -> None:
        self.write(format_ok(rid, data))

    def error(self, rid: bytes, reason: str, line: bytes) -> None:
        self.errors.append((rid, reason))

    def close(self, flush_first: bool = False) -> None:
        self.closed = True

    def authenticate(self, token: bytes) -> bool | None:
        if self.token is None:
            return None
        if token != self.token:
            return False
        self.authenticated = True
        self.use_tables()
        return True

    def set_ttl(self, seconds: float | None) -> None:
        self.ttl_seconds = seconds

    def answers(self) -> list[bytes]:
        return b"".join(bytes(piece) for piece in self.outbox.pieces()).split(b"\n")[:-1]


def run(session: Session, *lines: bytes | None, rejected: list[tuple[bytes, str]] = ()) -> None:
    run_lines(session, list(lines), deque(rejected))


def test_bad_lines_cost_their_own_error_and_the_lines_around_them_run():
    session = Session(Process())
    run(session, b"p1 ping a", b"x1 no_such_action", b"x2 publish", b"", b"x3 consume", b"p2 ping b",
        b"x4 ack", b" leading space", None, b"p3 ping c", rejected=[(b"x5", "line too long: 2000000 bytes")])
    assert session.answers() == [b"p1 ok a", b"p2 ok b", b"p3 ok c"]
    rids = [rid for rid, _ in session.errors]
    assert rids == [b"x1", b"x2", b"x3", b"x4", b"-", b"x5"]  # a line with no rid is answered as "-"
    reasons = dict(session.errors)
    assert reasons[b"x2"] == "publish: event expected" and "line too long" in reasons[b"x5"]
    assert not session.closed


def test_a_line_of_one_word_is_answered_under_that_word_and_a_tab_is_an_ordinary_byte():
    session = Session(Process())
    run(session, b"x", b"y ", b"help", b"p\tq ping a\tb", b"t ping\tx")
    assert [rid for rid, _ in session.errors] == [b"x", b"y", b"-", b"t"]  # `help` alone is a person asking
    assert "expected {request_id} {action} {data}" in dict(session.errors)[b"x"]
    assert "unknown action" in dict(session.errors)[b"t"]  # a tab separates nothing: `ping\tx` is one word
    assert session.answers() == [b"p\tq ok a\tb"]


@pytest.mark.parametrize("line", [b"r1 rebind", b"c1 consume --confirm", b"p1 publish --confirm",
                                  b"c1 consume q1 --prefetch=-3", b"c1 consume q1 --ack-timeout=nan",
                                  b"a1 ack c-none m1", b"d1 delete_queue", b"f1 fetch q1 --max=x",
                                  b"s1 schedule x --every=-1 e hi", b"q1 request --timeout=0 e hi"])
def test_a_malformed_line_is_an_error_answer_never_an_exception(line):
    session = Session(Process())
    run(session, line, b"p ping alive")
    assert session.answers()[-1] == b"p ok alive"
    assert len(session.errors) == 1 and session.errors[0][1] != "internal error", session.errors


@pytest.mark.parametrize("line, answer", [(b"c1 consume --confirm q\xff\xfe e1", b"c1 ok"),
                                          (b"\x00\x01 ping x", b"\x00\x01 ok x")])
def test_bytes_that_are_not_text_are_names_like_any_other(line, answer):
    """The protocol is bytes: a name or a rid that is not UTF-8 is taken as it is, not refused, not crashed on."""
    session = Session(Process())
    run(session, line)
    assert session.answers()[0].startswith(answer) and session.errors == []


def test_eval_is_refused_unless_the_session_may_run_it():
    session = Session(Process(), eval_enabled=False)
    run(session, b"e1 _eval 1+1")
    assert session.errors and session.errors[0][0] == b"e1" and session.answers() == []


def test_an_http_request_closes_the_session_and_nothing_after_it_runs():
    session = Session(Process())
    run(session, b"GET / HTTP/1.1", b"p1 ping after")
    assert session.closed and session.answers() == []


def test_before_auth_only_auth_and_ping_run_and_a_few_failures_close_the_session():
    session = Session(Process(), authenticated=False, token=b"s3cret")
    run(session, b"p1 ping open", b"x1 publish e1 data")
    assert session.answers() == [b"p1 ok open"] and [rid for rid, _ in session.errors] == [b"x1"]
    run(session, *[b"x%d stats" % n for n in range(2, MAX_UNAUTHENTICATED_LINES + 1)], b"p2 ping never")
    assert session.closed and b"p2 ok never" not in session.answers()


def test_an_auth_opens_the_full_table_for_the_rest_of_the_same_batch():
    session = Session(Process(), authenticated=False, token=b"s3cret")
    run(session, b"a1 auth s3cret", b"s1 stats")
    assert session.answers()[0] == b"a1 ok " and session.answers()[1].startswith(b"s1 ok {")
    assert session.errors == []


@pytest.mark.parametrize(("line", "delivery"), [
    (b"m1 publish e hello world", b"c1 ok m1 event=e hello world"),
    (b"m2 publish e", b"c1 ok m2 event=e "),  # the spec's delivery has a space before {data}, even an empty one
    (b"m3 publish --confirm e  two  spaces ", b"c1 ok m3 event=e  two  spaces "),
])
def test_a_publish_is_delivered_with_its_event_and_data_as_sent(line, delivery):
    process = Process()
    session = Session(process)
    run(session, b"c1 consume q e")
    run(session, line)
    assert delivery in session.answers()


class BlockedJournal:
    """A worker's log that takes no writes (dispatch/process.py asks it `blocked`, then `refusal()`)."""

    blocked = "the replicated log does not answer"

    def refusal(self) -> str:
        return f"{self.blocked}: confirmed publishes are refused until the log can write again"

    def append(self, record: bytes) -> None:
        raise AssertionError("a refused publish writes nothing")


class OtherWorkers:
    """The forwarder and peers of a worker some of whose events are bound only to another worker's queues."""

    unlinked = 0

    def __init__(self, process: Process, elsewhere: set[bytes]) -> None:
        self.process = process
        self.elsewhere = elsewhere
        self.forwarded: list[bytes] = []

    def permits(self, event: bytes) -> bool:
        return True

    def routes_elsewhere(self, event: bytes) -> bool:
        return event in self.elsewhere

    def publish_confirmed(self, session: Session, rid: bytes, event: bytes, tail: bytes) -> None:
        self.forwarded.append(event)
        session.ok(rid)  # as the other worker's log would once it has it


def test_a_worker_whose_log_takes_no_writes_refuses_only_what_goes_to_its_own_queues():
    """Issue 56: a wedged group refused a client's confirmed publishes to every queue of the cluster."""
    process = Process()
    process.journal = BlockedJournal()  # type: ignore[assignment]
    others = OtherWorkers(process, elsewhere={b"theirs"})
    process.peers = process.forwarder = others  # type: ignore[assignment]
    session = Session(process)
    session.publisher = others
    run(session, b"1 consume mine ours", b"2 publish --confirm theirs x", b"3 publish --confirm ours y")
    assert others.forwarded == [b"theirs"]
    assert format_ok(b"2") in b"".join(bytes(piece) for piece in session.outbox.pieces())
    assert session.errors == [(b"3", BlockedJournal().refusal())]


@pytest.mark.parametrize("line,msg_id,header,data", [
    (b"m1 publish e1 hello world", b"m1", b"e1", b"hello world"),
    (b"m2 publish e2", b"m2", b"e2", b""),  # the spec's delivery keeps the space before an empty {data}
    (b"m3 publish --mandatory e3 x", b"m3", b"e3", b"x"),
])
def test_a_publish_hands_its_queues_the_tail_delivery_tail_builds(line, msg_id, header, data):
    """handle_publish writes delivery_tail's bytes out (the hot path saves the call): the two must not drift."""
    tails: list[bytes] = []
    session = Session(Process())
    # the publisher a publish hands its tail to (and a --mandatory one asks whether the event routes)
    session.publisher = SimpleNamespace(publish=lambda msg_id, event, tail: tails.append(tail),
                                        routes=lambda event: True)
    run_lines(session, [line], deque())
    assert tails == [delivery_tail(msg_id, header, data)] and session.errors == []
