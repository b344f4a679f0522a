"""Each action's token scope, declared in its `Action` (server/dispatch/actions.py) and checked in one place
(`Scope.table`, server/dispatch/scopes.py): every action says what a scoped token needs to run it, an Action that
does not say is refused, and the scoped table guards by that declaration, not by the action's name. In process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mqks.server.dispatch.actions import ACTIONS, ONE_PROCESS, Action, ScopeCheck, handle_ping
from mqks.server.dispatch.scopes import Scope
from mqks.server.wire.protocol import ProtocolError

pytestmark = pytest.mark.timeout(10)

# what a scoped token needs for each action: pinned here so a new action must say who may run it
EXPECTED = {
    b"publish": ScopeCheck.PUBLISH, b"request": ScopeCheck.PUBLISH, b"schedule": ScopeCheck.SCHEDULE,
    b"consume": ScopeCheck.READ_QUEUE, b"rebind": ScopeCheck.READ_QUEUE, b"fetch": ScopeCheck.READ_QUEUE,
    b"delete_queue": ScopeCheck.MANAGE, b"purge_queue": ScopeCheck.MANAGE, b"requeue_dead": ScopeCheck.MANAGE,
    b"unschedule": ScopeCheck.MANAGE,
    b"_eval": ScopeCheck.FULL_ACCESS_ONLY,
    b"ack": ScopeCheck.ANY, b"reject": ScopeCheck.ANY, b"touch": ScopeCheck.ANY, b"delete_consumer": ScopeCheck.ANY,
    b"settle": ScopeCheck.ANY, b"reply": ScopeCheck.ANY, b"schedules": ScopeCheck.ANY, b"queues": ScopeCheck.ANY,
    b"stats": ScopeCheck.ANY, b"ping": ScopeCheck.ANY, b"hello": ScopeCheck.ANY, b"auth": ScopeCheck.ANY,
    b"sync": ScopeCheck.ANY,
}
GUARDED = {ScopeCheck.SCHEDULE, ScopeCheck.READ_QUEUE, ScopeCheck.MANAGE, ScopeCheck.FULL_ACCESS_ONLY}


def test_every_action_declares_its_scope():
    assert all(isinstance(action.scope, ScopeCheck) for action in ACTIONS.values())
    assert {name: action.scope for name, action in ACTIONS.items()} == EXPECTED


def test_an_action_that_does_not_declare_a_scope_is_refused():
    with pytest.raises(TypeError, match="scope"):
        Action(handle_ping, "", needs_args=False)  # type: ignore[call-arg]


@pytest.mark.parametrize("name", sorted(ACTIONS))
def test_a_scoped_table_wraps_exactly_the_actions_whose_scope_is_checked_by_a_wrapper(name):
    """PUBLISH is checked by the session's publisher (ScopedPublisher), ANY by nobody: both run the plain handler."""
    base = ONE_PROCESS.for_session(True, True)  # --eval on a loopback peer: every action is in the table
    table = Scope("t", [], [], manage=False).table(base)
    assert (table[name] is not base[name]) == (ACTIONS[name].scope in GUARDED)
    managing = Scope("admin", [], [], manage=True).table(base)
    assert (managing[name] is not base[name]) == (ACTIONS[name].scope in GUARDED - {ScopeCheck.MANAGE})


def test_the_check_follows_the_declaration_not_the_name(monkeypatch):
    """A new action declared READ_QUEUE is guarded as consume is, with no list of names to add it to."""
    ran = []

    def handle_peek(session, rid, args, confirm):
        ran.append(args)

    monkeypatch.setitem(ACTIONS, b"peek", Action(handle_peek, "peek: queue expected", scope=ScopeCheck.READ_QUEUE))
    table = Scope("orders", [], ["orders-*"], manage=False).table({b"peek": handle_peek})
    session = SimpleNamespace(process=SimpleNamespace(refused_by_scope=0))
    table[b"peek"](session, b"p1", b"orders-eu", False)
    with pytest.raises(ProtocolError, match="token 'orders' may not peek 'payments'"):
        table[b"peek"](session, b"p2", b"payments", False)
    assert ran == [b"orders-eu"] and session.process.refused_by_scope == 1


@pytest.mark.parametrize("check", list(ScopeCheck))
def test_every_kind_of_scope_has_its_check(check):
    """A kind of scope Scope.guarded does not know fails when the table is built, not open at run time."""
    scope = Scope("t", [], [], manage=False)
    placed = scope.guarded(b"x", check, handle_ping)
    assert (placed is not handle_ping) == (check in GUARDED)
