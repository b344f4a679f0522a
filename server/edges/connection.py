"""One client's socket, read in big chunks, written in batches.

The reader greenlet does `recv(65536)`, splits every complete line, runs them all, then
flushes every outbox the batch touched (`Process.flush_pending`): one `b"".join` and one
`os.write` on the non-blocking fd per connection per batch, never a write per message.
What a socket does not take goes to that connection's writer greenlet, so a slow client
blocks only its own writer.

Memory stays bounded: past the high-water mark an outbox gets no more deliveries
(messages wait in their queues), and past `max_output_bytes` of unsent replies (a client
that floods without reading) that one connection is closed. A closed connection never
writes again: its descriptor number may already belong to a newer client.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import gevent
from gevent.event import Event

from ..core.state import Consumer
from ..dispatch.actions import ONE_PROCESS, Action, Handler, HandlerTables, Publisher, actions_for, run_lines
from ..dispatch.process import Process
from ..dispatch.scopes import ScopedPublisher
from ..wire.outbox import Outbox
from ..wire.protocol import LineSplitter, format_error, format_ok
from ..workers.frames import Frame
from ..workers.relay import RelaySession
from .config import Config
from .sessions import SilenceWatch, Token, Tokens

if TYPE_CHECKING:
    from ..workers.peers import Peers

log = logging.getLogger("mqks.connection")

RECV_BYTES = 65536
# a connection that keeps the socket full never blocks, so gevent would never switch away
# from it: after this many bytes it waits for the loop's next poll of the sockets (yield_turn),
# so every other client that is ready gets a turn. gevent.sleep(0) resumes before the loop polls
# sockets again (a side client's worst ping waited 340 ms beside one flooder, bench/fairness.py);
# with no yield the ping waited for the whole flood.
# Only bytes read while the loop did not turn count: a connection whose socket ran dry waited in
# the loop, and everyone else ready had a turn then (a consumer acking each delivery does that
# often, and paid a yield per 256 KiB of acks it did not owe: -35% per-message acks, issue 24).
FAIR_SHARE_BYTES = 4 * RECV_BYTES
YIELD_TURN_SECONDS = 1e-6  # more than 0: gevent.sleep(0) is a callback run before the poll, a delay is a timer
LOWEST_PRIORITY = -2  # libev's EV_MINPRI (libuv ignores priorities)
PUBLISH = b" publish "
BACKLOG_POLL_SECONDS = 0.005
LOG_FIRST_ERRORS = 100
LOG_EVERY_NTH_ERROR = 1000
CLOSE_FLUSH_SECONDS = 1.0
# a client that closed its writing side (`nc -q`, shutdown(SHUT_WR)) still reads: its lines are
# answered and what it is owed is written before the connection closes, for this long at most
HALF_CLOSE_SECONDS = 10.0
HALF_CLOSE_POLL_SECONDS = 0.005


def yield_turn() -> None:
    """Wait for the event loop's next poll of the sockets, behind every client that is ready then.

    A lowest-priority timer, not gevent.idle(): an idle watcher runs only in a turn with nothing else
    pending, so while another greenlet or timer had work in every turn a flooding connection waited in
    idle() for good, never read and never cut off (CI: test_errors' flooder kept for 30 s). A timer fires
    in the next turn, busy or not; its priority puts it after the other watchers pending in that turn.
    """
    hub = gevent.get_hub()
    timer = hub.loop.timer(YIELD_TURN_SECONDS)
    timer.priority = LOWEST_PRIORITY
    hub.wait(timer)


class LoopTurns:
    """How many times the event loop has polled, for a loop that does not count them itself (libev's
    `iteration` costs nothing; this counts with a check watcher, a Python call per turn)."""

    __slots__ = ("iteration", "watcher")

    def __init__(self) -> None:
        self.iteration = 0
        self.watcher = gevent.get_hub().loop.check(ref=False)  # it must not keep the loop alive on its own
        self.watcher.start(self.turned)

    def turned(self) -> None:
        self.iteration += 1


_loop_turns: Any = None


def loop_turns() -> Any:
    """Something whose `iteration` grows with each turn of the event loop: the loop itself under libev."""
    global _loop_turns
    if _loop_turns is None:
        loop = gevent.get_hub().loop
        _loop_turns = loop if hasattr(loop, "iteration") else LoopTurns()
    return _loop_turns


class Connection:
    """A client: its socket, its line splitter, and the outbox its replies and deliveries go to."""

    __slots__ = ("sock", "fd", "peer", "peer_is_loopback", "eval_enabled", "process", "outbox", "consumers_by_id",
                 "actions", "handlers", "publisher", "splitter", "next_error_id", "wake", "writing", "closed",
                 "max_output_bytes", "errors", "tls", "tokens", "authenticated", "token", "unauthenticated_lines",
                 "eval_refusal", "said_hello", "ttl_seconds", "reads", "silence_watch", "draining", "tables",
                 "relay")

    def __init__(self, sock: socket.socket, address: object, config: Config, process: Process,
                 next_error_id: Callable[[], str], *, tls: bool = False, tokens: Tokens | None = None,
                 eval_refusal: str | None = None, silence_watch: SilenceWatch | None = None,
                 tables: HandlerTables = ONE_PROCESS) -> None:
        # our writes are already batched; Nagle would only hold a lone delivery back
        # until the peer's delayed ACK (measured: 12 ms p50 at 20k msg/s without this)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.fd = sock.fileno()
        self.peer = f"{address[0]}:{address[1]}" if isinstance(address, tuple) else str(address)
        self.peer_is_loopback = _is_loopback(address)
        self.eval_enabled = config.eval_enabled and eval_refusal is None
        self.eval_refusal = eval_refusal
        self.process = process
        self.tls = tls
        # a TLS socket is written by its writer greenlet only: the kernel fd would bypass the encryption
        self.outbox = Outbox(process.pending, config.max_output_bytes // 4, self.wake_writer if tls else self.flush)
        self.consumers_by_id: dict[bytes, Consumer] = self.outbox.consumers_by_id
        self.tokens = tokens
        self.authenticated = tokens is None
        self.token: Token | None = None  # the token it proved; its scope (None: full access) guards its lines
        self.unauthenticated_lines = 0
        self.tables = tables
        self.actions: dict[bytes, Action] = actions_for(self.eval_enabled, self.peer_is_loopback, self.authenticated)
        self.handlers: dict[bytes, Handler] = tables.for_session(self.eval_enabled, self.peer_is_loopback,
                                                                 self.authenticated, process.memory_full)
        self.said_hello = False
        self.ttl_seconds: float | None = None
        self.reads = 0  # recv calls: the silence watch compares it between its checks
        self.silence_watch = silence_watch
        self.draining = False  # the server is stopping: deliveries stay paused
        self.publisher: Publisher = process.publisher
        # with worker processes: this client's session on the other workers
        # the process's Peering is workers/peers.py's Peers: the layer above dispatch/, so not named there
        self.relay = RelaySession(self, cast("Peers", process.peers)) if process.peers is not None else None
        self.splitter = LineSplitter(config.max_line_bytes)
        self.next_error_id = next_error_id
        self.wake = Event()
        self.writing = False  # the writer greenlet is inside sendall: only it may write now
        self.closed = False
        self.max_output_bytes = config.max_output_bytes
        self.errors = 0
        if config.client_ttl and silence_watch is not None:
            self.set_ttl(config.client_ttl)

    def write(self, data: bytes) -> None:
        outbox = self.outbox
        outbox.write(data)
        if outbox.out_bytes > self.max_output_bytes:
            self.close_unread()

    def close_unread(self) -> None:
        """The client owes a read of more than --max-output-bytes: it is cut off."""
        if not self.closed:
            log.warning("closing %s: %d bytes of replies unread (limit %d)", self.peer, self.outbox.out_bytes,
                        self.max_output_bytes)
            self.close()

    def ok(self, rid: bytes, data: bytes = b"") -> None:
        self.write(format_ok(rid, data))

    def error(self, rid: bytes, reason: str, line: bytes) -> None:
        error_id = self.next_error_id()
        self.errors += 1
        self.process.errors += 1
        # a client looping on a bad line must not flood the log: the first ones in full,
        # then one line per LOG_EVERY_NTH_ERROR
        if self.errors <= LOG_FIRST_ERRORS or self.errors % LOG_EVERY_NTH_ERROR == 0:
            log.warning("error %s for %s: %s; line %r (error %d of this client)", error_id, self.peer, reason,
                        line[:200], self.errors)
        self.write(format_error(rid, error_id, reason))

    def authenticate(self, token: bytes) -> bool | None:
        """Check `token`; a match opens every action this peer may run, as far as the token's scope allows (None:
        the server wants no token). A second `auth` with another token takes that token's scope."""
        tokens = self.tokens
        if tokens is None:
            return None
        address = self.peer.rpartition(":")[0] or self.peer
        wait = tokens.throttle.wait_seconds(address)
        if wait:  # this address failed too often: its attempts wait their turn (this connection alone sleeps)
            gevent.sleep(wait)
        found = tokens.find(token)
        if found is None:
            failures, delay = tokens.throttle.failed(address)
            # the peer and how often, never the attempt: a near-miss would give away most of a secret
            log.warning("auth failed from %s (%d failures from it%s)", address, failures,
                        f"; its next attempt waits {delay:g} s" if delay else "")
            return False
        tokens.throttle.succeeded(address)
        if not self.authenticated or found is not self.token:
            self.authenticated = True
            self.token = found
            self.actions = actions_for(self.eval_enabled, self.peer_is_loopback)
            self.refresh_handlers(self.process.memory_full)
            log.info("%s authenticated as token %r%s", self.peer, found.name,
                     "" if found.scope is None else " (scoped)")
        return True

    def refresh_handlers(self, over_memory: bool) -> None:
        """The handler table this session runs and its publisher: its auth state, its token's scope, the memory
        state."""
        scope = self.token.scope if self.token is not None else None
        self.handlers = self.tables.for_session(self.eval_enabled, self.peer_is_loopback, self.authenticated,
                                                over_memory, scope)
        self.publisher = self.process.publisher if scope is None else ScopedPublisher(self.process.publisher, scope,
                                                                                      self)

    def set_ttl(self, seconds: float | None) -> None:
        """Expect a line at least every `seconds`; after 2x that in silence the connection is closed."""
        self.ttl_seconds = seconds
        if self.silence_watch is not None:
            if seconds:
                self.silence_watch.watch(self)
            else:
                self.silence_watch.forget(self)

    def resumed(self) -> None:
        """The client read its backlog: local consumers deliver again, and so do the owners of relayed ones."""
        relay = self.relay
        if relay is not None and relay.owed_credit:
            relay.give_credit()
        self.process.resume(self.outbox)

    def wake_writer(self) -> None:
        """The flush of a TLS connection: its writer greenlet encrypts and sends the batch."""
        self.wake.set()

    def flush(self) -> None:
        """Send what is owed now, as far as the socket takes it; the writer greenlet sends the rest.

        Writing here, in the greenlet that produced the output, saves a wake-up and a switch to
        the writer per batch. The fd is non-blocking (gevent), so a full socket never stalls us.
        """
        outbox = self.outbox
        if self.writing or outbox.paused or self.closed:
            self.wake.set()
            return
        out = outbox.pieces()
        data = b"".join(out) if len(out) != 1 else out[0]
        try:
            # self.fd is -1 once the connection closed: a descriptor number the kernel has
            # handed to a newer client must never receive this one's bytes
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        except OSError as e:
            log.info("write to %s failed: %s", self.peer, e)
            self.close()
            return
        self.process.bytes_out += sent
        if sent == len(data):
            out.clear()
            outbox.out_bytes = 0
            relay = self.relay
            if relay is not None and relay.owed_credit:
                relay.give_credit()  # flushed within this batch's flush_pending, which goes on to the links
        else:
            outbox.out = [memoryview(data)[sent:]]
            outbox.out_bytes = len(data) - sent
            self.wake.set()

    def close(self, flush_first: bool = False) -> None:
        """Drop the client: wakes the reader (EOF) and the writer (EPIPE).

        `flush_first` sends what is owed (say, the error that explains the close) first, waiting at
        most CLOSE_FLUSH_SECONDS for a peer that does not read.
        """
        if flush_first and not self.closed and self.outbox.out and not self.writing:
            data = b"".join(self.outbox.pieces())
            self.outbox.discard()
            self.outbox.out_bytes = 0
            try:
                with gevent.Timeout(CLOSE_FLUSH_SECONDS):
                    self.sock.sendall(data)
            except (OSError, gevent.Timeout):
                pass
        self.closed = True
        self.outbox.discard()
        if self.fd >= 0:
            # shut down in the kernel, beneath gevent's wrapper: gevent's own shutdown() cancels
            # the reader's wait with EBADF ("File descriptor was closed in another greenlet"),
            # which read as a failed read for every client at SIGTERM; the kernel's shutdown
            # wakes the reader with a plain EOF. The borrowed object must never close the fd.
            kernel_sock = socket.socket(self.sock.family, self.sock.type, fileno=self.fd)
            try:
                kernel_sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                kernel_sock.detach()
        self.wake.set()

    def serve(self) -> None:
        """Run the connection until the client or the server closes it."""
        process = self.process
        process.clients += 1
        log.info("connected %s (%d clients)", self.peer, process.clients)
        writer = gevent.spawn(self._write_loop)
        try:
            self._read_loop()
        except OSError as e:
            log.info("read from %s failed: %s", self.peer, e)
        finally:
            self._clean_up(writer)

    def _clean_up(self, writer: gevent.Greenlet) -> None:
        """Detach every consumer (their un-acked messages go back), then release the socket.

        Runs to the end whatever one consumer's clean-up raises: a consumer left attached
        to a closed connection would keep taking messages nobody can receive.
        """
        process = self.process
        self.closed = True
        self.fd = -1
        process.clients -= 1
        if self.silence_watch is not None:
            self.silence_watch.forget(self)
        process.detach(self.outbox, self._log_failed_detach)
        if self.relay is not None:
            self.relay.leave()
        self.outbox.discard()
        try:
            process.flush_pending()  # the requeued messages, to the consumers that remain
        except Exception:
            log.exception("flush after %s left failed", self.peer)
        # the writer goes before the socket: closing a socket under a writer blocked in
        # sendall would fail that send with EBADF, logged as a failed write
        writer.kill(block=True, timeout=1)
        self.sock.close()
        log.info("disconnected %s (%d clients)", self.peer, process.clients)

    def _log_failed_detach(self, consumer: Consumer, error: BaseException) -> None:
        log.error("clean-up of consumer %r of %s failed; detaching it anyway", consumer.consumer_id, self.peer,
                  exc_info=error)

    def recv_tls(self, size: int) -> bytes:
        """A TLS read (one record, 16 KiB at most), then every record already received, up to `size` bytes.

        Keeps batches as large as on a plain socket: a batch per record would mean four times the
        flushes and writer wake-ups for the same lines.
        """
        sock = self.sock
        first = sock.recv(size)
        if not first:
            return first
        parts, got = [first], len(first)
        sock.settimeout(0.0)  # gevent: a read that would wait raises instead
        try:
            while got < size:
                try:
                    part = sock.recv(size - got)
                except (ssl.SSLWantReadError, BlockingIOError):
                    break
                if not part:
                    break
                parts.append(part)
                got += len(part)
        finally:
            sock.settimeout(None)
        return b"".join(parts) if len(parts) > 1 else first

    def _read_loop(self) -> None:
        recv = self.recv_tls if self.tls else self.sock.recv
        splitter = self.splitter
        feed, rejected = splitter.feed, splitter.rejected
        process = self.process
        pending = process.pending
        flush_pending = process.flush_pending
        journal = process.journal
        delayed = process.delayed
        delayed_keys = delayed.keys  # a heap, changed in place
        relay = self.relay
        debug = log.isEnabledFor(logging.DEBUG)
        unyielded_bytes = 0
        turns = loop_turns()
        turn_seen = turns.iteration
        while not self.closed:
            chunk = recv(RECV_BYTES)
            if not chunk:
                if not self.closed:
                    self.finish_after_eof()
                return
            self.reads += 1
            process.bytes_in += len(chunk)
            lines = feed(chunk)
            if lines:
                if debug:
                    log.debug("%s sent %d lines: %r", self.peer, len(lines), [redact(line) for line in lines[:20]])
                if delayed_keys and delayed_keys[0] <= time.time() * 1000:
                    # what came due goes first: a line read after a due time sees that message published
                    delayed.fire_due()
                run_lines(self, lines, rejected)
                if relay is not None:
                    if relay.held is not None:
                        relay.run_held(rejected)
                    relay.note_flushed_links()
            if pending or journal is not None:  # durable: the batch's records are committed there too
                flush_pending()
            if journal is not None and journal.backlogged and PUBLISH in chunk:
                # back-pressure: a publisher waits while the disk is behind; a connection that
                # only acks never does (its acks are what lets the queues drain)
                while journal.backlogged and not self.closed:
                    gevent.sleep(BACKLOG_POLL_SECONDS)
            if turns.iteration != turn_seen:  # the loop polled since we last looked: the others had a turn
                turn_seen = turns.iteration
                unyielded_bytes = len(chunk)
            else:
                unyielded_bytes += len(chunk)
                if unyielded_bytes >= FAIR_SHARE_BYTES:
                    unyielded_bytes = 0
                    yield_turn()
                    turn_seen = turns.iteration

    def finish_after_eof(self) -> None:
        """The client half-closed: it takes no new deliveries, but every line it sent is answered (durable
        confirms, other workers' answers) and all it is owed is written before the close, within
        HALF_CLOSE_SECONDS.

        Its consumers leave at once, as on a full close: what they hold goes back to its queue (a
        message the client then still reads comes twice, never not at all), and nothing more is
        taken from a queue for a client that may never read it.
        """
        outbox = self.outbox
        self.draining = True  # the writer must not resume deliveries once it has caught up
        outbox.paused = True
        process = self.process
        relay = self.relay
        if relay is not None:
            relay.mark_other_workers()  # what its lines caused on other workers comes back before the marks
        process.detach(outbox, self._log_failed_detach)
        if relay is not None and relay.key:
            relay.tell(Frame.SESSION_LEFT)  # behind the marks: the owners answer them, then drop its relayed consumers
        process.flush_pending()
        deadline = time.monotonic() + HALF_CLOSE_SECONDS
        while not self.closed and self.owes_answers_or_bytes():
            if time.monotonic() > deadline:
                log.warning("%s closed its side and has not read what it is owed for %g s: closing (%d bytes "
                            "unwritten, %d answers from other workers awaited)", self.peer, HALF_CLOSE_SECONDS,
                            outbox.out_bytes, relay.awaiting if relay is not None else 0)
                return
            self.wake.set()
            gevent.sleep(HALF_CLOSE_POLL_SECONDS)

    def owes_answers_or_bytes(self) -> bool:
        """True while a line of this client waits for its answer, or bytes for it wait to be written."""
        outbox = self.outbox
        relay = self.relay
        if outbox.out or self.writing or (relay is not None and (relay.held is not None or relay.awaiting)):
            return True
        journal = self.process.journal
        if journal is not None and journal.owes(outbox):
            return True
        peers = self.process.peers
        return peers is not None and peers.answers_owed_to(outbox)

    def _write_loop(self) -> None:
        wake = self.wake
        sendall = self.sock.sendall
        outbox = self.outbox
        process = self.process
        relay = self.relay
        try:
            while not self.closed:
                wake.wait()
                wake.clear()
                while outbox.out and not self.closed:
                    out = outbox.pieces()
                    outbox.out = []
                    outbox.out_bytes = 0
                    self.writing = True
                    data = out[0] if len(out) == 1 else b"".join(out)
                    del out  # while sendall waits on a slow client, its bytes are held once, not twice
                    sendall(data)
                    self.writing = False
                    process.bytes_out += len(data)
                    if outbox.out_bytes < outbox.high_water_bytes // 2:
                        if outbox.paused and not self.draining:
                            outbox.paused = False
                            self.resumed()
                        elif relay is not None and relay.owed_credit:
                            relay.give_credit()
                            process.flush_pending()
        except OSError as e:
            log.info("write to %s failed: %s", self.peer, e)
            self.close()


def redact(line: bytes | None) -> bytes | None:
    """The line as a log may show it: an `auth` line loses its token."""
    if line and b" auth " in line[:80]:
        rid, _, rest = line.partition(b" ")
        if rest.startswith(b"auth "):
            return rid + b" auth ***"
    return line


def _is_loopback(address: object) -> bool:
    if not isinstance(address, tuple):
        return True  # a Unix socket is local by construction
    try:
        return ipaddress.ip_address(address[0]).is_loopback
    except ValueError:
        return False
