"""The `mqks` commands of issue 9 (extensions): request, schedule, unschedule, schedules, run as subprocesses.

The broker's side is set up and checked with wire transcripts (conftest `Wire`); every read from a
subprocess has a deadline.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import BrokerProcess
from helpers import MQKS, RUN_TIMEOUT_SECONDS, mqks, unique

from mqks.client import wire


def test_mqks_request_prints_the_reply_of_a_worker(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    worker = broker.wire()
    proc = None
    try:
        worker.send(f"c1 consume --confirm {queue} {event}".encode())
        worker.expect(b"c1 ok ")
        proc = subprocess.Popen([str(MQKS), "request", event, "how", "are", "you", "--port", str(broker.port),
                                 "--timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        delivery = worker.recv_line(timeout=RUN_TIMEOUT_SECONDS)
        _, event_got, _, token, body = wire.split_delivery_reply(delivery[len(b"c1 ok "):])
        assert (event_got, body) == (event.encode(), b"how are you") and token
        worker.send(b"r1 reply " + token + b" fine, thanks")
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_SECONDS)
        assert (proc.returncode, stdout) == (0, "fine, thanks\n"), stderr
    finally:
        worker.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def test_mqks_request_sends_json_on_one_line(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    worker = broker.wire()
    proc = None
    try:
        worker.send(f"c1 consume --confirm {queue} {event}".encode())
        worker.expect(b"c1 ok ")
        proc = subprocess.Popen([str(MQKS), "request", event, '{"text": "a\\tb",\n "n": 2}', "--json",
                                 "--port", str(broker.port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        delivery = worker.recv_line(timeout=RUN_TIMEOUT_SECONDS)
        _, _, _, token, body = wire.split_delivery_reply(delivery[len(b"c1 ok "):])
        assert json.loads(body) == {"text": "a\tb", "n": 2}
        worker.send(b"r1 reply " + token + b' {"ok": true}')
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_SECONDS)
        assert (proc.returncode, stdout) == (0, '{"ok": true}\n'), stderr
    finally:
        worker.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


def test_mqks_request_without_a_reply_exits_4(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    assert mqks(broker, "queues").returncode == 0
    wire_conn = broker.wire()
    try:
        wire_conn.send(f"r1 rebind --confirm {queue} {event}".encode())
        wire_conn.expect(b"r1 ok ")
    finally:
        wire_conn.close()
    done = mqks(broker, "request", event, "anyone?", "--timeout", "0.3")
    assert (done.returncode, done.stdout) == (4, ""), done.stderr
    assert "no reply within" in done.stderr


def test_mqks_request_to_an_unbound_event_exits_1_naming_it(broker: BrokerProcess) -> None:
    event = unique("e")
    done = mqks(broker, "request", event, "anyone?")
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr.startswith("mqks request: ") and event in done.stderr


def test_mqks_schedule_fires_and_schedules_lists_it_until_unscheduled(broker: BrokerProcess) -> None:
    queue, event = unique("q"), unique("e")
    name, idle = unique("s"), unique("idle")
    worker = broker.wire()
    try:
        worker.send(f"c1 consume --confirm {queue} {event}".encode())
        worker.expect(b"c1 ok ")
        done = mqks(broker, "schedule", name, event, "tick", "tock", "--every", "0.1", "--count", "2")
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
        for n in (1, 2):
            assert worker.recv_line() == f"c1 ok {name}.{n} event={event} tick tock".encode()
        done = mqks(broker, "schedule", idle, event, "--cron", "0 9 * * 1-5", "--nohaste", "--count", "3")
        assert done.returncode == 0, done.stderr
        listed = mqks(broker, "schedules", "--json")
        assert listed.returncode == 0, listed.stderr
        [row] = [row for row in json.loads(listed.stdout) if row["name"] == idle]
        assert (row["rule"], row["fired"], row["count"], row["event"], row["data"]) == (
            "cron 0 9 * * 1-5", 0, 3, event, "")
        table = mqks(broker, "schedules")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split() == ["name", "rule", "next", "due", "(UTC)", "fired", "count", "event", "data"]
        [line] = [line for line in lines if line.startswith(idle)]
        assert line.split()[1:7] == ["cron", "0", "9", "*", "*", "1-5"]
        assert line.split()[-3:] == ["0", "3", event]
        assert mqks(broker, "unschedule", idle).returncode == 0
        assert idle not in mqks(broker, "schedules").stdout
        again = mqks(broker, "unschedule", idle)
        assert again.returncode == 1 and again.stderr.startswith("mqks unschedule: ") and idle in again.stderr
    finally:
        worker.close()


def test_mqks_schedules_of_none_says_so(make_broker) -> None:
    server = make_broker()
    done = mqks(server, "schedules")
    assert (done.returncode, done.stdout.splitlines()[-1]) == (0, "(no schedules)"), done.stderr
    done = mqks(server, "schedules", "--json")
    assert (done.returncode, json.loads(done.stdout)) == (0, [])


@pytest.mark.parametrize("args", [
    ["schedule", "s1", "e1", "data"],  # neither --every nor --cron
    ["schedule", "s1", "e1", "--every", "5", "--cron", "* * * * *"],
    ["schedule", "s1", "e1", "--every", "-1"],
    ["schedule", "s1", "e1", "--every", "0"],
    ["schedule", "s1", "e1", "--every", "nan"],
    ["schedule", "s1", "e1", "--cron", "* * *"],
    ["schedule", "s1", "e1", "--every", "5", "--count", "0"],
    ["schedule", "s1", "e1", "--every", "5", "--count", "two"],
    ["request", "e1", "--json", "{not json"],
    ["unschedule"],
])
def test_bad_usage_exits_2(broker: BrokerProcess, args: list[str]) -> None:
    done = mqks(broker, *args)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr


def test_a_cron_rule_the_broker_refuses_exits_1(broker: BrokerProcess) -> None:
    done = mqks(broker, "schedule", unique("s"), "e1", "--cron", "61 * * * *")
    assert done.returncode == 1 and done.stderr.startswith("mqks schedule: "), done.stderr


def test_help_of_the_new_commands_marks_them_as_extensions() -> None:
    done = subprocess.run([str(MQKS), "--help"], capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
    for command in ("request", "schedule", "unschedule", "schedules"):
        [line] = [line for line in done.stdout.splitlines() if line.strip().startswith(command + " ")]
        assert "(ext)" in line
        sub = subprocess.run([str(MQKS), command, "--help"], capture_output=True, text=True,
                             timeout=RUN_TIMEOUT_SECONDS)
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: mqks {command}")
