"""The asyncio client (`mqks.aio`) against a real broker over TCP: one worker and two, a data dir, TLS and a token,
kill -9 and restart, cancellation, flow control, and inside a real ASGI app served by uvicorn.

Every test runs its coroutine through `run`, which fails it for any task left pending after `close()`, any error
the loop reported (a task destroyed while pending, an exception nobody retrieved), and, with the module's
warnings-as-errors, any warning (a coroutine never awaited, a transport left open).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aio_helpers import client_of, run, take
from conftest import BrokerProcess
from helpers import free_port, queue_owned_by, unique
from waiting import WAIT_SECONDS, until

from mqks import aio
from mqks.client.errors import MqksConnectionError, MqksError, MqksTimeoutError
from mqks.server.dispatch.slots import owner_of

pytestmark = pytest.mark.filterwarnings("error")

TOKEN = "aio-s3cret-0123456789"


async def queue_row(client: aio.Client, queue: str) -> dict[str, Any]:
    [row] = [row for row in await client.queues() if row["queue"] == queue]
    return row


def test_publish_consume_and_ack_as_an_async_iterator(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> list[Any]:
        async with client_of(broker) as client:
            consumer = await client.consume(queue, [event], manual_ack=True, prefetch=10, json=True)
            for n in range(3):
                await client.publish(event, {"n": n}, confirm=True, json=True)
            messages = await take(consumer, 3)
            for message in messages:
                await message.ack(confirm=True)
            row = await queue_row(client, queue)
            assert (row["depth"], row["unacked"], row["consumers"]) == (0, 0, 1)
            [detail] = await client.queues(queue, detail=True)
            assert detail["events"] == [event] and detail["consumer_list"][0]["prefetch"] == 10
            return [(message.event, message.data, message.retry) for message in messages]

    assert run(main) == [(event, {"n": 0}, 0), (event, {"n": 1}, 0), (event, {"n": 2}, 0)]


def test_a_callback_consumer_runs_plain_and_async_callbacks_in_order(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> tuple[list[str], list[str]]:
        plain: list[str] = []
        awaited: list[str] = []

        async def slow(message: aio.Message) -> None:
            await asyncio.sleep(0)
            awaited.append(message.data)
            await message.ack()

        async with client_of(broker) as client:
            await client.consume(queue, [event], lambda message: plain.append(message.data))
            await client.consume(unique("q"), [event], slow, manual_ack=True)
            for n in range(20):
                await client.publish(event, str(n))
            await until(lambda: len(plain) == 20 and len(awaited) == 20, "both consumers' 20 messages")
        return plain, awaited

    plain, awaited = run(main)
    assert plain == awaited == [str(n) for n in range(20)]


def test_a_failing_callback_rejects_its_message_and_it_comes_back_with_a_retry(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> list[int]:
        retries: list[int] = []

        def handle(message: aio.Message) -> None:
            retries.append(message.retry)
            if message.retry == 0:
                raise RuntimeError("first try fails")

        async with client_of(broker) as client:
            await client.consume(queue, [event], handle, manual_ack=True)
            await client.publish(event, "x", confirm=True)
            await until(lambda: len(retries) == 2, "the redelivery")
        return retries

    assert run(main) == [0, 1]


def test_work_queue_extensions_reject_with_delay_touch_and_dead_letters(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> None:
        async with client_of(broker) as client:
            consumer = await client.consume(queue, [event], manual_ack=True, ack_timeout=30, max_retries=1)
            dead_letters = await client.consume(f"{queue}.dead", None, manual_ack=True)
            await client.publish(event, "late", delay=0.2, confirm=True)
            [message] = await take(consumer, 1)
            await message.touch(confirm=True)
            await message.reject(confirm=True, delay=0.1)
            [again] = await take(consumer, 1)
            assert (again.data, again.retry) == ("late", 1)
            await again.reject(confirm=True)  # past max_retries: a dead letter
            [letter] = await take(dead_letters, 1)
            assert (letter.event, letter.data, letter.retry) == (event, "late", 2)
            await letter.ack(confirm=True)
            auto = await client.consume(unique("q"), [event])
            await client.publish(event, "auto", confirm=True)
            [auto_message] = await take(auto, 1)
            with pytest.raises(MqksError, match="manual_ack"):
                await auto_message.reject()

    run(main)


def test_purge_queue_and_requeue_dead(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> None:
        async with client_of(broker) as client:
            await client.rebind(queue, [event], max_retries=0)
            for i in range(3):
                await client.publish(event, f"poison-{i}", confirm=True)
            consumer = await client.consume(queue, None, manual_ack=True)
            for message in await take(consumer, 3):
                await message.reject(confirm=True)
            await consumer.cancel()
            assert (await queue_row(client, f"{queue}.dead"))["depth"] == 3
            assert await client.requeue_dead(queue, limit=2) == 2
            assert await client.purge_queue(queue) == 2
            assert (await queue_row(client, queue))["depth"] == 0
            assert await client.requeue_dead(queue) == 1
            assert (await queue_row(client, queue))["depth"] == 1

    run(main)


def test_a_schedule_fires_its_count_and_is_gone(broker: BrokerProcess) -> None:
    schedule_run(broker)


def schedule_run(broker: BrokerProcess) -> None:
    queue, event, name = unique("q"), unique("e"), unique("s")

    async def main() -> list[str]:
        async with client_of(broker) as client:
            consumer = await client.consume(queue, [event])
            await client.schedule(name, event, "tick", every=0.05, count=2)
            assert name in [row["name"] for row in await client.schedules()]
            ticks = await take(consumer, 2)
            with pytest.raises(MqksError):
                await client.unschedule(name)  # done after its count: gone
            return [tick.id for tick in ticks]

    assert run(main) == [f"{name}.1", f"{name}.2"]


def test_request_and_reply_and_their_refusals(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> Any:
        async with client_of(broker) as server, client_of(broker) as caller:
            async def answer(message: aio.Message) -> None:
                await message.reply({"echo": message.data}, json=True)

            await server.consume(queue, [event], answer, json=True)
            reply = await caller.request(event, {"q": 1}, json=True, timeout=5)
            with pytest.raises(MqksError, match="no queue"):
                await caller.request(unique("nobody"), "x", timeout=1)
            silent = unique("silent")
            await server.consume(unique("q"), [silent])  # takes it, never replies
            with pytest.raises(MqksTimeoutError):
                await caller.request(silent, "x", timeout=0.3)
            return reply

    assert run(main) == {"echo": {"q": 1}}


def test_bad_arguments_fail_before_anything_is_sent(broker: BrokerProcess) -> None:
    async def main() -> None:
        async with client_of(broker) as client:
            with pytest.raises(ValueError, match="forbids"):
                await client.publish("e", "two\nlines")
            with pytest.raises(ValueError, match="whitespace"):
                await client.publish("an event", "x")
            with pytest.raises(ValueError, match="prefetch"):
                await client.consume(unique("q"), ["e"], prefetch=5)
            with pytest.raises(ValueError, match="msg ids or all"):
                await client.ack("c1")
            assert await client.ping("still here") == "still here"

    run(main)


def test_a_full_buffer_stops_reading_until_the_iterator_catches_up(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    count, max_buffered, line = 20_000, 50, "x" * 100

    async def main() -> None:
        async with client_of(broker) as publisher, client_of(broker) as reader:
            consumer = await reader.consume(queue, [event], max_buffered=max_buffered)
            for _ in range(count):
                await publisher.publish(event, line)
            await publisher.ping()
            # the broker holds what the paused reader does not take: the client's buffer stays near its bound
            await until(lambda: consumer.buffered >= max_buffered, "the buffer to fill")
            # on the queue owner's link: the public one, or with two workers a direct one
            await until(lambda: consumer.conn is not None and consumer.conn.held_back_by, "reading to pause")
            stats = await publisher.stats()
            assert stats["published"] >= count
            held = consumer.buffered
            # one read's worth past the bound at most (asyncio reads up to 256 KiB at a time)
            assert held < max_buffered + (256 * 1024) // len(line) + 1 < count
            got = await take(consumer, count)
            assert [message.data for message in got] == [line] * count
            assert consumer.conn is not None and not consumer.conn.held_back_by

    run(main)


def test_prefetch_bounds_what_a_manual_ack_consumer_holds(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> None:
        async with client_of(broker) as client:
            consumer = await client.consume(queue, [event], manual_ack=True, prefetch=5)
            for n in range(50):
                await client.publish(event, str(n), confirm=n == 49)
            await until(lambda: consumer.buffered == 5, "five deliveries")
            await client.ping()
            assert consumer.buffered == 5 and (await queue_row(client, queue))["unacked"] == 5
            seen = []
            async with asyncio.timeout(WAIT_SECONDS):
                async for message in consumer:
                    seen.append(message.data)
                    await message.ack()
                    assert len(consumer.unacked) <= 5
                    if len(seen) == 50:
                        break
            assert seen == [str(n) for n in range(50)]

    run(main)


def test_cancelled_waits_leave_the_client_usable(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")

    async def main() -> None:
        async with client_of(broker) as client:
            confirm = asyncio.create_task(client.publish(event, "x", confirm=True))
            await asyncio.sleep(0)  # it has sent its line and awaits the ok
            confirm.cancel()
            with pytest.raises(asyncio.CancelledError):
                await confirm
            consumer = await client.consume(queue, [event], manual_ack=True)

            async def read_one() -> None:
                async for _ in consumer:
                    pass

            reader = asyncio.create_task(read_one())
            await asyncio.sleep(0)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            consuming = asyncio.create_task(client.consume(unique("q"), [event]))
            await asyncio.sleep(0)
            consuming.cancel()
            with pytest.raises(asyncio.CancelledError):
                await consuming
            await client.publish(event, "y", confirm=True)
            [message] = await take(consumer, 1)  # the same consumer, still iterable after the cancelled read
            assert message.data == "y"
            await message.ack(confirm=True)
            await client.ping()
            assert client._link.conn is not None and client._link.conn.answers.waiters == {}
            # the cancelled consume was taken back on the broker: only our consumer is left on that event's queues
            assert (await queue_row(client, queue))["consumers"] == 1

    run(main)


def test_close_ends_every_iterator_and_callback_task(broker: BrokerProcess) -> None:
    async def main() -> list[str]:
        ended: list[str] = []
        client = await client_of(broker).connect()
        consumer = await client.consume(unique("q"), [unique("e")])

        async def read() -> None:
            async for _ in consumer:
                pass
            ended.append("iterator")

        reader = asyncio.create_task(read())
        await client.consume(unique("q"), [unique("e")], lambda message: None)
        await asyncio.sleep(0)
        await client.close()
        await asyncio.wait_for(reader, WAIT_SECONDS)
        with pytest.raises(MqksConnectionError, match="closed"):
            await client.publish("e", "after close")
        return ended

    assert run(main) == ["iterator"]


@pytest.mark.parametrize("flags", [(), ("--data-dir",)], ids=["in-memory", "data-dir"])
def test_kill_9_and_restart_replays_every_consumer(make_broker: Callable[..., BrokerProcess], tmp_path: Path,
                                                   flags: tuple[str, ...]) -> None:
    args = ["--data-dir", str(tmp_path / "data")] if flags else []
    server = make_broker(*args)
    queue, event = unique("q"), unique("e")

    async def main() -> None:
        hooks: list[str] = []
        async with client_of(server) as client:
            consumer = await client.consume(queue, [event], manual_ack=True,
                                            on_disconnect=lambda old: hooks.append("disconnect"),
                                            on_reconnect=lambda old, new: hooks.append("reconnect"))
            first_id = consumer.id
            await client.publish(event, "before", confirm=True)
            [before] = await take(consumer, 1)
            await before.ack(confirm=True)
            if flags:
                await client.publish(event, "kept", confirm=True)  # confirmed before the kill: survives it
            await asyncio.to_thread(server.kill)
            await until(lambda: not client.connected, "the client to notice the kill")
            late = asyncio.create_task(client.publish(event, "sent while down", confirm=True, timeout=WAIT_SECONDS))
            await asyncio.to_thread(make_broker, *args, port=server.port)
            await late
            expected = ["kept", "sent while down"] if flags else ["sent while down"]
            got = await take(consumer, len(expected))
            assert sorted(message.data for message in got) == expected
            assert consumer.id != first_id and {message.consumer_id for message in got} == {consumer.id}
            for message in got:
                await message.ack(confirm=True)
            await client.ack(first_id, "unknown-msg")  # the first id still names the consumer: a no-op here
            assert hooks[:2] == ["disconnect", "reconnect"]
            assert client.reconnects >= 1

    run(main)


def test_with_two_workers_consumes_and_acks_go_to_the_owners_link(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker("--workers", "2", "--eval")
    queues = [queue_owned_by(worker, 2) for worker in (0, 1)]
    event = unique("e")

    async def main() -> None:
        async with client_of(server) as client:
            consumers = [await client.consume(queue, [event], manual_ack=True) for queue in queues]
            assert client._homes.placement is not None and client._homes.placement.workers == 2
            assert [consumer.home.worker for consumer in consumers if consumer.home] == [0, 1]
            for n in range(10):
                await client.publish(event, str(n))
            for consumer in consumers:
                got = await take(consumer, 10)
                assert [message.data for message in got] == [str(n) for n in range(10)]
                for message in got:
                    await message.ack()
            await client.ping()
            for queue in queues:
                row = await queue_row(client, queue)
                assert (row["depth"], row["unacked"]) == (0, 0)

    run(main)


def test_consumers_follow_their_queues_through_restarts_with_one_then_three_workers(
        make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker("--workers", "2")
    port = server.port
    event = unique("e")
    queues = [queue_owned_by(0, 2), queue_owned_by(1, 2)]
    queues += [q for q in (queue_owned_by(1, 2) for _ in range(40)) if owner_of(q.encode(), 3) == 2][:1]

    async def main() -> None:
        nonlocal server
        async with client_of(port) as client:
            consumers = {queue: await client.consume(queue, [event]) for queue in queues}
            for workers in (1, 3):
                await asyncio.to_thread(server.kill)
                server = await asyncio.to_thread(make_broker, "--workers", str(workers), port=port)
                sent = f"with {workers}"
                for consumer in consumers.values():
                    # in memory: the replay re-creates the queue and its binding; publish until it has
                    async with asyncio.timeout(WAIT_SECONDS):
                        while True:
                            await client.publish(event, sent, confirm=True)
                            got = [m async for m in _drain(consumer)]
                            if sent in [message.data for message in got]:
                                break
                            await asyncio.sleep(0.1)
                if workers == 3:
                    placement = client._homes.placement
                    assert placement is not None and placement.workers == 3
                    for queue, consumer in consumers.items():
                        assert consumer.home is not None and consumer.home.worker == owner_of(queue.encode(), 3)
                else:
                    assert client._homes.placement is None
                    assert all(consumer.home is client._consumers for consumer in consumers.values())

    run(main)


async def _drain(consumer: aio.Consumer) -> AsyncIterator[aio.Message]:
    """What `consumer` holds now, without waiting for more."""
    while consumer.buffered:
        async with asyncio.timeout(WAIT_SECONDS):
            yield await anext(consumer)


def test_a_publisher_waits_while_the_broker_reads_nothing_and_loses_nothing(
        make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker("--eval")
    count, line = 20_000, "x" * 10_000  # 200 MB: far past what the kernel's socket buffers hold

    async def main() -> None:
        async with client_of(server, ping_seconds=60) as client:
            published_before = (await client.stats())["published"]
            server.signal(signal.SIGSTOP)
            try:
                sent = 0

                async def publish_all() -> None:
                    nonlocal sent
                    for _ in range(count):
                        await client.publish("nobody-listens", line)
                        sent += 1

                publisher = asyncio.create_task(publish_all())
                conn = client._link.conn
                assert conn is not None
                await until(lambda: conn.write_paused is not None, "the transport to push back")
                paused_at = sent
                await asyncio.sleep(0.2)  # a window for the publisher to run on, if it did not wait
                assert sent == paused_at < count
                transport = conn.transport
                assert transport is not None and transport.get_write_buffer_size() < 2 * 1024 * 1024
            finally:
                server.signal(signal.SIGCONT)
            await asyncio.wait_for(publisher, WAIT_SECONDS * 6)
            await client.ping()
            assert (await client.stats())["published"] - published_before == count

    run(main)


def test_a_draining_broker_gets_what_the_consumer_holds_settled_then_the_client_moves_to_its_fallback(
        make_broker: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    first = make_broker("--drain-seconds", "20", "--data-dir", str(tmp_path / "data"))
    second = make_broker()
    queue, event = unique("q"), unique("e")

    async def main() -> None:
        hooks: list[str] = []
        async with client_of(first, fallbacks=[(second.host, second.port)]) as client:
            consumer = await client.consume(queue, [event], manual_ack=True,
                                            on_reconnect=lambda old, new: hooks.append(new))
            for n in range(3):
                await client.publish(event, f"p{n}", confirm=True)
            [held] = await take(consumer, 1)  # at work on the first message when the drain begins
            first.signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            await held.ack()
            rest = await take(consumer, 2)
            for message in rest:
                await message.ack()
            # the broker exits once our acks are in, long before its 20 s are up; the client goes to the fallback
            await until(lambda: first.proc is not None and first.proc.poll() is not None, "the drain to finish", 15)
            assert first.proc is not None and first.proc.returncode == 0
            await until(lambda: client.connected and client._link.port == second.port, "the move to the fallback")
            await client.publish(event, "on the second", confirm=True)
            [last] = await take(consumer, 1)  # the iteration runs on_reconnect first, in delivery order
            assert (last.data, last.retry) == ("on the second", 0)
            assert hooks == [last.consumer_id]
            assert [(message.data, message.retry) for message in rest] == [("p1", 0), ("p2", 0)]

    run(main)


def test_the_asyncio_client_never_imports_gevent() -> None:
    import subprocess
    import sys

    code = "import sys, mqks.aio; assert 'gevent' not in sys.modules, sorted(m for m in sys.modules if 'gevent' in m)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_tls_with_a_token_and_the_refusals_without_one(make_broker: Callable[..., BrokerProcess], certs: Any,
                                                       tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    tls_port = free_port()
    server = make_broker(*certs.server_args(tls_port), "--auth-token-file", str(tmp_path / "tokens"))
    queue, event = unique("q"), unique("e")

    async def main() -> None:
        async with client_of(tls_port, tls=certs.client_context(), token=TOKEN) as client:
            consumer = await client.consume(queue, [event])
            await client.publish(event, "secret", confirm=True)
            [message] = await take(consumer, 1)
            assert message.data == "secret"
        with pytest.raises(MqksConnectionError, match="refused the token"):
            await client_of(tls_port, tls=certs.client_context(), token="wrong").connect(retry=False)
        with pytest.raises(MqksConnectionError, match="requires a token"):
            await client_of(server, token=None).connect(retry=False)
        with pytest.raises(MqksConnectionError, match="speaks TLS"):
            await client_of(tls_port, token=TOKEN).connect(retry=False)

    run(main)


def test_a_consume_whose_line_is_lost_with_its_connection_returns_once_the_replay_has_it(
        make_broker: Callable[..., BrokerProcess], monkeypatch: pytest.MonkeyPatch) -> None:
    """As the gevent client's: consume() returns only once the broker has the consumer, so a publish right after it
    is routed to the queue, even when the consume's line was lost with its connection (never sent)."""
    from mqks.aio.connection import Connection

    server = make_broker()
    queue, event = unique("q"), unique("e")
    write = Connection.write
    lost: list[bytes] = []

    async def main() -> list[Any]:
        async with client_of(server) as client, client_of(server) as publisher:
            def lose_the_consume(conn: Connection, line: bytes) -> None:
                if b" consume " in line and not lost and conn.link is client._link:
                    lost.append(line)
                    asyncio.get_running_loop().call_soon(conn.link.lose, conn, "dropped by the test, consume unsent")
                    return
                write(conn, line)

            monkeypatch.setattr(Connection, "write", lose_the_consume)
            consumer = await client.consume(queue, [event])
            assert lost, "the consume line was not the one lost"
            await publisher.publish(event, "right after consume() returned", confirm=True)
            return [message.data for message in await take(consumer, 1)]

    assert run(main) == ["right after consume() returned"]


def test_keepalive_notices_a_frozen_broker_and_reconnects_after(make_broker: Callable[..., BrokerProcess]) -> None:
    server = make_broker()

    async def main() -> None:
        async with client_of(server, ping_seconds=0.1, ping_timeout_seconds=0.5) as client:
            server.signal(signal.SIGSTOP)
            try:
                await until(lambda: not client.connected, "the missing pong to drop the connection")
            finally:
                server.signal(signal.SIGCONT)
            await until(lambda: client.connected, "the reconnect")
            assert await client.ping("back") == "back"

    run(main)


def test_a_peer_that_is_not_mqks_is_refused_with_a_clear_error() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    async def main() -> None:
        async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(http, sock=listener)
        async with server:
            with pytest.raises(aio.MqksProtocolError, match="does not speak MQKS"):
                await client_of(port).connect(retry=False)

    run(main)


def test_under_uvloop(broker: BrokerProcess) -> None:
    uvloop = pytest.importorskip("uvloop")
    queue, event = unique("q"), unique("e")

    async def main() -> list[str]:
        async with client_of(broker) as client:
            consumer = await client.consume(queue, [event], manual_ack=True)
            for n in range(100):
                await client.publish(event, str(n))
            got = await take(consumer, 100)
            for message in got:
                await message.ack()
            return [message.data for message in got]

    assert run(main, loop_factory=uvloop.new_event_loop) == [str(n) for n in range(100)]


def test_inside_an_asgi_app_a_request_handler_publishes(make_broker: Callable[..., BrokerProcess]) -> None:
    starlette = pytest.importorskip("starlette.applications")
    uvicorn = pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from contextlib import asynccontextmanager

    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    server = make_broker()
    queue, event = unique("q"), unique("e")

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with client_of(server) as client:
            app.state.mqks = client
            yield

    async def order(request: Request) -> JSONResponse:
        body = await request.json()
        msg_id = await request.app.state.mqks.publish(event, body, json=True, confirm=True)
        return JSONResponse({"msg_id": msg_id}, status_code=202)

    app = starlette.Starlette(routes=[Route("/orders", order, methods=["POST"])], lifespan=lifespan)
    http_port = free_port()

    async def main() -> list[Any]:
        web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=http_port, log_level="warning",
                                            lifespan="on"))
        serving = asyncio.create_task(web.serve())
        try:
            await until(lambda: web.started, "uvicorn to start")
            async with client_of(server) as reader:
                consumer = await reader.consume(queue, [event], json=True)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}") as http:
                    answers = [await http.post("/orders", json={"item": n}) for n in range(3)]
                assert [answer.status_code for answer in answers] == [202] * 3
                got = await take(consumer, 3)
                assert [message.id for message in got] == [answer.json()["msg_id"] for answer in answers]
                return [message.data for message in got]
        finally:
            web.should_exit = True
            await serving

    assert run(main) == [{"item": 0}, {"item": 1}, {"item": 2}]


def test_on_refused_gets_the_error_of_a_publish_sent_without_confirm_before_close_returns(
        broker: BrokerProcess) -> None:
    """As the gevent client's: plain and async hooks both, each refusal in by the time close() returns."""
    event = unique("unbound")
    refused: list[MqksError] = []

    async def later(error: MqksError) -> None:
        await asyncio.sleep(0)
        refused.append(error)

    async def main() -> None:
        for hook in (refused.append, later):
            client = client_of(broker, on_refused=hook)
            async with client:
                await client.publish(event, "refused", mandatory=True)
                await client.publish(event, "gone quietly")

    run(main)
    assert len(refused) == 2 and all(f"no queue is bound to '{event}'" in e.reason for e in refused), refused


def test_flush_returns_with_every_refusal_started_and_the_client_still_open(broker: BrokerProcess) -> None:
    """As the gevent client's flush(): close()'s barrier, without the close."""
    event = unique("unbound")
    refused: list[MqksError] = []

    async def main() -> str:
        async with client_of(broker, on_refused=refused.append) as client:
            await client.publish(event, "refused", mandatory=True)
            await client.flush()
            assert len(refused) == 1 and f"no queue is bound to '{event}'" in refused[0].reason, refused
            return await client.ping("still open")

    assert run(main) == "still open"
