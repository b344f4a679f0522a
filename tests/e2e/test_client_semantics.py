"""The client's side of issue 9 (extensions) against a real mqksd: ack timeout and touch, dead letters,
queue length caps, delayed publishes and rejects, request/reply, schedules, and the memory limit.

The line helpers are checked first with no broker. Every wait polls with a deadline or blocks on a
gevent event; absence and order are proven with a later message on the same queue, never a sleep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import gevent
import pytest
from conftest import BrokerProcess
from gevent.event import Event
from helpers import Inbox, make_client, unique
from waiting import WAIT_SECONDS, wait_until

from mqks.client import Client, Message, MqksConnectionError, MqksError, MqksTimeoutError, wire
from mqks.server.dispatch.slots import owner_of


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[Client]:
    client = make_client(broker)
    yield client
    client.close()


def counter(client: Client, name: str) -> int:
    """One of the broker's `stats` counters; fails loudly when the broker has none of that name."""
    figures = client.stats()
    assert name in figures, f"stats has no {name!r}: {sorted(figures)}"
    return figures[name]


# the line helpers, no broker


@pytest.mark.parametrize("data, expected", [
    (b"q1 event=e1,reply=0f3ak7f e1data", (b"q1", b"e1", 0, b"0f3ak7f", b"e1data")),
    (b"q1 event=e1,reply=0f3ak7f,retry=1 d", (b"q1", b"e1", 1, b"0f3ak7f", b"d")),
    (b"q1 event=e1,reply=k7,retry=2,seq=9 two words", (b"q1", b"e1", 2, b"k7", b"two words")),
    (b"q1 event=e1,reply=123 d", (b"q1", b"e1", 0, b"123", b"d")),
    # a publisher's event holding the server's field names: the server's fields are the rightmost
    (b"q1 event=a,reply=x,reply=k7 d", (b"q1", b"a,reply=x", 0, b"k7", b"d")),
    (b"q1 event=a,retry=5,reply=k7,retry=1 d", (b"q1", b"a,retry=5", 1, b"k7", b"d")),
    (b"q1 event=x,seq=5,reply=k7 d", (b"q1", b"x,seq=5", 0, b"k7", b"d")),
    # not a token the broker hands out: part of the event
    (b"m1 event=a,reply=UP d", (b"m1", b"a,reply=UP", 0, b"", b"d")),
    (b"m1 event=a,reply= d", (b"m1", b"a,reply=", 0, b"", b"d")),
    (b"m1 event=a,reply=x-y,retry=1 d", (b"m1", b"a,reply=x-y", 1, b"", b"d")),
    (b"m1 event=e1,retry=3 d", (b"m1", b"e1", 3, b"", b"d")),
])
def test_deliveries_of_requests_carry_the_reply_token_right_after_the_event(data: bytes, expected: tuple) -> None:
    assert wire.split_delivery_reply(data) == expected
    msg_id, event, retry, _, body = expected
    assert wire.split_delivery(data) == (msg_id, event, retry, body)


def test_spark_source_reads_a_requests_delivery_without_its_token() -> None:
    pytest.importorskip("pyspark")
    pa = pytest.importorskip("pyarrow")
    from pyspark.sql.pandas.types import to_arrow_schema

    from mqks.spark.source import source_struct, to_record_batch

    schema = source_struct()
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    plain = b"m9 event=plain,seq=9 z"
    for line, expected in ((b"m1 event=e1,reply=k7,retry=1,seq=3 d", ("e1", 1, "d")),
                           (b"m2 event=a,reply=x,reply=k7,seq=4 d", ("a,reply=x", 0, "d"))):
        for lines in ([line], [line, plain], [plain, line]):  # alone, and beside lines Arrow splits
            got = to_record_batch(lines, "q", schema.fieldNames(), arrow_schema, pa).to_pydict()
            row = lines.index(line)
            assert (got["event"][row], got["retry"][row], got["data"][row]) == expected


def test_consume_flags_of_the_extensions_as_the_broker_reads_them() -> None:
    assert wire.consume_flags(True, None, 0, ack_timeout=2, max_retries=0, max_length=10) == [
        b"--manual-ack", b"--ack-timeout=2.0", b"--max-retries=0", b"--max-length=10"]
    assert wire.consume_flags(False, None, 0, max_retries="none", max_length="none") == [
        b"--max-retries=none", b"--max-length=none"]
    assert wire.queue_setting_flags(None, None) == []


@pytest.mark.parametrize("kwargs", [
    {"ack_timeout": 0}, {"ack_timeout": -1}, {"ack_timeout": float("nan")}, {"ack_timeout": float("inf")},
    {"ack_timeout": True}, {"ack_timeout": "5"}, {"max_retries": -1}, {"max_retries": 1.5},
    {"max_retries": True}, {"max_retries": "all"}, {"max_length": 0}, {"max_length": -3}, {"max_length": "10"},
])
def test_bad_consume_settings_are_refused_before_sending(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        wire.consume_flags(True, None, 0, **kwargs)


def test_ack_timeout_needs_manual_ack() -> None:
    with pytest.raises(ValueError, match="manual_ack"):
        wire.consume_flags(False, None, 0, ack_timeout=5)


def test_publish_flags_of_delay_and_at() -> None:
    assert wire.publish_flags(None, None) == []
    assert wire.publish_flags(0, None) == [b"--delay=0.0"]
    assert wire.publish_flags(1.5, None) == [b"--delay=1.5"]
    assert wire.publish_flags(None, 1700000000) == [b"--at=1700000000.0"]
    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert wire.publish_flags(None, when) == [b"--at=" + repr(when.timestamp()).encode()]
    for delay, at in ((1, 2), (-1, None), (float("nan"), None), (float("inf"), None), (None, float("nan")),
                      (None, "tomorrow"), (True, None)):
        with pytest.raises(ValueError):
            wire.publish_flags(delay, at)


def test_schedule_arguments_and_their_bad_values() -> None:
    assert wire.schedule_args("s1", "e1", b"tick tock", every=5, cron=None, count=3, nohaste=True) == [
        b"s1", b"--every=5.0", b"--count=3", b"--nohaste", b"e1", b"tick tock"]
    assert wire.schedule_args("s1", "e1", b"", every=None, cron="*/5 * * * 1-5", count=None, nohaste=False) == [
        b"s1", b"--cron", b"*/5", b"*", b"*", b"*", b"1-5", b"e1", b""]
    assert wire.schedule_args("s1", "e1", b"", every=None, cron=["0", "9", "*", "*", "*"], count=None,
                              nohaste=False)[1:7] == [b"--cron", b"0", b"9", b"*", b"*", b"*"]
    bad: list[dict[str, Any]] = [
        {"every": None, "cron": None}, {"every": 5, "cron": "* * * * *"}, {"every": 0, "cron": None},
        {"every": -1, "cron": None}, {"every": float("nan"), "cron": None}, {"every": None, "cron": "* * * *"},
        {"every": None, "cron": "* * * * * *"}, {"every": 5, "cron": None, "count": 0},
        {"every": 5, "cron": None, "count": 2.5}]
    for kwargs in bad:
        options = {"count": None, "nohaste": False, **kwargs}
        with pytest.raises(ValueError):
            wire.schedule_args("s1", "e1", b"", **options)
    with pytest.raises(ValueError):
        wire.schedule_args("two words", "e1", b"", every=5, cron=None, count=None, nohaste=False)


def test_update_lines_give_the_queue_settings() -> None:
    line = b"--update q1 e1 e2 --max-retries=3 --max-length=100 --manual-ack --ack-timeout=5.0 --prefetch=2"
    assert wire.update_queue_settings(line) == (3, 100)
    assert wire.split_update(line) == ("q1", ["e1", "e2"])
    assert wire.update_queue_settings(b"--update q1 e1 --manual-ack") == (None, None)


def test_bad_values_are_refused_by_the_client_before_sending(client: Client) -> None:
    with pytest.raises(ValueError):
        client.consume(unique("q"), [unique("e")], Inbox(), ack_timeout=5)  # needs manual_ack
    with pytest.raises(ValueError):
        client.publish(unique("e"), "x", delay=1, at=time.time())
    with pytest.raises(ValueError):
        client.reject("c1", "m1", delay=-1)
    with pytest.raises(ValueError):
        client.request(unique("e"), "x", timeout=0)
    with pytest.raises(ValueError):
        client.schedule(unique("s"), unique("e"), "x")
    with pytest.raises(ValueError):
        client.rebind(unique("q"), max_length=0)
    assert client.ping("nothing was sent") == "nothing was sent"


# ack timeout and touch


def test_ack_timeout_requeues_an_unacked_message_with_retry_raised(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    before = counter(client, "ack_timeouts")
    # the first delivery is left alone: neither acked nor rejected
    inbox = Inbox(lambda message: message.ack() if message.retry else None)
    client.consume(queue, [event], inbox, manual_ack=True, ack_timeout=0.3)
    msg_id = client.publish(event, "forgotten")
    first, second = inbox.wait(2)[:2]
    assert (first.id, first.retry) == (msg_id, 0)
    assert (second.id, second.retry, second.data) == (msg_id, 1, "forgotten")
    wait_until(lambda: counter(client, "ack_timeouts") == before + 1, "ack_timeouts counted")


def test_touch_postpones_the_ack_timeout(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    touching = Event()

    def work(message: Message) -> None:
        if message.data != "slow":
            message.ack()
            return
        # work for two ack timeouts, touching it often (by message, and all of the consumer's): it must never time
        # out. The timeout is a whole second, twenty touches long: a loaded machine may pause a process that long
        touches = 0
        deadline = time.monotonic() + 2.0  # the scenario's own time: the work lasts this long
        while time.monotonic() < deadline:
            if touches % 2:
                client.touch(message.consumer_id, all=True)
            else:
                message.touch()
            touches += 1
            gevent.sleep(0.05)
        touching.set()
        message.ack(confirm=True)  # raises if the broker had taken it back

    before_touched = counter(client, "touched")
    before_timeouts = counter(client, "ack_timeouts")
    inbox = Inbox(work)
    client.consume(queue, [event], inbox, manual_ack=True, ack_timeout=1.0)
    client.publish(event, "slow")
    assert touching.wait(WAIT_SECONDS), "the slow work never ended"
    client.publish(event, "after")
    # a timed-out "slow" would have come back before "after"
    assert [(message.data, message.retry) for message in inbox.wait(2)] == [("slow", 0), ("after", 0)]
    assert counter(client, "ack_timeouts") == before_timeouts
    assert counter(client, "touched") > before_touched


def test_touch_of_a_message_not_in_flight_is_an_error(client: Client) -> None:
    with pytest.raises(MqksError) as caught:
        client.touch("no-such-consumer", "m1", confirm=True)
    assert caught.value.error_id
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    client.publish(event, "auto-acked")
    [message] = inbox.wait(1)
    with pytest.raises(MqksError, match="manual_ack"):
        message.touch()


# dead letters and length caps


def test_a_message_rejected_max_retries_plus_one_times_lands_in_the_dead_queue(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    before = counter(client, "dead_lettered")
    rejected = Inbox(lambda message: message.reject() if message.data == "poison pill" else message.ack())
    client.consume(queue, [event], rejected, manual_ack=True, max_retries=2)
    msg_id = client.publish(event, "poison pill")
    dead = Inbox()
    client.consume(f"{queue}.dead", None, dead)
    [message] = dead.wait(1)
    assert (message.id, message.event, message.data, message.retry) == (msg_id, event, "poison pill", 3)
    client.publish(event, "marker")
    # delivered with retry 0, 1, 2, then dead instead of a fourth time
    assert [m.retry for m in rejected.wait(4) if m.data == "poison pill"] == [0, 1, 2]
    assert counter(client, "dead_lettered") == before + 1


def test_purge_queue_and_requeue_dead_from_the_client(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    client.rebind(queue, [event], max_retries=0)
    ids = [client.publish(event, f"poison-{i}", confirm=True) for i in range(3)]
    dying = Inbox(lambda message: message.reject())
    consumer_id = client.consume(queue, None, dying, manual_ack=True)
    dying.wait(3)
    wait_until(lambda: queue_depth(client, f"{queue}.dead") == 3, "three dead letters")
    client.delete_consumer(consumer_id)
    assert client.requeue_dead(queue, msg_ids=[ids[2]]) == 1
    assert client.requeue_dead(queue, limit=1) == 1  # the oldest: ids[0]
    assert queue_depth(client, queue) == 2
    assert client.purge_queue(queue) == 2
    assert queue_depth(client, queue) == 0
    assert client.requeue_dead(queue) == 1 and queue_depth(client, queue) == 1
    with pytest.raises(ValueError, match="not both"):
        client.requeue_dead(queue, limit=1, msg_ids=[ids[0]])
    with pytest.raises(ValueError, match="bad queue"):
        client.purge_queue("two words")


def queue_depth(client: Client, queue: str) -> int:
    [row] = client.queues(queue)
    return row["depth"]


def test_rebind_max_length_refuses_confirmed_publishes_and_drops_others(client: Client) -> None:
    capped, uncapped, event = unique("capped"), unique("uncapped"), unique("e")
    client.rebind(capped, [event], max_length=2)
    client.rebind(uncapped, [event])
    client.publish(event, "1", confirm=True)
    client.publish(event, "2", confirm=True)
    with pytest.raises(MqksError) as caught:
        client.publish(event, "3", confirm=True)
    assert caught.value.error_id and capped in caught.value.reason
    before = counter(client, "dropped")
    client.publish(event, "4")
    wait_until(lambda: counter(client, "dropped") == before + 1, "the unconfirmed publish counted as dropped")
    # the other queue bound to the event got every copy
    others = Inbox()
    client.consume(uncapped, None, others)
    assert [message.data for message in others.wait(4)] == ["1", "2", "3", "4"]
    # acks drain the capped queue, and then it takes messages again
    drained = Inbox(lambda message: message.ack())
    client.consume(capped, None, drained, manual_ack=True)
    assert [message.data for message in drained.wait(2)] == ["1", "2"]
    wait_until(lambda: client.queues(capped)[0]["unacked"] == 0, "the acks")
    client.publish(event, "5", confirm=True)
    assert [message.data for message in drained.wait(3)] == ["1", "2", "5"]


def test_replay_after_a_reconnect_keeps_the_queue_settings_another_client_set(broker: BrokerProcess,
                                                                              client: Client) -> None:
    queue, event = unique("q"), unique("e")
    consumer_id = client.consume(queue, [event], Inbox(lambda message: message.ack()), manual_ack=True,
                                 ack_timeout=30, max_retries=5, max_length=100)
    other = make_client(broker)
    try:
        other.rebind(queue, add=[f"{event}-2"], max_retries=1, max_length="none")
    finally:
        other.close()
    consumer = client._consumers_by_any_id[consumer_id]
    wait_until(lambda: (consumer.max_retries, consumer.max_length) == (1, None), "the --update with the settings")
    reconnects = client.reconnects
    client._lose(client._conn, "dropped by the test")
    wait_until(lambda: client.reconnects > reconnects and client.connected, "the reconnect")
    client.ping("replayed")
    [row] = client.queues(queue)
    # the replay sent the queue's settings as the --update told them, not the ones consume started with
    assert "--max-retries=1" in row["flags"]
    assert not any(flag.startswith("--max-length") for flag in row["flags"])
    assert consumer.ack_timeout == 30


# delays


def test_delayed_publish_arrives_after_a_later_plain_one_and_not_before_its_time(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox(lambda message: arrivals.append(time.time()))
    arrivals: list[float] = []
    client.consume(queue, [event], inbox)
    due = time.time() + 0.5
    client.publish(event, "delayed", at=due, confirm=True)
    client.publish(event, "at once", confirm=True)
    wait_until(lambda: len(inbox.messages) == 2, "both messages")
    assert [message.data for message in inbox.messages] == ["at once", "delayed"]
    assert arrivals[1] >= due  # never early


def test_a_message_published_after_the_delay_expired_arrives_after_the_delayed_one(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    client.publish(event, "first", delay=0.2, confirm=True)
    client.publish(event, "second", delay=0.3, confirm=True)
    gevent.sleep(0.6)  # the scenario: the next publish comes after both were due
    client.publish(event, "third")
    assert [message.data for message in inbox.wait(3)] == ["first", "second", "third"]


def test_at_in_the_past_publishes_at_once(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    client.publish(event, "yesterday", at=datetime.now(UTC).timestamp() - 86400)
    client.publish(event, "now")
    assert [message.data for message in inbox.wait(2)] == ["yesterday", "now"]


def test_reject_with_delay_lets_later_messages_pass(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    rejected = Event()

    def handle(message: Message) -> None:
        if message.data == "retry later" and message.retry == 0:
            message.reject(confirm=True, delay=0.3)
            rejected.set()
        else:
            message.ack()

    inbox = Inbox(handle)
    client.consume(queue, [event], inbox, manual_ack=True)
    client.publish(event, "retry later")
    rejected.wait(10)
    client.publish(event, "meanwhile", confirm=True)
    # a reject without delay puts it at the front: it would come back before "meanwhile"
    assert [(message.data, message.retry) for message in inbox.wait(3)] == [
        ("retry later", 0), ("meanwhile", 0), ("retry later", 1)]


# request/reply


def queues_on_both_workers(suffix: str) -> tuple[str, str]:
    """Two queue names that a two-worker broker places on different workers (slots.owner_of)."""
    names = [f"q{number}-{suffix}" for number in range(64)]
    even = next(name for name in names if owner_of(name.encode(), 2) == 0)
    odd = next(name for name in names if owner_of(name.encode(), 2) == 1)
    return even, odd


def test_request_returns_the_workers_reply(client: Client, broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    worker = make_client(broker)
    try:
        seen = Inbox(lambda message: message.reply(f"{message.data.upper()} from {message.reply_token}"))
        worker.consume(queue, [event], seen)
        reply = client.request(event, "hello there", timeout=5)
        [message] = seen.messages
        assert message.reply_token and wire.is_reply_token(message.reply_token.encode())
        assert reply == f"HELLO THERE from {message.reply_token}"
    finally:
        worker.close()


def test_request_and_reply_in_json(client: Client, broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    worker = make_client(broker)
    try:
        worker.consume(queue, [event], Inbox(lambda message: message.reply({"sum": sum(message.data["n"])})),
                       json=True)
        assert client.request(event, {"n": [1, 2, 3], "note": "a\nb"}, timeout=5, json=True) == {"sum": 6}
    finally:
        worker.close()


def test_the_first_of_two_competing_replies_wins_and_the_other_is_counted_late(
        broker_per_worker_count: BrokerProcess) -> None:
    event = unique("e")
    client = make_client(broker_per_worker_count)
    workers = [make_client(broker_per_worker_count), make_client(broker_per_worker_count)]
    try:
        inboxes = [Inbox(lambda message, n=number: message.reply(f"w{n}")) for number in range(2)]
        for number, (worker, queue) in enumerate(zip(workers, queues_on_both_workers(event), strict=True)):
            # two queues bound to the event: each gets a copy and replies
            worker.consume(queue, [event], inboxes[number])
        before = counter(client, "replies_late")
        assert client.request(event, "who answers?", timeout=5) in ("w0", "w1")
        wait_until(lambda: counter(client, "replies_late") == before + 1, "the second reply counted late")
        assert [len(inbox.messages) for inbox in inboxes] == [1, 1]
    finally:
        for worker in workers:
            worker.close()
        client.close()


def test_request_without_a_reply_raises_timeout_with_the_brokers_error_id(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    client.rebind(queue, [event])  # bound, but nobody consumes
    before = counter(client, "request_timeouts")
    with pytest.raises(MqksTimeoutError) as caught:
        client.request(event, "anyone?", timeout=0.3)
    assert caught.value.error_id and "no reply within" in caught.value.reason
    assert counter(client, "request_timeouts") == before + 1


def test_request_to_an_event_no_queue_is_bound_to_fails_at_once(client: Client) -> None:
    event = unique("e")
    with pytest.raises(MqksError) as caught:
        client.request(event, "anyone?", timeout=30)
    assert not isinstance(caught.value, MqksTimeoutError)
    assert caught.value.error_id and event in caught.value.reason


def test_reply_to_a_publish_or_to_a_forgotten_token_is_an_error(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    client.publish(event, "not a request")
    [message] = inbox.wait(1)
    assert message.reply_token is None
    with pytest.raises(MqksError, match="not a request"):
        message.reply("nobody asked")
    with pytest.raises(MqksError) as caught:
        client._reply("zz9unknown", "nobody asked", confirm=True)
    assert caught.value.error_id


def test_a_requester_that_disconnects_raises_and_its_token_is_forgotten(
        make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker()
    requester, worker = make_client(server), make_client(server)
    try:
        queue, event = unique("q"), unique("e")
        inbox = Inbox()
        worker.consume(queue, [event], inbox)
        pending = gevent.spawn(requester.request, event, "will you answer?", timeout=30)
        [message] = inbox.wait(1)
        requester._lose(requester._conn, "dropped by the test")
        with pytest.raises(MqksConnectionError):
            pending.get(timeout=10)
        # the reconnect opens a second connection: wait until the broker has dropped the first
        wait_until(lambda: requester.connected and worker.stats()["connections"] == 2, "the old connection gone")
        with pytest.raises(MqksError) as caught:
            message.reply("too late", confirm=True)
        assert caught.value.error_id
    finally:
        requester.close()
        worker.close()


def test_request_through_raw_lines_as_nc_shows_it(broker: BrokerProcess) -> None:
    queue, event = unique("q").encode(), unique("e").encode()
    worker, requester = broker.wire(), broker.wire()
    try:
        worker.send(b"c1 consume --confirm " + queue + b" " + event)
        worker.expect(b"c1 ok ")
        requester.send(b"q1 request --timeout=5 " + event + b" what time is it")
        delivery = worker.recv_line()
        msg_id, event_got, retry, token, body = wire.split_delivery_reply(delivery[len(b"c1 ok "):])
        assert (msg_id, event_got, retry, body) == (b"q1", event, 0, b"what time is it")
        assert delivery == b"c1 ok q1 event=" + event + b",reply=" + token + b" what time is it"
        worker.send(b"r1 reply --confirm " + token + b" tea time")
        worker.expect(b"r1 ok ")
        requester.expect(b"q1 ok --reply tea time")
        worker.send(b"r2 reply " + token + b" too late")
        assert worker.barrier() == []  # dropped and counted, no error
        worker.send(b"r3 reply zz9unknown hello")
        worker.expect_error(b"r3")
    finally:
        worker.close()
        requester.close()


# schedules


def test_schedule_every_fires_count_times_with_numbered_msg_ids(client: Client) -> None:
    queue, event, name = unique("q"), unique("e"), unique("s")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    client.schedule(name, event, "tick", every=0.1, count=3)
    inbox.wait(3)

    def finished() -> bool:
        rows = [row for row in client.schedules() if row["name"] == name]
        return not rows or rows[0]["fired"] == 3

    wait_until(finished, "the schedule's third firing")
    client.publish(event, "marker")
    assert [(m.id, m.data) for m in inbox.wait(4)] == [
        (f"{name}.1", "tick"), (f"{name}.2", "tick"), (f"{name}.3", "tick"), (inbox.messages[3].id, "marker")]
    assert inbox.messages[3].data == "marker"


def test_schedules_lists_each_schedule_and_unschedule_removes_it(client: Client) -> None:
    event = unique("e")
    every, cron = unique("s-every"), unique("s-cron")
    client.schedule(every, event, "hourly data", every=3600, count=5, nohaste=True)
    client.schedule(cron, event, {"k": 1}, cron="*/5 * * * *", json=True, nohaste=True)
    rows = {row["name"]: row for row in client.schedules() if row["name"] in (every, cron)}
    assert rows[every]["rule"].startswith("every 3600")
    assert (rows[every]["fired"], rows[every]["count"], rows[every]["event"], rows[every]["data"]) == (
        0, 5, event, "hourly data")
    assert rows[every]["next_due"] > time.time() + 3000  # nohaste: one interval away
    assert rows[cron]["rule"] == "cron */5 * * * *"
    assert (rows[cron]["count"], rows[cron]["data"]) == (None, '{"k":1}')
    names = [row["name"] for row in client.schedules()]
    assert names == sorted(names)
    # re-scheduling a name replaces it
    client.schedule(every, event, "new data", every=60, nohaste=True)
    [row] = [row for row in client.schedules() if row["name"] == every]
    assert (row["rule"].startswith("every 60"), row["data"], row["count"]) == (True, "new data", None)
    client.unschedule(every)
    client.unschedule(cron)
    assert not [row for row in client.schedules() if row["name"] in (every, cron)]
    with pytest.raises(MqksError) as caught:
        client.unschedule(every)
    assert caught.value.error_id and every in caught.value.reason


def test_nohaste_waits_one_interval_and_haste_fires_at_once(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    hasty, patient = unique("hasty"), unique("patient")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    try:
        client.schedule(patient, event, "patient", every=3600, nohaste=True)
        client.schedule(hasty, event, "hasty", every=3600)
        inbox.wait(1)
        client.publish(event, "marker")
        assert [message.data for message in inbox.wait(2)] == ["hasty", "marker"]
    finally:
        client.unschedule(hasty)
        client.unschedule(patient)


def test_a_bad_cron_rule_is_refused_by_the_broker(client: Client) -> None:
    with pytest.raises(MqksError) as caught:
        client.schedule(unique("s"), unique("e"), "x", cron="61 * * * *")
    assert caught.value.error_id


# the memory limit


def test_max_memory_refuses_publishes_while_acks_drain(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker("--max-memory", "96M")
    client = make_client(server)
    try:
        queue, event = unique("q"), unique("e")
        client.rebind(queue, [event])
        chunk = "x" * (64 << 10)
        refused: MqksError | None = None
        for _ in range(200):  # at most 650 MB: far past the limit
            for _ in range(50):
                client.publish(event, chunk)
            try:
                client.publish(event, "probe", confirm=True)
            except MqksError as e:
                refused = e
                break
        assert refused is not None and refused.error_id and "memory limit reached" in refused.reason
        with pytest.raises(MqksError, match="memory limit reached"):
            client.request(event, "refused too", timeout=5)
        before = counter(client, "dropped")
        client.publish(event, chunk)  # unconfirmed: dropped and counted
        wait_until(lambda: counter(client, "dropped") == before + 1, "the dropped publish")
        drained = Event()
        inbox = Inbox(lambda message: message.ack())
        client.consume(queue, None, inbox, manual_ack=True, prefetch=100)

        def accepted_again() -> bool:
            try:
                client.publish(event, "small", confirm=True)
            except MqksError:
                return False
            drained.set()
            return True

        wait_until(accepted_again, "a publish accepted once acks drained the queue", timeout=60)
        assert drained.is_set() and inbox.messages
    finally:
        client.close()


def test_publish_arguments_put_mandatory_before_the_delay_flags() -> None:
    assert wire.publish_args("e", "d", False, None, None, mandatory=True) == [b"--mandatory", b"e", b"d"]
    assert wire.publish_args("e", "d", False, 2, None, mandatory=True) == [b"--mandatory", b"--delay=2.0", b"e", b"d"]
    assert wire.publish_args("e", "d", False, None, None) == [b"e", b"d"]


@pytest.mark.parametrize("reason, consume_again, publish_again", [
    # the broker's words (workers/relay.py, workers/peers.py): nothing was run, it passes by itself
    ("group 3, which owns this, has no owner reachable from here (failing over): try again", True, True),
    ("worker 1, which owns this, is restarting: try again", True, True),
    # a request asked of every worker (stats, queues, schedules): asked again by both clients, a publish is not
    ("group 3 has no owner reachable from here (failing over): ask again in a moment", True, False),
    ("group 1 is not linked here (its owner failing over): the queues it binds are unknown, so the message was "
     "not published; try again", True, True),
    # some queues have the message: a publish sent again would make copies
    ("group 2, which owns a bound queue, has no owner reachable from here (failing over): the message was not put "
     "there", True, False),
    ("worker 2, which owns a bound queue, is restarting: the message was not put there", True, False),
    ("unknown action \"pubish\"", False, False),
])
def test_which_refusals_each_client_call_sends_again(reason: str, consume_again: bool, publish_again: bool) -> None:
    from mqks.client.errors import is_transient, not_done_try_again

    error = MqksError(reason, "e1")
    assert (is_transient(error), not_done_try_again(error)) == (consume_again, publish_again)
    assert not not_done_try_again(MqksTimeoutError(reason))  # no answer: the publish may have been done
