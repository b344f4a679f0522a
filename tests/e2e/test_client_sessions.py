"""The client side of sessions and security: `Client`, the `mqks` CLI and stats.py over TLS with a token,
`hello --ttl` with keepalive pings, and the reaction to a draining broker.

Real brokers in subprocesses, certificates made by `openssl` at test time; waits poll with deadlines.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gevent
import pytest
from conftest import BrokerProcess
from helpers import Inbox, free_port, unique
from tls_certs import Certs
from waiting import wait_until

from mqks.client import Client, Message
from mqks.client.client import MqksConnectionError

TOKEN = "client-s3cret-0123456789"
HERE = Path(__file__).resolve().parents[1]  # tests/, beside the repository's root
MQKS = Path(sys.executable).parent / "mqks"
STATS_PY = HERE.parent / "stats.py"
SUBPROCESS_TIMEOUT_SECONDS = 30


@pytest.fixture
def secure_broker(make_broker: Callable[..., BrokerProcess], certs: Certs, tmp_path: Path) -> BrokerProcess:
    """A broker with a TLS port and token auth (the token in a file)."""
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    tls_port = free_port()
    server = make_broker(*certs.server_args(tls_port), "--auth-token-file", str(tmp_path / "tokens"))
    server.tls_port = tls_port
    return server


def secure_client(server: BrokerProcess, certs: Certs, **kwargs) -> Client:
    options = {"ping_seconds": 0.5, "ping_timeout_seconds": 5.0, "timeout_seconds": 5.0,
               "reconnect_max_seconds": 0.2, "tls": certs.client_context(), "token": TOKEN}
    options.update(kwargs)
    return Client(server.host, server.tls_port, **options)


def test_client_over_tls_with_a_token_reconnects_after_a_broker_restart(secure_broker, certs):
    client = secure_client(secure_broker, certs).connect()
    try:
        assert client.server_info is not None and client.server_info["tls"] is True
        assert client.server_info["authenticated"] is True
        queue, event = unique("q"), unique("e")
        inbox = Inbox(lambda message: message.ack())
        reconnected: list[tuple[str, str]] = []
        client.consume(queue, [event], inbox, manual_ack=True,
                       on_reconnect=lambda old, new: reconnected.append((old, new)))
        client.publish(event, "before", confirm=True)
        inbox.wait(1)
        secure_broker.kill()
        secure_broker.restart()
        wait_until(lambda: reconnected, "the consumer to come back over TLS")
        client.publish(event, "after", confirm=True)
        assert [message.data for message in inbox.wait(2)] == ["before", "after"]
        assert client.reconnects >= 1
    finally:
        client.close()


def test_client_without_the_token_or_with_a_wrong_one_fails_with_the_reason(secure_broker, certs, monkeypatch):
    monkeypatch.delenv("MQKS_AUTH_TOKEN", raising=False)
    with pytest.raises(MqksConnectionError, match="requires a token"):
        secure_client(secure_broker, certs, token=None).connect(retry=False)
    with pytest.raises(MqksConnectionError, match="refused the token"):
        secure_client(secure_broker, certs, token="not-the-token").connect(retry=False)
    monkeypatch.setenv("MQKS_AUTH_TOKEN", TOKEN)
    client = secure_client(secure_broker, certs, token=None).connect(retry=False)  # from the environment
    assert client.ping("in") == "in"
    client.close()


def test_client_rejects_a_broker_whose_certificate_it_cannot_verify(secure_broker, certs):
    client = Client(secure_broker.host, secure_broker.tls_port, tls=True, token=TOKEN, timeout_seconds=5.0,
                    connect_timeout_seconds=5.0)  # the system's CAs: our test CA is not among them
    with pytest.raises(MqksConnectionError, match="certificate verify failed"):
        client.connect(retry=False)


def test_client_says_hello_with_its_ttl_and_its_pings_keep_it_connected(make_broker):
    server = make_broker()
    client = Client(server.host, server.port, ping_seconds=0.2, ping_timeout_seconds=5.0).connect()
    try:
        assert client.server_info is not None and client.server_info["ttl"] == 0.4
        assert client.server_info["tls"] is False and "hello" in client.server_info["extensions"]
        # a client that went silent would be closed after 0.8 s; this one pings every 0.2 s
        gevent.sleep(2.0)
        assert client.reconnects == 0 and client.ping("alive") == "alive"
        assert "nothing received for" not in server.log()
    finally:
        client.close()
    quiet = Client(server.host, server.port, ttl_seconds=0).connect()
    assert quiet.server_info is not None and quiet.server_info["ttl"] is None
    quiet.close()


def test_client_settles_what_it_holds_when_the_broker_drains_then_reconnects(make_broker, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mqks.client")
    server = make_broker("--data-dir", str(tmp_path / "data"), "--drain-seconds", "20")
    client = Client(server.host, server.port, ping_seconds=0.5, ping_timeout_seconds=5.0, timeout_seconds=5.0,
                    reconnect_max_seconds=0.2).connect()
    try:
        def slow_ack(message: Message) -> None:
            gevent.sleep(0.2)  # a consumer at work when the drain begins
            message.ack()

        queue, event = unique("q"), unique("e")
        inbox = Inbox(slow_ack)
        reconnected: list[str] = []
        client.consume(queue, [event], inbox, manual_ack=True, on_reconnect=lambda old, new: reconnected.append(new))
        for i in range(3):
            client.publish(event, f"p{i}", confirm=True)
        inbox.wait(1)
        server.signal(signal.SIGTERM)
        # the broker exits once our acks are in, long before its 20 s are up
        wait_until(lambda: server.proc.poll() is not None, "the broker to finish draining", timeout=15)
        assert server.proc.returncode == 0
        assert "the broker is draining; reconnecting once our consumers have settled" in caplog.text
        server.restart()
        wait_until(lambda: reconnected, "the consumer to come back after the drain")
        client.publish(event, "after", confirm=True)
        messages = inbox.wait(4)
        assert [(m.data, m.retry) for m in messages] == [("p0", 0), ("p1", 0), ("p2", 0), ("after", 0)]
        assert client.ping("done") == "done"  # the pong comes after any redelivery would have
        assert len(inbox.messages) == 4
    finally:
        client.close()


def run_cli(program: list[str], *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*program, *args], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_SECONDS,
                          env={**os.environ, **(env or {})})


def test_cli_and_stats_py_over_tls_with_a_token(secure_broker, certs):
    tls = ["--port", str(secure_broker.tls_port), "--tls-ca", certs.ca]
    event = unique("e")
    result = run_cli([str(MQKS)], "publish", "--confirm", event, "over", "tls", *tls, "--token", TOKEN)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    result = run_cli([str(MQKS)], "ping", *tls, env={"MQKS_AUTH_TOKEN": TOKEN})
    assert (result.returncode, result.stdout) == (0, "pong\n"), result.stderr
    result = run_cli([sys.executable, str(STATS_PY)], "--json", *tls, env={"MQKS_AUTH_TOKEN": TOKEN})
    assert result.returncode == 0 and '"published": 1' in result.stdout, result.stderr
    assert TOKEN not in secure_broker.log()


def test_cli_errors_name_the_missing_token_and_the_bad_ca_file(secure_broker, certs, monkeypatch):
    monkeypatch.delenv("MQKS_AUTH_TOKEN", raising=False)
    tls = ["--port", str(secure_broker.tls_port), "--tls-ca", certs.ca]
    result = run_cli([str(MQKS)], "ping", *tls)  # ping needs no token, as at nc (issue 24.3)
    assert (result.returncode, result.stdout) == (0, "pong\n"), result.stderr
    result = run_cli([str(MQKS)], "publish", "e", "x", *tls)
    assert result.returncode == 1 and "requires a token" in result.stderr and "Traceback" not in result.stderr
    result = run_cli([str(MQKS)], "ping", "--port", str(secure_broker.tls_port), "--tls-ca", "/nonexistent/ca.pem")
    assert result.returncode == 2 and "cannot load the TLS CA" in result.stderr
    result = run_cli([str(MQKS)], "ping", *tls, "--token", "two words")
    assert result.returncode == 2 and "without whitespace" in result.stderr
    # the plain port of the same broker, no TLS: the token is still needed
    result = run_cli([str(MQKS)], "ping", "--port", str(secure_broker.port), "--token", TOKEN)
    assert (result.returncode, result.stdout) == (0, "pong\n"), result.stderr



def test_a_draining_broker_sends_the_client_to_its_fallback_with_its_consumers(make_broker):
    first, second = make_broker("--drain-seconds", "10"), make_broker()
    client = Client(first.host, first.port, fallbacks=[(second.host, second.port)], ping_seconds=0.5,
                    ping_timeout_seconds=5.0, timeout_seconds=5.0, reconnect_max_seconds=0.2).connect()
    try:
        queue, event = unique("q"), unique("e")
        inbox = Inbox(lambda message: message.ack())
        reconnected: list[str] = []
        client.consume(queue, [event], inbox, manual_ack=True, on_reconnect=lambda old, new: reconnected.append(new))
        client.publish(event, "on the first", confirm=True)
        inbox.wait(1)
        first.signal(signal.SIGTERM)
        wait_until(lambda: reconnected, "the consumer to come back on the fallback")
        assert (client._link.host, client._link.port) == (second.host, second.port)
        client.publish(event, "on the second", confirm=True)
        assert [message.data for message in inbox.wait(2)] == ["on the first", "on the second"]
        wait_until(lambda: first.proc.poll() is not None, "the first broker to exit")
        assert first.proc.returncode == 0
    finally:
        client.close()


def test_connect_tries_every_address_before_it_gives_up(make_broker):
    server = make_broker()
    client = Client("127.0.0.1", free_port(), fallbacks=[(server.host, server.port)], timeout_seconds=5.0,
                    connect_timeout_seconds=5.0).connect(retry=False)
    try:
        assert client.ping("found") == "found"
    finally:
        client.close()


def test_a_client_with_a_token_still_connects_to_a_broker_without_auth(make_broker):
    server = make_broker()
    client = Client(server.host, server.port, token=TOKEN, timeout_seconds=5.0).connect(retry=False)
    try:
        assert client.server_info is not None and client.server_info["authenticated"] is True
        assert client.ping("ok") == "ok"
    finally:
        client.close()


def test_a_ttl_shorter_than_the_ping_interval_is_refused_before_connecting():
    with pytest.raises(ValueError, match="must not exceed ttl_seconds"):
        Client("127.0.0.1", free_port(), ping_seconds=10, ttl_seconds=5)
