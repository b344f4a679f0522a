"""The Python client against a real mqksd: callbacks, confirms, acks, keepalive, reconnect and replay.

Every wait polls with a deadline or blocks on a gevent event; absence is proven with a later
message on the same queue or a ping on the same connection, never with a sleep.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator

import gevent
import pytest
from conftest import BrokerProcess, free_port
from gevent.event import Event
from helpers import Inbox, make_client, unique
from waiting import wait_until

from mqks.client import Client, Message, MqksError
from mqks.client.client import MqksConnectionError, MqksTimeoutError

WAIT_SECONDS = 10.0


@pytest.fixture
def client(broker: BrokerProcess) -> Iterator[Client]:
    client = make_client(broker)
    yield client
    client.close()


def test_callback_gets_published_message(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    consumer_id = client.consume(queue, [event], inbox)
    msg_id = client.publish(event, "hello world")
    [message] = inbox.wait(1)
    assert (message.id, message.event, message.data, message.retry, message.consumer_id) == (
        msg_id, event, "hello world", 0, consumer_id)


def test_mask_subscription_gets_json_with_newlines_and_tabs(client: Client) -> None:
    queue, prefix = unique("q"), unique("user")
    inbox = Inbox()
    client.consume(queue, [f"{prefix}.*.created"], inbox, json=True)
    payload = {"text": "line one\nline two\tafter a tab", "n": [1, 2]}
    client.publish(f"{prefix}.42.created", payload, json=True)
    [message] = inbox.wait(1)
    assert message.event == f"{prefix}.42.created"
    assert message.data == payload


def test_data_with_newline_or_bad_event_is_refused_before_sending(client: Client) -> None:
    with pytest.raises(ValueError):
        client.publish("e1", "two\nlines")
    with pytest.raises(ValueError):
        client.publish("has space", "data")
    with pytest.raises(TypeError):
        client.consume(unique("q"), "e1", Inbox())  # a bare string instead of a list of events


def test_publish_confirm_returns_after_ok(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    msg_id = client.publish(event, "confirmed", confirm=True)
    assert inbox.wait(1)[0].id == msg_id


def test_a_mandatory_publish_to_no_queue_raises_and_one_to_a_bound_event_arrives(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    with pytest.raises(MqksError) as caught:
        client.publish(event, "to nowhere", confirm=True, mandatory=True)
    assert caught.value.error_id and "no queue is bound to" in caught.value.reason
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    msg_id = client.publish(event, "somewhere", confirm=True, mandatory=True)
    assert [(m.id, m.data) for m in inbox.wait(1)] == [(msg_id, "somewhere")]


def test_confirm_error_raises_mqks_error_with_error_id(client: Client) -> None:
    with pytest.raises(MqksError) as caught:
        client.ack("no-such-consumer", "m1", confirm=True)
    assert caught.value.error_id
    assert "no-such-consumer" in caught.value.reason
    with pytest.raises(MqksError) as caught:
        client.reject("no-such-consumer", all=True, confirm=True)
    assert caught.value.error_id
    assert client.ping("still alive") == "still alive"


def test_manual_ack_through_message_ack_is_not_redelivered(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    first = Inbox(lambda message: message.ack())
    consumer_id = client.consume(queue, [event], first, manual_ack=True)
    client.publish(event, "acked")
    first.wait(1)
    assert client.ping("acks sent") == "acks sent"  # the ack line is ahead of this pong
    client.delete_consumer(consumer_id)
    second = Inbox(lambda message: message.ack())
    client.consume(queue, [event], second, manual_ack=True)
    client.publish(event, "marker")
    # an un-acked "acked" would be back in the queue ahead of the marker
    assert [message.data for message in second.wait(1)] == ["marker"]


def test_reject_redelivers_with_retry_1(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox(lambda message: message.reject() if message.retry == 0 else message.ack())
    client.consume(queue, [event], inbox, manual_ack=True)
    msg_id = client.publish(event, "again")
    first, second = inbox.wait(2)[:2]
    assert (first.id, first.retry) == (msg_id, 0)
    assert (second.id, second.retry, second.data) == (msg_id, 1, "again")


def test_raising_callback_rejects_manual_ack_message(client: Client) -> None:
    queue, event = unique("q"), unique("e")

    def fail_first(message: Message) -> None:
        if message.retry == 0:
            raise RuntimeError("callback bug (expected by the test)")
        message.ack()

    inbox = Inbox(fail_first)
    client.consume(queue, [event], inbox, manual_ack=True)
    client.publish(event, "boom")
    assert [message.retry for message in inbox.wait(2)[:2]] == [0, 1]


def test_raising_callback_does_not_stop_the_consumer(client: Client) -> None:
    queue, event = unique("q"), unique("e")

    def fail_on_bad(message: Message) -> None:
        if message.data == "bad":
            raise RuntimeError("callback bug (expected by the test)")

    inbox = Inbox(fail_on_bad)
    client.consume(queue, [event], inbox)
    client.publish(event, "bad")
    client.publish(event, "good")
    assert [message.data for message in inbox.wait(2)] == ["bad", "good"]
    assert client.ping("reader alive") == "reader alive"


def test_slow_callback_does_not_block_answers(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    release = Event()
    inbox = Inbox(lambda message: release.wait())
    client.consume(queue, [event], inbox)
    client.publish(event, "slow")
    inbox.wait(1)
    # the callback is stuck; confirms and pongs still come back through the reader
    client.publish(event, "queued behind it", confirm=True)
    assert client.ping("not stuck") == "not stuck"
    release.set()
    assert [message.data for message in inbox.wait(2)] == ["slow", "queued behind it"]


def test_update_lines_keep_the_client_view_of_events(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    consumer_id = client.consume(queue, [event], Inbox())
    client.rebind(queue, add=[f"{event}-added"])
    wait_until(lambda: client.consumer_events(consumer_id) == [event, f"{event}-added"], "the --update")
    client.rebind(queue, remove=[event])
    wait_until(lambda: client.consumer_events(consumer_id) == [f"{event}-added"], "the second --update")


def test_ack_several_msg_ids_in_one_call(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    consumer_id = client.consume(queue, [event], inbox, manual_ack=True)
    client.publish(event, "one")
    client.publish(event, "two")
    first, second = inbox.wait(2)
    client.ack(consumer_id, first.id, second.id, confirm=True)
    client.delete_consumer(consumer_id)
    again = Inbox()
    client.consume(queue, [event], again, manual_ack=True)
    client.publish(event, "marker")
    assert [message.data for message in again.wait(1)] == ["marker"]


def test_two_messages_with_the_same_msg_id_are_both_acked(broker: BrokerProcess, client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox(lambda message: message.ack())
    consumer_id = client.consume(queue, [event], inbox, manual_ack=True)
    wire = broker.wire()
    try:
        # msg ids are the publishers' own: two publishers may well both say "m1"
        wire.send(f"m1 publish {event} first".encode(), f"m1 publish {event} second".encode())
        wire.barrier()
    finally:
        wire.close()
    assert [message.id for message in inbox.wait(2)] == ["m1", "m1"]
    assert client.ping("acks sent") == "acks sent"
    client.delete_consumer(consumer_id)
    again = Inbox()
    client.consume(queue, [event], again, manual_ack=True)
    client.publish(event, "marker")
    assert [message.data for message in again.wait(1)] == ["marker"]


def test_prefetch_caps_messages_in_flight(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    consumer_id = client.consume(queue, [event], inbox, manual_ack=True, prefetch=1)
    for n in range(3):
        client.publish(event, f"m{n}", confirm=True)
    assert client.ping("barrier") == "barrier"  # every delivery sent before the pong has been read
    assert client._consumers_by_any_id[consumer_id].unacked.keys() == {inbox.wait(1)[0].id}
    inbox.messages[0].ack()
    assert [message.data for message in inbox.wait(2)] == ["m0", "m1"]
    with pytest.raises(ValueError):
        client.consume(queue, [event], Inbox(), prefetch=2)  # prefetch needs manual_ack


def test_delete_consumer_stops_its_callbacks(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    deleted = Inbox()
    consumer_id = client.consume(queue, [event], deleted)
    client.delete_consumer(consumer_id)
    kept = Inbox()
    client.consume(queue, [event], kept)
    client.publish(event, "after delete")
    kept.wait(1)
    assert deleted.messages == []


def test_fifty_greenlets_publish_with_confirm_each_confirmed_once(broker_per_worker_count: BrokerProcess) -> None:
    client = make_client(broker_per_worker_count)
    try:
        queue, event = unique("q"), unique("e")
        inbox = Inbox()
        client.consume(queue, [event], inbox)
        results: list[str] = []

        def publish(n: int) -> None:
            results.append(client.publish(event, f"message {n}", confirm=True))

        greenlets = [gevent.spawn(publish, n) for n in range(50)]
        gevent.joinall(greenlets, raise_error=True)
        assert len(results) == 50 and len(set(results)) == 50
        assert client._conn is not None and client._conn.answers.waiters == {}  # no answer left waiting
        messages = inbox.wait(50)
        assert sorted(message.data for message in messages) == sorted(f"message {n}" for n in range(50))
        assert {message.id for message in messages} == set(results)
        assert client.ping("no more") == "no more"
        assert len(inbox.messages) == 50
    finally:
        client.close()


def test_big_message_spanning_many_reads_arrives_whole(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    big = "".join(chr(ord("a") + n % 26) for n in range(600_000))  # past the write high-water mark too
    client.publish(event, big, confirm=True)
    client.publish(event, "small after big")
    assert [message.data for message in inbox.wait(2)] == [big, "small after big"]


class CountingSocket:
    """A socket proxy that counts sendall calls."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.sendalls = 0

    def sendall(self, data: bytes) -> None:
        self.sendalls += 1
        self.sock.sendall(data)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_publishes_in_a_loop_go_out_in_few_writes(client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    counting = CountingSocket(client._conn.sock)
    client._conn.sock = counting
    for n in range(1000):
        client.publish(event, f"m{n}")
    assert client.ping("flushed") == "flushed"
    assert counting.sendalls <= 5, counting.sendalls  # one batch, plus the ping's
    assert [message.data for message in inbox.wait(1000)] == [f"m{n}" for n in range(1000)]


def test_ping_and_eval(client: Client) -> None:
    assert client.ping("hello there") == "hello there"
    assert client.ping() == ""
    assert client.eval("1 + 1") == "2"
    assert client.eval("process.worker", worker=0) == "0"
    with pytest.raises(MqksError):
        client.eval("1 +")


def test_eval_refused_without_eval_flag(make_broker: Callable[..., BrokerProcess]) -> None:
    client = make_client(make_broker())
    try:
        with pytest.raises(MqksError) as caught:
            client.eval("1")
        assert caught.value.error_id
    finally:
        client.close()


def test_connect_raises_after_its_timeout() -> None:
    client = Client("127.0.0.1", free_port(), connect_timeout_seconds=0.5, reconnect_max_seconds=0.1)
    with pytest.raises(MqksConnectionError):
        client.connect()


def test_connect_without_retry_raises_at_the_first_refusal_naming_it() -> None:
    port = free_port()
    client = Client("127.0.0.1", port, connect_timeout_seconds=30.0)
    with pytest.raises(MqksConnectionError) as caught:
        client.connect(retry=False)
    assert str(caught.value) == f"cannot connect to 127.0.0.1:{port}: Connection refused"


def test_stats_answers_the_figures_of_the_broker_and_of_each_worker(broker_per_worker_count: BrokerProcess) -> None:
    client = make_client(broker_per_worker_count)
    try:
        queue, event = unique("q"), unique("e")
        client.rebind(queue, [event])
        for n in range(3):
            client.publish(event, f"m{n}", confirm=True)
        figures = client.stats()
        for key in ("published", "queued", "consumed", "acked", "rejected", "queues", "consumers",
                    "messages_waiting", "messages_unacked", "clients", "events", "top_queues", "workers", "version",
                    "uptime_seconds", "connections", "bytes_in", "bytes_out", "errors"):
            assert key in figures, key
        assert [queue, 3] in figures["top_queues"]
        per_worker = [client.stats(worker=n) for n in range(figures["workers"])]
        assert [one["worker"] for one in per_worker] == list(range(figures["workers"]))
        assert sum(one["messages_waiting"] for one in per_worker) == client.stats()["messages_waiting"]
        with pytest.raises(MqksError):
            client.stats(worker=figures["workers"])  # no such worker
        with pytest.raises(ValueError):
            client.stats(worker=-1)
    finally:
        client.close()


def test_queues_answers_one_dict_per_queue_filtered_by_mask(client: Client) -> None:
    prefix = unique("qs")
    inbox = Inbox()
    client.rebind(f"{prefix}.a", [f"{prefix}-e"])
    client.consume(f"{prefix}.b", [f"{prefix}-e", f"{prefix}.*.x"], inbox, manual_ack=True)
    client.rebind(f"{prefix}-other", [f"{prefix}-e"])
    client.publish(f"{prefix}-e", "hello", confirm=True)
    inbox.wait(1)
    assert client.queues(f"{prefix}.*") == [
        {"queue": f"{prefix}.a", "depth": 1, "unacked": 0, "leased": 0, "consumers": 0, "bindings": 1, "flags": []},
        {"queue": f"{prefix}.b", "depth": 0, "unacked": 1, "leased": 0, "consumers": 1, "bindings": 2, "flags": []},
    ]
    assert [row["queue"] for row in client.queues(f"{prefix}-other")] == [f"{prefix}-other"]
    names = [row["queue"] for row in client.queues()]
    assert {f"{prefix}.a", f"{prefix}.b", f"{prefix}-other"} <= set(names) and names == sorted(names)
    assert client.queues(unique("none.*")) == []


def test_queues_of_many_queues_arrive_whole_over_many_reads(client: Client) -> None:
    prefix = unique("many")
    names = [f"{prefix}.{'x' * 200}{n:04d}" for n in range(800)]  # about 200 KiB of answer lines
    for name in names:
        client.rebind(name, [f"{prefix}-e"], confirm=False)
    assert [row["queue"] for row in client.queues(f"{prefix}.*")] == names
    assert client.ping("after") == "after"  # the stream is still in step


def test_close_flushes_fire_and_forget_publishes(broker: BrokerProcess, client: Client) -> None:
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    client.consume(queue, [event], inbox)
    publisher = make_client(broker)
    for n in range(500):  # no yield in between: one batch, sent by close()
        publisher.publish(event, f"m{n}")
    publisher.close()
    assert [message.data for message in inbox.wait(500)] == [f"m{n}" for n in range(500)]


def test_publish_while_disconnected_raises_after_timeout(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker()
    client = make_client(server)
    try:
        server.kill()
        wait_until(lambda: not client.connected, "the client to notice the kill")
        with pytest.raises(MqksConnectionError):
            client.publish("e1", "nowhere to go", timeout=0.3)
        with pytest.raises(MqksConnectionError):
            client.publish("e1", "nowhere to go", confirm=True, timeout=0.3)
        waiting = gevent.spawn(client.publish, "e1", "waits for a reconnect", timeout=WAIT_SECONDS * 10)
        gevent.sleep(0)  # let it start waiting
        client.close()
        with pytest.raises(MqksConnectionError, match="closed"):
            waiting.get(timeout=WAIT_SECONDS)  # close wakes it long before its own timeout
    finally:
        client.close()


def test_sigkill_and_restart_replays_consumers_with_current_events(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker("--eval")
    client = make_client(server)
    try:
        queue, event = unique("q"), unique("e")
        timeline: list[str] = []  # callbacks and hooks in the order the consumer ran them
        inbox = Inbox(lambda message: (timeline.append(f"message {message.consumer_id}"), message.ack()))
        reconnects: list[tuple[str, str]] = []
        disconnects: list[str] = []

        def on_reconnect(old: str, new: str) -> None:
            reconnects.append((old, new))
            timeline.append(f"reconnect {new}")

        consumer_id = client.consume(queue, [event], inbox, manual_ack=True,
                                     on_disconnect=disconnects.append, on_reconnect=on_reconnect)
        client.rebind(queue, add=[f"{event}-added"])
        wait_until(lambda: f"{event}-added" in client.consumer_events(consumer_id), "the --update")

        server.kill()
        wait_until(lambda: disconnects == [consumer_id], "on_disconnect")
        # published while the broker is down: waits for the reconnect, then goes through
        late = gevent.spawn(client.publish, f"{event}-added", "sent while down", confirm=True, timeout=WAIT_SECONDS)
        make_broker("--eval", port=server.port)

        wait_until(lambda: reconnects, "on_reconnect")
        [(old_id, new_id)] = reconnects
        assert old_id == consumer_id and new_id != consumer_id
        late.get(timeout=WAIT_SECONDS)
        client.publish(event, "after restart", confirm=True)
        messages = inbox.wait(2)
        assert sorted(message.data for message in messages) == ["after restart", "sent while down"]
        assert {message.consumer_id for message in messages} == {new_id}
        assert timeline == [f"reconnect {new_id}", f"message {new_id}", f"message {new_id}"]
        assert client.consumer_events(consumer_id) == [event, f"{event}-added"]
    finally:
        client.close()


@pytest.fixture
def one_link_broker(make_broker: Callable[..., BrokerProcess]) -> BrokerProcess:
    return make_broker()


@pytest.fixture
def one_link_client(one_link_broker: BrokerProcess) -> Iterator[Client]:
    """A client of a one-worker broker: consumers and publishes share its one link (these tests drop it)."""
    client = make_client(one_link_broker)
    yield client
    client.close()


def test_many_reconnects_keep_consuming_and_forget_old_ids(one_link_client: Client) -> None:
    client = one_link_client
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    reconnects: list[tuple[str, str]] = []
    hooks: list[str] = []

    def on_reconnect(old: str, new: str) -> None:
        reconnects.append((old, new))
        hooks.append("reconnect")

    first_id = client.consume(queue, [event], inbox, on_reconnect=on_reconnect,
                              on_disconnect=lambda consumer_id: hooks.append("disconnect"))
    for flap in range(1, 7):
        # right after on_reconnect the handshake may still wait for its pong: both cases get dropped
        client._lose(client._conn, "dropped by the test")
        wait_until(lambda flap=flap: len(reconnects) == flap, f"reconnect {flap}")
    assert [old for old, _ in reconnects] == [first_id] + [new for _, new in reconnects[:-1]]
    assert hooks == ["disconnect", "reconnect"] * 6
    client.publish(event, "after six reconnects", confirm=True)
    [message] = inbox.wait(1)
    assert message.consumer_id == reconnects[-1][1]
    assert len(client._consumers_by_any_id) <= 5  # not one alias per reconnect
    client.delete_consumer(first_id)  # the id consume() returned still names it
    assert client._consumers_by_any_id == {} and client._consumers_by_id == {}


def test_connection_lost_during_the_handshake_keeps_hooks_alternating(one_link_client: Client) -> None:
    client = one_link_client
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    hooks: list[str] = []
    handshaking: list[bool] = []

    def on_reconnect(old: str, new: str) -> None:
        hooks.append("reconnect")
        if len(handshaking) == 0:
            # on_reconnect runs as soon as the replayed consume is confirmed, before the handshake's pong
            handshaking.append(not client.connected)
            client._lose(client._conn, "dropped by the test during the handshake")

    client.consume(queue, [event], inbox, on_reconnect=on_reconnect,
                   on_disconnect=lambda consumer_id: hooks.append("disconnect"))
    client._lose(client._conn, "dropped by the test")
    wait_until(lambda: len(hooks) == 4 and client.connected, "the second reconnect")
    assert handshaking == [True]
    assert hooks == ["disconnect", "reconnect", "disconnect", "reconnect"]
    client.publish(event, "still consuming", confirm=True)
    assert [message.data for message in inbox.wait(1)] == ["still consuming"]


def test_a_consume_whose_line_is_lost_with_its_connection_returns_once_the_replay_has_it(
        one_link_broker: BrokerProcess, one_link_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """consume() returns only once the broker has the consumer: a publish right after it is routed to the queue.
    Here its line is lost with the connection (never sent): the reconnect's replay is what makes it."""
    from mqks.client.connection import Connection

    client = one_link_client
    queue, event = unique("q"), unique("e")
    inbox = Inbox()
    write = Connection.write
    lost: list[bytes] = []

    def lose_the_consume(conn: Connection, line: bytes) -> None:
        if b" consume " in line and not lost:
            lost.append(line)
            gevent.spawn(client._lose, conn, "dropped by the test with a consume unsent")
            return
        write(conn, line)

    monkeypatch.setattr(Connection, "write", lose_the_consume)
    client.consume(queue, [event], inbox)
    assert lost, "the consume line was not the one lost"
    publisher = make_client(one_link_broker)
    try:
        publisher.publish(event, "right after consume() returned", confirm=True)
    finally:
        publisher.close()
    assert [message.data for message in inbox.wait(1)] == ["right after consume() returned"]


def test_timeouts_leave_no_answer_waiting_and_no_stray_consumer(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker()
    client = make_client(server, ping_seconds=60.0)  # no keepalive verdict during the freeze
    try:
        queue, event = unique("q"), unique("e")
        server.signal(signal.SIGSTOP)
        try:
            with pytest.raises(gevent.Timeout), gevent.Timeout(0.2):  # the caller's own timeout stays the caller's
                client.publish(event, "frozen", confirm=True)
            with pytest.raises(MqksTimeoutError):
                client.consume(queue, [event], Inbox(), timeout=0.2)
            with pytest.raises(MqksTimeoutError):
                client.ping("frozen", timeout=0.2)
            assert client._conn.answers.waiters == {}
        finally:
            server.signal(signal.SIGCONT)
        assert client.ping("thawed") == "thawed"
        inbox = Inbox()
        client.consume(queue, [event], inbox)
        client.publish(event, "one")
        client.publish(event, "two")
        # a consumer left over from the timed-out consume would take one of them
        assert [message.data for message in inbox.wait(2)] == ["one", "two"]
    finally:
        client.close()


def test_sigstop_is_detected_by_missed_pong_then_resumed(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker()
    client = make_client(server, ping_seconds=0.2, ping_timeout_seconds=1.0, timeout_seconds=1.0)
    try:
        queue, event = unique("q"), unique("e")
        inbox = Inbox()
        disconnected = Event()
        reconnected = Event()
        client.consume(queue, [event], inbox, on_disconnect=lambda consumer_id: disconnected.set(),
                       on_reconnect=lambda old, new: reconnected.set())
        server.signal(signal.SIGSTOP)
        try:
            assert disconnected.wait(WAIT_SECONDS), "the frozen broker was not detected"
            assert not client.connected
        finally:
            server.signal(signal.SIGCONT)
        assert reconnected.wait(WAIT_SECONDS), "no reconnect after SIGCONT"
        client.publish(event, "after resume", confirm=True)
        assert [message.data for message in inbox.wait(1)] == ["after resume"]
    finally:
        client.close()


def test_the_line_helpers_import_without_gevent() -> None:
    import subprocess
    import sys

    code = "import sys, mqks.client.wire; assert 'gevent' not in sys.modules, 'gevent was imported'"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_on_refused_gets_the_error_of_a_publish_sent_without_confirm_before_close_returns(
        broker: BrokerProcess) -> None:
    """A refusal nobody waits for goes to on_refused (issue 55: the CLI exits 1 with it), every one of them in by
    the time close()'s barrier returns; a publish that was not refused adds nothing."""
    refused: list[MqksError] = []
    client = make_client(broker, on_refused=refused.append)
    event = unique("unbound")
    try:
        client.publish(event, "one", mandatory=True)
        client.publish(event, "gone quietly")
        client.publish(event, "two", mandatory=True)
    finally:
        client.close()
    assert [type(error) for error in refused] == [MqksError, MqksError], refused
    assert all(f"no queue is bound to '{event}'" in error.reason and error.error_id for error in refused), refused


def test_flush_returns_with_every_refusal_in_and_the_client_still_open(broker: BrokerProcess) -> None:
    """`flush()` is close()'s barrier without the close: what `mqks` commands wait for before they exit 0."""
    refused: list[MqksError] = []
    client = make_client(broker, on_refused=refused.append)
    event = unique("unbound")
    try:
        client.publish(event, "refused", mandatory=True)
        client.flush()
        assert len(refused) == 1 and f"no queue is bound to '{event}'" in refused[0].reason, refused
        assert client.ping("still open") == "still open"
    finally:
        client.close()


QUIET_SCRIPT = """
import logging, sys, time
import gevent
from mqks import aio  # its logger too
from mqks.client import Client

client = Client("127.0.0.1", int(sys.argv[1]), reconnect_max_seconds=0.1).connect()
print("connected", flush=True)
sys.stdin.readline()  # the test has killed the broker
deadline = time.monotonic() + 10
# lost (a WARNING), then a reconnect attempt failed (a WARNING each)
while not (client.reconnects and client._link.last_error is not None) and time.monotonic() < deadline:
    gevent.sleep(0.01)
logging.getLogger("mqks.aio").warning("the asyncio client's logger")
client.close(flush=False)
print("reconnecting" if client.reconnects and client._link.last_error else "never lost", flush=True)
"""


def test_a_program_that_configures_no_logging_hears_nothing_of_the_clients(
        make_broker: Callable[..., BrokerProcess]) -> None:
    """The clients' loggers have a NullHandler (issue 55): Python's last resort printed each reconnect's WARNING
    on the stderr of an application that never configured logging (25 lines in one failover)."""
    import subprocess
    import sys

    server = make_broker()
    proc = subprocess.Popen([sys.executable, "-c", QUIET_SCRIPT, str(server.port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "connected\n"
        server.kill()
        stdout, stderr = proc.communicate("\n", timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, stdout, stderr) == (0, "reconnecting\n", "")
