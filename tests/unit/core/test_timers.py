"""The process's one timer heap, on a clock the test moves."""

import pytest

from mqks.server.core.timers import COMPACT_MIN_CANCELLED, Buckets, Timers

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_timers_run_once_in_deadline_order_then_ties_in_arming_order():
    clock, ran = Clock(), []
    timers = Timers(clock=clock)
    timers.call_later(2, lambda: ran.append("b"))
    timers.call_later(1, lambda: ran.append("a"))
    timers.call_later(2, lambda: ran.append("c"))
    assert timers.next_delay() == 1
    clock.now += 1.5
    assert timers.run_due() == 1 and ran == ["a"]
    clock.now += 1
    assert timers.run_due() == 2 and ran == ["a", "b", "c"]
    assert timers.run_due() == 0 and timers.next_delay() is None and len(timers) == 0


def test_cancelled_timer_never_runs_and_cancel_after_running_is_harmless():
    clock, ran = Clock(), []
    timers = Timers(clock=clock)
    cancel_a = timers.call_later(1, lambda: ran.append("a"))
    cancel_b = timers.call_later(2, lambda: ran.append("b"))
    cancel_a()
    cancel_a()
    assert len(timers) == 1 and timers.next_delay() == 2  # the cancelled head is skipped
    clock.now += 5
    assert timers.run_due() == 1 and ran == ["b"]
    cancel_b()
    assert len(timers) == 0 and timers.cancelled == 0


def test_an_earlier_timer_wakes_the_sleeper_and_a_later_one_does_not():
    woken = []
    timers = Timers(clock=Clock(), on_earlier=lambda: woken.append(1))
    timers.call_later(5, lambda: None)
    timers.call_later(9, lambda: None)
    timers.call_later(1, lambda: None)
    assert len(woken) == 2


def test_a_failing_timer_is_logged_and_the_rest_still_run(caplog):
    clock, ran = Clock(), []
    timers = Timers(clock=clock)
    timers.call_later(1, lambda: 1 / 0)
    timers.call_later(1, lambda: ran.append("after"))
    clock.now += 1
    assert timers.run_due() == 2 and ran == ["after"]
    assert "ZeroDivisionError" in caplog.text


def test_many_cancels_compact_the_heap():
    timers = Timers(clock=Clock())
    cancels = [timers.call_later(i, lambda: None) for i in range(COMPACT_MIN_CANCELLED * 2)]
    for cancel in cancels[: COMPACT_MIN_CANCELLED + 10]:
        cancel()
    assert len(timers.heap) < COMPACT_MIN_CANCELLED * 2  # rebuilt without the inert entries
    assert len(timers) == COMPACT_MIN_CANCELLED - 10


def test_buckets_fire_in_due_order_with_one_timer_for_the_earliest():
    now = [1000.0]
    timers = Timers(clock=lambda: now[0])
    fired = []
    buckets = Buckets(timers.call_later, lambda due_ms, items: fired.append((due_ms, items)), wall=lambda: now[0])
    for i in range(1000):
        buckets.add(1_000_500 + i % 10, i)  # 1000 items in 10 milliseconds
    buckets.add(1_000_200, "first")
    assert len(buckets) == 1001 and len(timers) <= 2  # not a timer per item
    now[0] = 1000.3
    timers.run_due()
    assert fired == [(1_000_200, ["first"])]
    now[0] = 1000.505
    timers.run_due()
    assert [due for due, _ in fired[1:]] == list(range(1_000_500, 1_000_506))
    assert fired[1][1] == list(range(0, 1000, 10))  # in the order they were added
    now[0] = 1001
    timers.run_due()
    assert len(buckets) == 0 and len(fired) == 11
