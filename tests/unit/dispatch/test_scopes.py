"""Token scopes (server/dispatch/scopes.py) in process: what each pattern lets through, which actions are guarded,
that a full-access table is untouched, and that the caches stay bounded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mqks.server.dispatch import scopes
from mqks.server.dispatch.actions import ONE_PROCESS
from mqks.server.dispatch.scopes import Scope, ScopedPublisher, schedule_event
from mqks.server.wire.protocol import ProtocolError


def test_publish_patterns_are_names_dot_star_masks_or_everything():
    scope = Scope("t", ["orders.*", "audit", "user.*.created"], [], False)
    assert scope.may_publish(b"orders.new") and scope.may_publish(b"audit")
    assert scope.may_publish(b"user.42.created")
    assert not scope.may_publish(b"orders.new.more")  # a star is one word, as in routing
    assert not scope.may_publish(b"auditx") and not scope.may_publish(b"payments.x")
    assert Scope("all", ["*"], [], False).may_publish(b"anything.at.all")


def test_queue_patterns_are_fnmatch():
    scope = Scope("t", [], ["orders-*", "reports"], False)
    assert scope.may_consume(b"orders-eu") and scope.may_consume(b"reports")
    assert not scope.may_consume(b"reports-old") and not scope.may_consume(b"payments")


@pytest.mark.parametrize("args,event", [
    (b"tick --every=60 orders.tick data", b"orders.tick"),
    (b"tick --cron 0 * * * * --count=3 orders.tick data", b"orders.tick"),
    (b"tick --nohaste --every=1 e", b"e"),
    (b"tick --every=60", b""),
])
def test_a_schedules_event_is_found_as_the_handler_finds_it(args, event):
    assert schedule_event(args) == event


def guarded_table(scope: Scope) -> dict:
    return scope.table(ONE_PROCESS.for_session(False, True))


def test_a_scoped_table_guards_scheduling_reading_and_managing_and_leaves_the_rest():
    base = ONE_PROCESS.for_session(False, True)
    scope = Scope("orders", ["orders.*"], ["orders-*"], manage=False)
    table = scope.table(base)
    assert scope.table(base) is table  # built once per base table
    for name in (b"schedule", b"consume", b"rebind", b"fetch", b"delete_queue", b"purge_queue", b"requeue_dead",
                 b"unschedule"):
        assert table[name] is not base[name], name
    # publish and request are checked by the session's publisher (ScopedPublisher), not by a wrapper
    for name in (b"publish", b"request", b"ping", b"stats", b"queues", b"ack", b"reject", b"settle", b"reply",
                 b"hello", b"auth"):
        assert table[name] is base[name], name
    assert ONE_PROCESS.for_session(False, True, scope=None) is base  # full access: the plain table, no cost
    managing = Scope("admin", [], [], manage=True).table(base)
    assert managing[b"delete_queue"] is base[b"delete_queue"]
    with_eval = ONE_PROCESS.for_session(True, True)  # --eval, a loopback peer
    session = SimpleNamespace(process=SimpleNamespace(refused_by_scope=0))
    with pytest.raises(ProtocolError, match="token 'admin' may not _eval"):
        Scope("admin", ["*"], ["*"], manage=True).table(with_eval)[b"_eval"](session, b"e", b"1 + 1", False)


class Recorder:
    """A process's publisher, as far as a ScopedPublisher uses it."""

    def __init__(self) -> None:
        self.published: list[bytes] = []

    def publish(self, msg_id: bytes, event: bytes, tail: bytes) -> None:
        self.published.append(event)

    def routes(self, event: bytes) -> bool:
        return True

    def full_queues(self, event: bytes) -> list:
        return []


def test_a_scoped_publisher_publishes_what_the_scope_allows_and_refuses_the_rest():
    session = SimpleNamespace(process=SimpleNamespace(refused_by_scope=0))
    inner = Recorder()
    publisher = ScopedPublisher(inner, Scope("orders", ["orders.*"], [], False), session)
    publisher.publish(b"m1", b"orders.new", b" ok m1 event=orders.new x")
    publisher.publish(b"m2", b"orders.new", b" ok m2 event=orders.new x")  # decided once, then a set lookup
    assert inner.published == [b"orders.new", b"orders.new"] and publisher.allowed == {b"orders.new"}
    for call in (lambda: publisher.publish(b"m3", b"pay.x", b""), lambda: publisher.routes(b"pay.x"),
                 lambda: publisher.full_queues(b"pay.x"), lambda: publisher.permits(b"pay.x")):
        with pytest.raises(ProtocolError, match=r"token 'orders' may not publish 'pay\.x'"):
            call()
    assert inner.published == [b"orders.new", b"orders.new"] and session.process.refused_by_scope == 4
    assert publisher.routes(b"orders.other") and publisher.permits(b"orders.other")


def test_a_refusal_names_the_token_and_is_counted():
    session = SimpleNamespace(process=SimpleNamespace(refused_by_scope=0))
    table = guarded_table(Scope("orders", ["orders.*"], [], False))
    with pytest.raises(ProtocolError, match=r"permission denied: token 'orders' may not schedule to 'pay\.x'"):
        table[b"schedule"](session, b"s1", b"tick --every=5 pay.x data", False)
    with pytest.raises(ProtocolError, match="may not consume 'q'"):
        table[b"consume"](session, b"c1", b"q e --manual-ack", False)
    with pytest.raises(ProtocolError, match="may not purge_queue 'q'"):
        table[b"purge_queue"](session, b"p1", b"q", False)
    assert session.process.refused_by_scope == 3


def test_the_caches_of_decided_names_stay_bounded(monkeypatch):
    monkeypatch.setattr(scopes, "MAX_DECIDED", 100)
    scope = Scope("t", ["orders.*"], ["q-*"], False)
    for n in range(1000):
        scope.may_publish(b"orders.%d" % n)
        scope.may_consume(b"x-%d" % n)
    assert len(scope._may_publish) <= 100 and len(scope._may_consume) <= 100
    assert scope.may_publish(b"orders.1") and not scope.may_consume(b"x-1")
