"""The relay's placement table (server/workers/relay.py beside dispatch/actions.py): every action has a placement,
every placement but HERE has a wrapper, and the wrapper is what a worker of several runs; a line about a queue runs
where the queue lives, and the wrappers choose by placement, never by an action's name. In process: no worker, no
link."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mqks.server.dispatch.actions import ACTIONS, OVER_MEMORY, Placement
from mqks.server.workers import relay
from mqks.server.workers.relay import WRAPPERS, place

pytestmark = pytest.mark.timeout(10)

# what a client's line is about decides where it runs: pinned here so a new action must say where it belongs
EXPECTED = {
    b"publish": Placement.HERE, b"request": Placement.HERE, b"auth": Placement.HERE, b"hello": Placement.HERE,
    b"consume": Placement.QUEUE_OWNER_NEW_CONSUMER,
    b"rebind": Placement.QUEUE_OWNER, b"delete_queue": Placement.QUEUE_OWNER,
    b"purge_queue": Placement.QUEUE_OWNER, b"fetch": Placement.QUEUE_OWNER,
    b"requeue_dead": Placement.DEAD_QUEUE_OWNER,
    b"ack": Placement.CONSUMER_OWNER, b"reject": Placement.CONSUMER_OWNER, b"touch": Placement.CONSUMER_OWNER,
    b"delete_consumer": Placement.CONSUMER_OWNER_ENDING,
    b"reply": Placement.TOKEN_ISSUER, b"schedule": Placement.SCHEDULE_OWNER, b"unschedule": Placement.SCHEDULE_OWNER,
    b"schedules": Placement.EVERY_WORKER_ROWS_BY_NAME, b"queues": Placement.EVERY_WORKER_ROWS_BY_QUEUE,
    b"stats": Placement.EVERY_WORKER_STATS, b"settle": Placement.EVERY_WORKER_SUM,
    b"ping": Placement.AFTER_OTHER_WORKERS, b"sync": Placement.AFTER_OTHER_WORKERS, b"_eval": Placement.CHOSEN_WORKER,
}


def test_every_action_runs_where_its_line_is_about():
    assert {name: action.placement for name, action in ACTIONS.items()} == EXPECTED


def test_every_placement_but_here_has_a_wrapper_and_every_wrapper_a_placement():
    assert set(WRAPPERS) == set(Placement) - {Placement.HERE}


@pytest.mark.parametrize("name", sorted(ACTIONS))
def test_a_worker_of_several_runs_the_wrapped_handler_and_here_runs_it_as_is(name):
    action = ACTIONS[name]
    placed = place(name, action, action.handler)
    if action.placement is Placement.HERE:
        assert placed is action.handler
    else:
        assert placed is not action.handler and callable(placed)


@pytest.mark.parametrize("name", sorted(OVER_MEMORY))
def test_the_over_memory_stand_ins_are_actions_that_run_here(name):
    """Past --max-memory a publish or request is refused where the client is: no forward is made for it."""
    assert ACTIONS[name].placement is Placement.HERE
    assert place(name, ACTIONS[name], OVER_MEMORY[name]) is OVER_MEMORY[name]


def test_the_wrappers_never_choose_by_an_actions_name():
    """What a wrapper does beyond forwarding (a consume's stub, a delete_consumer's end of it) is its placement's."""
    source = Path(relay.__file__).read_text(encoding="utf-8")
    assert re.findall(r"name (?:==|!=|in) ", source) == []
