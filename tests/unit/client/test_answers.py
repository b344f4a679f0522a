"""The client's answer routing (client/answers.py), shared by the gevent and asyncio clients: each line reaches
the request or the consumer it is for, answers in several lines wake their caller once, a late answer nobody waits
for is dropped, and a peer that does not speak MQKS is named. In process: the waiters are lists."""

from __future__ import annotations

import pytest

from mqks.client.answers import DRAINING, Answers
from mqks.client.errors import MqksError, MqksProtocolError

pytestmark = pytest.mark.timeout(10)


class Session:
    """A connection's consumers as the router sees them: consumer `c1` takes deliveries and refusals."""

    def __init__(self) -> None:
        self.deliveries: list[tuple[bytes, bytes]] = []
        self.answered_rids: list[bytes] = []
        self.refusals: list[tuple[bytes, str]] = []

    def deliver(self, rid: bytes, data: bytes) -> bool:
        if rid == b"c1":
            self.deliveries.append((rid, data))
            return True
        return False

    def answered(self, rid: bytes) -> None:
        self.answered_rids.append(rid)

    def refused(self, rid: bytes, error: MqksError) -> bool:
        if rid == b"c1":
            self.refusals.append((rid, error.reason))
            return True
        return False


def new_answers() -> tuple[Answers[list], Session]:
    session = Session()

    def resolve(waiter: list, data: bytes) -> None:
        waiter.append(("ok", data))

    def fail(waiter: list, error: MqksError) -> None:
        waiter.append(("error", error.reason))

    return Answers(session, "127.0.0.1:25000", resolve, fail), session


def test_an_answer_wakes_its_request_and_a_delivery_its_consumer():
    answers, session = new_answers()
    request: list = []
    answers.add(b"r1", request)
    assert answers.take(b"c1 ok id=1,event=e data", ready=True) is None
    assert request == [] and session.deliveries == [(b"c1", b"id=1,event=e data")]
    assert answers.take(b"r1 ok 42\r", ready=True) is None
    assert request == [("ok", b"42")] and session.answered_rids == [b"r1"]


def test_an_answer_in_several_lines_wakes_its_caller_once_at_its_end():
    answers, _ = new_answers()
    request: list = []
    lines: list[bytes] = []
    answers.add(b"q", request, lines)
    for line in (b"q ok {\"queue\": \"a\"}", b"q ok {\"queue\": \"b\"}"):
        answers.take(line, ready=True)
    assert request == [] and lines == [b"{\"queue\": \"a\"}", b"{\"queue\": \"b\"}"]
    answers.take(b"q ok --end", ready=True)
    assert request == [("ok", b"")]


def test_an_error_fails_its_request_and_a_consumers_error_goes_to_the_consumer():
    answers, session = new_answers()
    request: list = []
    answers.add(b"r1", request)
    answers.take(b"r1 error e7 queue is full", ready=True)
    assert request == [("error", "queue is full")]
    answers.take(b"c1 error e8 consume: no such queue", ready=True)
    assert session.refusals == [(b"c1", "consume: no such queue")]


def test_a_late_answer_is_dropped_and_draining_is_reported():
    answers, _ = new_answers()
    request: list = []
    answers.add(b"r1", request)
    answers.discard(b"r1")  # its caller timed out
    assert answers.take(b"r1 ok", ready=True) is None and request == []
    assert answers.take(b"c1 ok --draining", ready=True) == DRAINING


def test_the_connection_lost_fails_every_waiter():
    answers, _ = new_answers()
    first: list = []
    second: list = []
    answers.add(b"a", first)
    answers.add(b"b", second, [])
    answers.fail_all(MqksError("connection lost"))
    assert first == second == [("error", "connection lost")]
    assert answers.take(b"a ok", ready=True) is None and first == [("error", "connection lost")]


def test_a_peer_that_does_not_speak_mqks_is_named_before_the_handshake():
    answers, _ = new_answers()
    error = answers.take(b"HTTP/1.1 400 Bad Request", ready=False)
    assert isinstance(error, MqksProtocolError)
    assert "127.0.0.1:25000 does not speak MQKS (it answered 'HTTP/1.1 400 Bad Request')" in str(error)
    error = answers.take(b"- error e1 this port speaks TLS: connect with TLS", ready=False)
    assert isinstance(error, MqksProtocolError) and "pass --tls" in str(error)
