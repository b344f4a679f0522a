"""Scoped tokens over real TCP (issue 42): a TOML token file gives each token the events it may publish to, the
queues it may read and whether it may manage; a refused line gets a clear error and the connection goes on. Against
raw sockets, the gevent client, mqks.aio, the CLI and the console, with one process and with worker processes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import BrokerProcess, Wire
from helpers import MQKS, free_port, unique
from waiting import wait_for

from mqks.client import Client, MqksError

pytestmark = pytest.mark.timeout(120)

ORDERS = "orders-s3cret-0123456789"
ADMIN = "admin-s3cret-0123456789"
REPORTS = "reports-s3cret-0123456789"
CLUSTER_SECRET = "cluster-s3cret-0123456789"
SECRETS = (ORDERS, ADMIN, REPORTS, CLUSTER_SECRET)

TOKENS_TOML = f"""
[[token]]
name = "orders"
secret = "{ORDERS}"
publish = ["orders.*", "audit"]
consume = ["orders-*"]
manage = false

[[token]]
name = "admin"
secret = "{ADMIN}"
publish = ["*"]
consume = ["*"]
manage = true

[[token]]
name = "reports"
secret_sha256 = "{hashlib.sha256(REPORTS.encode()).hexdigest()}"
consume = ["reports"]

[cluster]
secret = "{CLUSTER_SECRET}"
"""


@pytest.fixture(params=[1, 2], ids=["workers1", "workers2"])
def scoped(request, make_broker, tmp_path) -> BrokerProcess:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS_TOML)
    metrics_port = free_port()
    server = make_broker("--auth-token-file", str(path), "--workers", str(request.param), "--metrics-port",
                         str(metrics_port), "--console-actions")
    server.token_file = path
    server.metrics_port = metrics_port
    return server


def authed(server: BrokerProcess, secret: str) -> Wire:
    wire = server.wire()
    wire.send(b"a auth " + secret.encode())
    wire.expect(b"a ok ")
    return wire


def refused(wire: Wire, rid: bytes, line: bytes, reason: str) -> None:
    wire.send(rid + b" " + line)
    answer = wire.expect_error(rid, b"permission denied")
    assert answer.decode().endswith(reason), answer


def refusals(wire: Wire) -> int:
    wire.send(b"s stats")
    line = wire.recv_line()
    assert line.startswith(b"s ok {"), line
    return json.loads(line[5:])["refused_by_scope"]


def test_a_token_publishes_and_reads_what_its_scope_names_and_is_refused_the_rest(scoped):
    admin = authed(scoped, ADMIN)
    audit_q, orders_q = unique("audit-q"), unique("orders-q")
    # the admin binds a queue the orders token may not read to an event it may publish
    admin.send(b"b1 rebind --confirm %b orders.created" % audit_q.encode())
    admin.expect(b"b1 ok ")
    orders = authed(scoped, ORDERS)
    before = refusals(orders)
    orders.send(b"c1 consume --confirm %b orders.created --manual-ack" % orders_q.encode())
    orders.expect(b"c1 ok ")
    orders.send(b"m1 publish --confirm orders.created one")
    # its own copy comes to its consumer; the publish reached the queue it may not read, too
    lines = {orders.recv_line() for _ in range(2)}
    assert b"m1 ok " in lines and any(line.startswith(b"c1 ok m1 event=orders.created") for line in lines), lines
    refused(orders, b"m2", b"publish --confirm payments.settled x", "token 'orders' may not publish 'payments.settled'")
    refused(orders, b"m3", b"publish --delay=5 payments.settled x", "may not publish 'payments.settled'")
    # a request publishes: its refusal says so
    refused(orders, b"r1", b"request --timeout=1 payments.quote x", "may not publish 'payments.quote'")
    refused(orders, b"c2", b"consume --confirm %b orders.created" % audit_q.encode(),
            f"may not consume '{audit_q}'")
    refused(orders, b"b2", b"rebind --confirm payments payments.x", "may not rebind 'payments'")
    refused(orders, b"f1", b"fetch %b --lease=l1" % audit_q.encode(), f"may not fetch '{audit_q}'")
    refused(orders, b"d1", b"delete_queue --confirm %b" % orders_q.encode(), f"may not delete_queue '{orders_q}'")
    refused(orders, b"p1", b"purge_queue %b" % orders_q.encode(), f"may not purge_queue '{orders_q}'")
    refused(orders, b"s1", b"schedule tick --every=60 payments.tick x", "may not schedule to 'payments.tick'")
    refused(orders, b"u1", b"unschedule tick", "may not unschedule 'tick'")
    orders.send(b"s2 schedule --confirm tick --every=3600 audit hourly")  # an event it may publish
    orders.expect(b"s2 ok ")
    # open to every token: ping, stats, queues, hello; and the connection went on after every refusal
    orders.send(b"k ping still-here")
    orders.expect(b"k ok still-here")
    assert refusals(orders) - before == 10
    admin.send(b"q queues")
    rows = wait_for(lambda: admin.barrier(), "the queues listing")
    audit_row = next(json.loads(line[5:]) for line in rows if line.startswith(b"q ok {") and audit_q.encode() in line)
    assert audit_row["depth"] == 1  # the orders token's publish is there, though it may not read it
    admin.send(b"d2 delete_queue --confirm %b" % audit_q.encode())  # the admin may manage
    admin.expect(b"d2 ok ")


def test_a_secret_sha256_token_works_and_the_log_holds_no_secret(scoped):
    reports = authed(scoped, REPORTS)
    reports.send(b"c1 consume --confirm reports reports.daily")
    reports.expect(b"c1 ok ")
    refused(reports, b"m1", b"publish reports.daily x", "token 'reports' may not publish 'reports.daily'")
    wrong = scoped.wire()
    wrong.send(b"a auth " + REPORTS.encode()[:-1] + b"X")
    wrong.expect_error(b"a", b"authentication failed")
    assert "token 'reports'" in scoped.log()
    log = scoped.log()
    assert not [secret for secret in SECRETS if secret in log]


def test_the_clients_and_the_cli_get_the_refusal_and_go_on(scoped):
    queue = unique("orders-c")
    client = Client("127.0.0.1", scoped.port, token=ORDERS).connect()
    try:
        refusal = re.escape("permission denied: token 'orders' may not publish 'payments.x'")
        with pytest.raises(MqksError, match=refusal):
            client.publish("payments.x", "no", confirm=True)
        with pytest.raises(MqksError, match=re.escape(f"may not consume 'not-{queue}'")):
            client.consume(f"not-{queue}", ["orders.x"], lambda message: None, confirm=True)
        assert client.publish("audit", "yes", confirm=True)
        assert client.ping("on") == "on"
    finally:
        client.close()

    async def aio_scenario() -> None:
        from mqks import aio

        async with aio.Client("127.0.0.1", scoped.port, token=ORDERS) as aio_client:
            with pytest.raises(MqksError, match=re.escape("may not publish 'payments.x'")):
                await aio_client.publish("payments.x", "no", confirm=True)
            assert await aio_client.ping("on") == "on"

    asyncio.run(aio_scenario())
    # the CLI takes its token from the environment (`ps` shows no argument of it)
    done = subprocess.run([str(MQKS), "publish", "--confirm", "payments.x", "no", "--port", str(scoped.port)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "MQKS_AUTH_TOKEN": ORDERS})
    assert done.returncode != 0 and "permission denied: token 'orders' may not publish 'payments.x'" in done.stderr


def test_refusals_are_on_the_metrics_page_and_the_console_refuses_changes_without_manage(scoped):
    orders = authed(scoped, ORDERS)
    refused(orders, b"m1", b"publish payments.x y", "may not publish 'payments.x'")
    base = f"http://127.0.0.1:{scoped.metrics_port}"

    def counted() -> bool:
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        return any(line.startswith("mqks_refused_by_scope_total ") and float(line.split()[1]) >= 1
                   for line in text.splitlines())

    wait_for(counted, "the refusal on /metrics")

    def console(method: str, path: str, secret: str) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {secret}"}
        if method == "POST":
            session = json.loads(urllib.request.urlopen(urllib.request.Request(
                f"{base}/api/session", headers=headers), timeout=10).read())
            headers["X-CSRF-Token"] = session["csrf"]
        request = urllib.request.Request(f"{base}{path}", method=method, headers=headers, data=b"" if method == "POST"
                                         else None)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    queue = unique("orders-console")
    orders.send(b"c1 consume --confirm %b orders.console" % queue.encode())
    orders.expect(b"c1 ok ")
    status, body = console("GET", "/api/queues", ORDERS)  # reading is open to every token
    assert status == 200 and any(row["queue"] == queue for row in body)
    # the page shows its action buttons where /api/session says actions: only to a token that may manage
    assert console("GET", "/api/session", ORDERS)[1]["actions"] is False
    assert console("GET", "/api/session", ADMIN)[1]["actions"] is True
    status, body = console("POST", f"/api/queue/purge?name={queue}", ORDERS)
    assert status == 403 and "token 'orders' may not purge_queue" in body["error"], body
    status, body = console("POST", f"/api/queue/purge?name={queue}", ADMIN)
    assert status == 200, body


def test_sighup_reloads_the_scopes_for_new_connections(scoped):
    text = scoped.token_file.read_text().replace('publish = ["orders.*", "audit"]', 'publish = ["orders.*", "audit", '
                                                                                  '"payments.*"]')
    scoped.token_file.write_text(text)
    scoped.signal(signal.SIGHUP)

    def reloaded() -> bool:
        wire = authed(scoped, ORDERS)
        wire.send(b"m publish --confirm payments.x y")
        return wire.recv_line() == b"m ok "

    wait_for(reloaded, "the widened scope after SIGHUP")


@pytest.mark.parametrize("body,reason", [
    ('[[token]]\nname = "a"\nsecret = "x1234"\npublsh = ["*"]\n', "unknown key 'publsh'"),
    ('[[token]]\nname = "a"\n', "give one of secret and secret_sha256"),
    ('[[token]]\nname = "a"\nsecret_sha256 = "abc"\n', "secret_sha256 must be 64 hex digits"),
    ('[[token]]\nname = "a"\nsecret = "x1234"\n[[token]]\nname = "a"\nsecret = "y1234"\n', "given twice"),
    ('[cluster]\nsecret = "short"\n[[token]]\nname = "a"\nsecret = "x1234"\n', "at least 16 characters"),
    ('[[token]\nname = "a"', "not TOML"),
])
def test_a_wrong_token_file_stops_the_start_with_one_line_naming_the_mistake(tmp_path: Path, body: str, reason: str):
    path = tmp_path / "tokens.toml"
    path.write_text(body)
    result = subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(free_port()), "--auth-token-file",
                             str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and reason in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "x1234" not in result.stderr and "y1234" not in result.stderr


def test_failed_auths_slow_the_address_down_and_the_log_never_holds_an_attempt(scoped):
    marker = "failures from it; its next attempt waits 0.5 s)"
    attempts = []
    # with worker processes each counts the failures it saw (connections spread over them): guess until one of
    # them has seen more than the free ones
    for n in range(20):
        attempt = f"guess-{n}-{ORDERS[:10]}"
        attempts.append(attempt)
        wire = scoped.wire()
        wire.send(b"a auth " + attempt.encode())
        wire.expect_error(b"a", b"authentication failed")
        wire.close()
        if marker in scoped.log():
            break
    assert marker in scoped.log()
    late = authed(scoped, ORDERS)  # the right token still gets in, after its turn
    late.send(b"k ping")
    late.expect(b"k ok ")
    log = scoped.log()
    assert not [attempt for attempt in attempts if attempt in log] and ORDERS[:10] not in log


def test_a_toml_file_under_another_name_is_scoped_and_every_token_is_counted(make_broker, tmp_path):
    path = tmp_path / "tokens.conf"  # not *.toml: once read one token per line, `[[token]]` had full access
    path.write_text(TOKENS_TOML)
    server = make_broker("--auth-token-file", str(path), env={"MQKS_AUTH_TOKEN": "env-s3cret-0123456789"})
    # orders and reports are scoped; admin (everything) and the environment's token are not
    wait_for(lambda: "auth=4 tokens (2 scoped)" in server.log(), "the start-up line's count")
    wire = server.wire()
    wire.send(b"a auth [[token]]")
    wire.expect_error(b"a", b"authentication failed")
    orders = authed(server, ORDERS)
    refused(orders, b"m1", b"publish payments.x y", "may not publish 'payments.x'")
    server.signal(signal.SIGHUP)
    wait_for(lambda: "token file re-read: 4 tokens (2 scoped)" in server.log(), "the reload's count")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_mqksd_refuses_a_plain_token_file_with_a_toml_line_naming_the_line_not_its_content(tmp_path, workers):
    path = tmp_path / "tokens"
    path.write_text(f"{ORDERS}\n[[token]]\nname = 'x1234'\n")
    result = subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(free_port()), "--auth-token-file",
                             str(path), "--workers", workers], capture_output=True, text=True, timeout=30)
    assert result.returncode == 1 and f"{path}: line 2 looks like TOML" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and ORDERS not in result.stderr and "x1234" not in result.stderr


def test_sighup_keeps_the_old_tokens_when_a_plain_file_gets_a_toml_line(make_broker, tmp_path):
    path = tmp_path / "tokens"
    path.write_text(ADMIN + "\n")
    server = make_broker("--auth-token-file", str(path))
    path.write_text(f"{ORDERS}\n[[token]]\n")
    server.signal(signal.SIGHUP)
    wait_for(lambda: f"{path}: line 2 looks like TOML" in server.log(), "the refused reload in the log")
    authed(server, ADMIN)  # the tokens in use stay
    for secret in (ORDERS, "[[token]]"):
        wire = server.wire()
        wire.send(b"a auth " + secret.encode())
        wire.expect_error(b"a", b"authentication failed")
    assert ORDERS not in server.log()
