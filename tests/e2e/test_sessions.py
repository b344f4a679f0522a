"""Sessions and security over real TCP and TLS: TLS transcripts, token auth, hello with a TTL, graceful drain.

Certificates are made at test time by `openssl` (tests/tls_certs.py). A silent peer is a raw socket
that stops sending; a drain is a real SIGTERM to a real mqksd. Waits poll with deadlines; absence
is proven with a ping on the same connection or a consume after a restart, never with a sleep.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPLY_TIMEOUT_SECONDS, BrokerProcess, Wire
from helpers import free_port, unique_bytes
from tls_certs import Certs
from waiting import wait_for

TOKEN = "s3cret-token-0123456789"
OTHER_TOKEN = "an0ther-token-9876543210"


class TlsWire(Wire):
    """`Wire` over TLS, checking the broker's certificate against the test CA."""

    def __init__(self, port: int, context: ssl.SSLContext, timeout: float = REPLY_TIMEOUT_SECONDS) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock = context.wrap_socket(sock, server_hostname="localhost")
        self.timeout = timeout
        self.buffer = b""


def tls_broker(make_broker, certs: Certs, *args: str, require_client_cert: bool = False) -> BrokerProcess:
    tls_port = free_port()
    server = make_broker(*certs.server_args(tls_port, require_client_cert), *args)
    server.tls_port = tls_port
    return server


def hello(wire: Wire, rid: bytes = b"h", ttl: str | None = None) -> dict:
    wire.send(rid + b" hello" + (f" --ttl={ttl}".encode() if ttl else b""))
    line = wire.recv_line()
    assert line.startswith(rid + b" ok {"), line
    return json.loads(line[len(rid) + 4:])


def deliveries(wire: Wire, consumer_id: bytes, count: int) -> list[bytes]:
    """The msg ids of the next `count` deliveries to `consumer_id`."""
    prefix = consumer_id + b" ok "
    got = []
    while len(got) < count:
        line = wire.recv_line()
        assert line.startswith(prefix) and not line.startswith(prefix + b"--"), line
        got.append(line[len(prefix):].split(b" ", 1)[0])
    return got


# TLS


def test_tls_transcript_beside_the_plain_port(make_broker, certs):
    server = tls_broker(make_broker, certs)
    queue, event = unique_bytes("tls-q"), unique_bytes("tls.e")
    secure = TlsWire(server.tls_port, certs.client_context())
    info = hello(secure)
    assert info["tls"] is True and info["protocol"] == 1 and "tls" in info["extensions"]
    secure.send(b"c1 consume --confirm %s %s --manual-ack" % (queue, event))
    secure.expect(b"c1 ok ")
    plain = server.wire()
    assert hello(plain)["tls"] is False
    plain.send(b"m1 publish %s from the plain port" % event)
    secure.expect(b"c1 ok m1 event=%s from the plain port" % event)
    # a pipelined batch much larger than one TLS record (16 KiB) arrives whole and in order
    secure.send(*(b"p%d publish %s %s" % (i, event, b"x" * 100) for i in range(2000)))
    assert deliveries(secure, b"c1", 2000) == [b"p%d" % i for i in range(2000)]
    secure.send(b"a1 ack --confirm c1 --all")
    secure.expect(b"a1 ok ")
    assert secure.barrier() == []
    secure.close()
    plain.close()


def test_a_plain_client_on_the_tls_port_is_told_and_closed_cleanly(make_broker, certs):
    server = tls_broker(make_broker, certs)
    raw = Wire("127.0.0.1", server.tls_port)
    raw.send(b"x ping")
    line = raw.recv_line()
    assert line.startswith(b"- error ") and b"this port speaks TLS" in line
    assert raw.closed_by_server()
    raw.close()
    wait_for(lambda: "plain text on a TLS port from 127.0.0.1:" in server.log(), "one clear line in the log")
    # the CLI says what to do, in one line
    cli = subprocess.run([str(Path(sys.executable).parent / "mqks"), "ping", "--port", str(server.tls_port)],
                         capture_output=True, text=True, timeout=30, check=False)
    assert cli.returncode == 1 and cli.stderr.strip().endswith("speaks TLS: pass --tls (tls=True from Python)"), cli
    assert cli.stderr.count("\n") == 1, cli.stderr  # no warning from the client's log before it
    # an HTTP request gets no answer at all, as on the plain port
    browser = Wire("127.0.0.1", server.tls_port)
    browser.send(b"GET / HTTP/1.1", b"Host: localhost", b"")
    assert browser.closed_by_server()
    browser.close()
    secure = TlsWire(server.tls_port, certs.client_context())  # the server is unharmed
    secure.send(b"p ping still here")
    secure.expect(b"p ok still here")
    secure.close()
    assert "Traceback" not in server.log()


def test_tls_ca_admits_only_clients_with_a_certificate_it_signed(make_broker, certs):
    server = tls_broker(make_broker, certs, require_client_cert=True)
    for context in (certs.client_context(), certs.client_context(rogue=True)):
        # TLS 1.3 reports a refused client certificate after the client's side of the handshake: at the
        # handshake or at the first read, the connection must fail and carry nothing
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            wire = TlsWire(server.tls_port, context)
            wire.send(b"p ping")
            wire.recv_line()
    good = TlsWire(server.tls_port, certs.client_context(with_cert=True))
    good.send(b"p ping signed")
    good.expect(b"p ok signed")
    good.close()
    assert "Traceback" not in server.log()


def test_tls_only_with_port_0(certs, tmp_path):
    tls_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mqks.server", "--port", "0",
                             *certs.server_args(tls_port)], stderr=subprocess.PIPE, text=True)
    try:
        def answers() -> bool:
            try:
                wire = TlsWire(tls_port, certs.client_context())
            except OSError:
                assert proc.poll() is None, "mqksd exited"
                return False
            wire.send(b"p ping")
            wire.expect(b"p ok ")
            wire.close()
            return True

        wait_for(answers, "mqksd to answer over TLS", 15.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert f"127.0.0.1:{tls_port} (TLS)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("flags, message", [
    (["--tls-port", "PORT"], "--tls-port needs --tls-cert and --tls-key"),
    (["--tls-cert", "CERT", "--tls-key", "KEY"], "need --tls-port"),
    (["--port", "0"], "--port 0 turns the plain port off"),
    (["--tls-port", "PORT", "--tls-cert", "/nonexistent.pem", "--tls-key", "KEY"], "cannot load the TLS"),
])
def test_bad_tls_flags_exit_2_with_one_line(certs, flags, message):
    flags = [{"PORT": str(free_port()), "CERT": certs.server_cert, "KEY": certs.server_key}.get(f, f) for f in flags]
    result = subprocess.run([sys.executable, "-m", "mqks.server", *flags], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


# token auth


def auth_broker(make_broker, tmp_path: Path, *args: str, tokens: str = TOKEN + "\n") -> BrokerProcess:
    token_file = tmp_path / "tokens"
    token_file.write_text(tokens)
    server = make_broker("--auth-token-file", str(token_file), *args)
    server.token_file = token_file
    return server


def test_without_a_token_every_line_but_ping_is_refused_and_the_connection_closed(make_broker, tmp_path):
    server = auth_broker(make_broker, tmp_path)
    wire = server.wire()
    wire.send(b"p ping")  # readiness probes and keepalives need no token
    wire.expect(b"p ok ")
    wire.send(b"c1 consume --confirm q e")
    wire.expect_error(b"c1", b"authentication required")
    wire.send(b"h hello")
    wire.expect_error(b"h", b"authentication required")
    wire.send(b"x nonsense")  # unknown actions are not listed to a stranger
    assert b"actions:" not in wire.expect_error(b"x", b"authentication required")
    assert wire.closed_by_server()
    wire.close()
    typo = server.wire()  # a token typed alone, or as the action: never logged
    typo.send(TOKEN.encode(), b"y " + TOKEN.encode())
    typo.expect_error(b"-", b"authentication required")
    typo.expect_error(b"y", b"authentication required")
    typo.close()
    wait_for(lambda: server.log().count("(not logged before auth)") >= 5, "the refusals to be logged")
    assert TOKEN not in server.log()


def test_a_wrong_token_is_refused_and_the_right_one_opens_every_action(make_broker, tmp_path):
    server = auth_broker(make_broker, tmp_path, tokens=f"# ops team\n{OTHER_TOKEN}\n\n{TOKEN}\n")
    wire = server.wire()
    wire.send(b"a auth wrong-token")
    wire.expect_error(b"a", b"authentication failed")
    # auth and the lines after it in one batch: the full table opens mid-batch
    queue = unique_bytes("auth-q")
    wire.send(b"b auth " + TOKEN.encode(), b"c1 consume --confirm %s auth.e" % queue, b"m1 publish auth.e hi")
    wire.expect(b"b ok ")
    wire.expect(b"c1 ok ")
    wire.expect(b"c1 ok m1 event=auth.e hi")
    assert hello(wire)["authenticated"] is True
    other = server.wire()
    other.send(b"a auth " + OTHER_TOKEN.encode(), b"s stats")
    other.expect(b"a ok ")
    assert other.recv_line().startswith(b"s ok {")
    # three failed attempts close the connection: no guessing at line rate
    guesser = server.wire()
    guesser.send(b"g1 auth a", b"g2 auth b", b"g3 auth c", b"g4 auth " + TOKEN.encode())
    for rid in (b"g1", b"g2", b"g3"):
        guesser.expect_error(rid, b"authentication failed")
    assert guesser.closed_by_server()
    log = server.log()
    assert TOKEN not in log and OTHER_TOKEN not in log and "auth ***" in log


def test_the_token_file_is_read_again_on_sighup(make_broker, tmp_path):
    server = auth_broker(make_broker, tmp_path)
    server.token_file.write_text(OTHER_TOKEN + "\n")

    def accepts(token: str) -> bool:
        wire = server.wire()
        try:
            wire.send(b"a auth " + token.encode())
            return wire.recv_line() == b"a ok "
        finally:
            wire.close()

    assert accepts(TOKEN)  # nothing changes until the signal
    server.signal(signal.SIGHUP)
    wait_for(lambda: accepts(OTHER_TOKEN), "the new token to be accepted")
    assert not accepts(TOKEN)
    server.token_file.write_text("")  # an empty file keeps the tokens in use rather than lock everyone out
    server.signal(signal.SIGHUP)
    wait_for(lambda: "holds no token now" in server.log(), "the empty file to be reported")
    assert accepts(OTHER_TOKEN)
    assert server.proc.poll() is None


def test_the_token_can_come_from_the_environment(make_broker, monkeypatch):
    monkeypatch.setenv("MQKS_AUTH_TOKEN", TOKEN)
    server = make_broker()
    wire = server.wire()
    wire.send(b"s stats")
    wire.expect_error(b"s", b"authentication required")
    wire.send(b"a auth " + TOKEN.encode(), b"s stats")
    wire.expect(b"a ok ")
    assert wire.recv_line().startswith(b"s ok {")


def test_auth_on_a_server_without_tokens_says_so(broker, wire):
    wire.send(b"a auth anything")
    wire.expect_error(b"a", b"takes no token")
    assert "anything" not in broker.log()


def test_eval_stays_refused_with_auth_beyond_loopback(make_broker, tmp_path):
    server = auth_broker(make_broker, tmp_path, "--host", "0.0.0.0", "--eval")
    wire = server.wire()  # we connect over loopback, and --eval is given: still refused
    wire.send(b"a auth " + TOKEN.encode(), b"e _eval 1+1")
    wire.expect(b"a ok ")
    reason = wire.expect_error(b"e", b"token auth is on")
    assert b"beyond loopback" in reason and b"--host 0.0.0.0" in reason


# hello and the TTL


def test_hello_reports_version_protocol_extensions_and_workers(make_broker):
    server = make_broker("--workers", "2")
    wire = server.wire()
    info = hello(wire)
    assert info["protocol"] == 1 and info["workers"] == 2 and info["ttl"] is None
    assert {"auth", "tls", "hello", "ttl", "drain"} <= set(info["extensions"])
    assert info["version"]
    assert hello(wire, ttl="2.5")["ttl"] == 2.5
    wire.send(b"b hello --ttl=soon")
    wire.expect_error(b"b", b"--ttl wants a number of seconds")
    wire.send(b"c hello --bogus")
    wire.expect_error(b"c", b"expected {id} hello [--ttl=S]")


@pytest.mark.parametrize("how", ["hello", "client-ttl"])
def test_a_silent_peer_is_closed_after_2x_ttl_and_its_messages_go_to_another_consumer(make_broker, how):
    server = make_broker("--client-ttl", "0.5") if how == "client-ttl" else make_broker()
    queue, event = unique_bytes("ttl-q"), unique_bytes("ttl.e")
    silent = server.wire()
    if how == "hello":
        hello(silent, ttl="0.5")
    silent.send(b"c1 consume --confirm %s %s --manual-ack" % (queue, event), *(b"m%d publish %s x" % (i, event)
                                                                             for i in range(3)))
    silent.expect(b"c1 ok ")
    assert deliveries(silent, b"c1", 3) == [b"m0", b"m1", b"m2"]
    other = server.wire()  # a second consumer on the queue: it gets nothing while the first holds them
    other.send(b"c2 consume --confirm %s %s --manual-ack" % (queue, event))
    other.expect(b"c2 ok ")
    lively = server.wire()  # pings within its TTL: stays connected throughout
    hello(lively, ttl="0.5")
    deadline = time.monotonic() + 15
    # the silent one now sends nothing; its messages come to c2 once the server gives up on it, while
    # c2 and the lively one ping (with --client-ttl they are watched too)
    got: list[bytes] = []
    while len(got) < 3:
        assert time.monotonic() < deadline, "the silent peer was never closed"
        lively.send(b"k ping")
        lively.expect(b"k ok ")
        other.send(b"k ping")
        while (line := other.recv_line()) != b"k ok ":
            assert line.startswith(b"c2 ok m"), line
            got.append(line.split(b" ")[2])
        time.sleep(0.1)  # pacing the pings, not waiting for anything
    assert got == [b"m0", b"m1", b"m2"]
    assert silent.closed_by_server()
    assert "nothing received for" in server.log()
    lively.send(b"k ping alive")
    lively.expect(b"k ok alive")


def test_hello_ttl_0_turns_the_client_ttl_off(make_broker):
    server = make_broker("--client-ttl", "0.5")
    wire = server.wire()
    assert hello(wire, ttl="0")["ttl"] is None
    # a peer with the server's TTL would have been closed by now (1 s); proved on a quiet second connection
    quiet = server.wire()
    assert quiet.closed_by_server(timeout=10)
    wire.send(b"p ping")
    wire.expect(b"p ok ")


# drain on SIGTERM


def drain_broker(make_broker, tmp_path: Path, seconds: str) -> BrokerProcess:
    return make_broker("--data-dir", str(tmp_path / "data"), "--drain-seconds", seconds)


def held(wire: Wire, queue: bytes, event: bytes, count: int, say_hello: bool = True) -> list[bytes]:
    """Consume `queue` with manual ack, publish `count` messages, return the ids delivered (held un-acked)."""
    if say_hello:
        hello(wire)
    wire.send(b"c1 consume --confirm %s %s --manual-ack" % (queue, event),
              *(b"m%d publish --confirm %s payload-%d" % (i, event, i) for i in range(count)))
    wire.expect(b"c1 ok ")
    ids = []
    for _ in range(2 * count):  # deliveries and publish confirms interleave
        line = wire.recv_line()
        if line.startswith(b"c1 ok "):
            ids.append(line.split(b" ")[2])
    return ids


def remaining(server: BrokerProcess, queue: bytes, event: bytes) -> list[bytes]:
    """After a restart: every message the queue holds (delivered to a fresh consumer), proved complete by a ping."""
    wire = server.wire()
    wire.send(b"r1 consume --confirm %s %s --manual-ack" % (queue, event))
    wire.expect(b"r1 ok ")
    lines = wire.barrier()
    wire.close()
    return lines


def test_drain_a_consumer_that_acks_in_time_gets_nothing_redelivered(make_broker, tmp_path):
    server = drain_broker(make_broker, tmp_path, "10")
    queue, event = unique_bytes("drain-q"), unique_bytes("drain.e")
    wire = server.wire()
    assert held(wire, queue, event, 3) == [b"m0", b"m1", b"m2"]
    publisher = server.wire()  # connected before the drain: may still publish, but nothing more is delivered
    server.signal(signal.SIGTERM)
    wire.expect(b"c1 ok --draining")
    publisher.send(b"late publish --confirm %s after the drain began" % event)
    publisher.expect(b"late ok ")
    wire.send(b"a ack --confirm c1 m0 m1 m2")
    wire.expect(b"a ok ")
    assert wire.closed_by_server(timeout=15)  # everything settled: no need to wait the 10 s out
    assert server.proc.wait(15) == 0
    server.restart()
    assert remaining(server, queue, event) == [b"r1 ok late event=%s after the drain began" % event]


def test_drain_requeues_what_is_not_acked_in_time_durably(make_broker, tmp_path):
    server = drain_broker(make_broker, tmp_path, "0.5")
    queue, event = unique_bytes("drain-q"), unique_bytes("drain.e")
    wire = server.wire()
    assert held(wire, queue, event, 3) == [b"m0", b"m1", b"m2"]
    spec_client = server.wire()  # never said hello: hears nothing it did not ask for
    spec_queue, spec_event = unique_bytes("drain-spec"), unique_bytes("drain.spec")
    assert held(spec_client, spec_queue, spec_event, 1, say_hello=False) == [b"m0"]
    server.signal(signal.SIGTERM)
    wire.expect(b"c1 ok --draining")
    assert server.proc.wait(15) == 0
    with pytest.raises(ConnectionError):
        spec_client.recv_line()  # EOF with no line before it
    server.restart()
    assert remaining(server, queue, event) == [b"r1 ok m%d event=%s,retry=1 payload-%d" % (i, event, i)
                                               for i in range(3)]
    assert remaining(server, spec_queue, spec_event) == [b"r1 ok m0 event=%s,retry=1 payload-0" % spec_event]


def test_drain_in_memory_still_exits_0_and_flushes_what_is_owed(make_broker):
    server = make_broker("--drain-seconds", "0.2")
    wire = server.wire()
    hello(wire)
    wire.send(b"c1 consume --confirm q-mem e-mem --manual-ack", b"m1 publish e-mem x")
    wire.expect(b"c1 ok ")
    wire.expect(b"c1 ok m1 event=e-mem x")
    server.signal(signal.SIGTERM)
    wire.expect(b"c1 ok --draining")
    assert server.proc.wait(15) == 0
    assert "stopping: no new connections, draining" in server.log()



class QuietPeer:
    """What the silence watch sees of a connection: its reads, its TTL, whether it is closed."""

    def __init__(self, name: str, ttl: float) -> None:
        self.peer = name
        self.ttl_seconds = ttl
        self.reads = 0
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_silence_watch_is_one_timer_for_every_connection_and_closes_only_after_2x_ttl():
    from mqks.server.core.timers import Timers
    from mqks.server.edges.sessions import SilenceWatch

    now = [0.0]
    timers = Timers(clock=lambda: now[0])
    watch = SilenceWatch(timers.call_later, clock=lambda: now[0])
    peers = [QuietPeer(f"p{i}", 1.0) for i in range(1000)]
    for peer in peers:
        watch.watch(peer)
    assert len(timers) == 1  # one periodic check, however many connections
    talker, silent = peers[0], peers[1]
    while now[0] + 0.25 < 2.0:  # up to 1.75 s of silence
        now[0] += 0.25
        talker.reads += 1  # a batch arrived: the only cost a connection pays per read
        for peer in peers[2:]:
            peer.reads += 1
        timers.run_due()
        assert not silent.closed, f"closed after {now[0]} s, before 2x its TTL"
        assert len(timers) == 1
    now[0] = 2.5
    timers.run_due()
    assert silent.closed and not talker.closed
    watch.watch(QuietPeer("short", 0.2))  # a shorter TTL arms an earlier check
    assert timers.next_delay() is not None and timers.next_delay() <= 0.05 + 1e-9


def test_a_second_sigterm_ends_the_drain_at_once_and_loses_nothing(make_broker, tmp_path):
    server = drain_broker(make_broker, tmp_path, "600")
    queue, event = unique_bytes("drain-q"), unique_bytes("drain.e")
    wire = server.wire()
    assert held(wire, queue, event, 2) == [b"m0", b"m1"]
    server.signal(signal.SIGTERM)
    wire.expect(b"c1 ok --draining")
    server.signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0  # not the 600 s the drain would have waited
    assert "second stop signal: ending the drain now" in server.log()
    server.restart()
    assert remaining(server, queue, event) == [b"r1 ok m%d event=%s,retry=1 payload-%d" % (i, event, i)
                                               for i in range(2)]


def test_a_token_file_that_is_missing_or_empty_stops_the_start_with_one_line(tmp_path):
    (tmp_path / "empty").write_text("# no token yet\n\n")
    for path, message in ((tmp_path / "missing", "No such file"), (tmp_path / "empty", "no token in")):
        result = subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(free_port()),
                                 "--auth-token-file", str(path)], capture_output=True, text=True, timeout=30)
        assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_a_memory_limit_swap_of_tables_keeps_unauthenticated_connections_locked(make_broker, tmp_path):
    limit_bytes = 96 << 20
    server = auth_broker(make_broker, tmp_path, "--max-memory", str(limit_bytes))
    stranger = server.wire()  # connected before the limit is reached: its table is swapped with everyone's
    stranger.send(b"p ping")
    stranger.expect(b"p ok ")
    publisher = server.wire()
    publisher.send(b"a auth " + TOKEN.encode(), b"b1 rebind --confirm mem-q mem.e")
    publisher.expect(b"a ok ")
    publisher.expect(b"b1 ok ")
    body = b"x" * (64 << 10)
    for sent in range(0, 10_000, 50):
        publisher.send(*(b"m%d publish mem.e %b" % (sent + i, body) for i in range(50)))
        publisher.send(b"probe publish --confirm mem.e small")
        if (line := publisher.recv_line()) != b"probe ok ":
            assert line.startswith(b"probe error ") and b"memory limit reached" in line, line
            break
    else:
        raise AssertionError("the memory limit was never reached")
    stranger.send(b"s stats")
    stranger.expect_error(b"s", b"authentication required")
    stranger.send(b"a auth " + TOKEN.encode(), b"c publish --confirm mem.e after auth")
    stranger.expect(b"a ok ")
    stranger.expect_error(b"c", b"memory limit reached")  # authenticated into the table of a full broker


def test_mqks_ping_needs_no_token_and_every_other_command_says_how_to_give_one(make_broker, tmp_path, monkeypatch):
    # issue 24.3: `mqks ping` refused to run against a broker with tokens, though nc gets its ok
    monkeypatch.delenv("MQKS_AUTH_TOKEN", raising=False)
    server = auth_broker(make_broker, tmp_path)
    mqks = str(Path(sys.executable).parent / "mqks")
    ping = subprocess.run([mqks, "ping", "--port", str(server.port), "hi"], capture_output=True, text=True,
                          timeout=30, check=False)
    assert (ping.returncode, ping.stdout, ping.stderr) == (0, "hi\n", "")
    publish = subprocess.run([mqks, "publish", "--port", str(server.port), "e", "x"], capture_output=True,
                             text=True, timeout=30, check=False)
    assert publish.returncode == 1
    assert "requires a token" in publish.stderr and "--token" in publish.stderr
    assert "MQKS_AUTH_TOKEN" in publish.stderr
