"""The hub's own NATS connection (server/nats_io/hub_nats.py) against a real three-node NATS cluster: messages with
headers and replies go both ways, a kill -9 of the server it is connected to is followed by a connection to
another one with every subscription made again, and a server that is not there is one clear error. Credentials
and TLS are tested through the broker in test_nats_access.py and test_cluster_tls.py."""

from __future__ import annotations

import os
import signal

import gevent
import pytest
from helpers import free_port
from waiting import wait_until

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")

from mqks.client.nats_local import load, restart
from mqks.server.nats_io.hub_nats import BridgeError, HubNats

pytestmark = pytest.mark.timeout(120)

Heard = list[tuple[str, str, "dict[str, str] | None", bytes]]


def connected(urls: list[str]) -> HubNats:
    hub = HubNats(urls)
    hub.connect()
    return hub


def test_messages_with_headers_and_replies_go_both_ways(nats_cluster):
    _, urls = nats_cluster
    answering, asking = connected(urls[:1]), connected(urls[2:])
    answers: Heard = []
    try:
        def answer(subject: str, reply: str, headers: dict[str, str] | None, data: bytes) -> None:
            answering.publish(reply, data.upper(), headers={"Seen-By": "answering", **(headers or {})})

        answering.subscribe("hub.echo", answer)
        inbox = asking.new_inbox()
        asking.subscribe(inbox, lambda *message: answers.append(message))

        def answered() -> bool:  # again until NATS has carried both interests between the two servers
            asking.publish("hub.echo", b"hello", inbox, {"Mqks-Epoch": "4"})
            gevent.sleep(0.1)
            return any(data for *_, data in answers)

        wait_until(answered, "an answer", 30)
        asking.publish("hub.echo", b"plain", inbox)
        wait_until(lambda: answers[-1][3] == b"PLAIN", "the answer without headers", 30)
    finally:
        answering.close()
        asking.close()
    no_one_yet = [headers for *_, headers, data in answers if not data]
    assert all(headers == {"Status": "503", "Nats-Subject": "hub.echo"} for headers in no_one_yet)  # no responders
    answered_ones = [answer for answer in answers if answer[3]]
    assert answered_ones[0] == (inbox, "", {"Seen-By": "answering", "Mqks-Epoch": "4"}, b"HELLO")
    assert answered_ones[-1] == (inbox, "", {"Seen-By": "answering"}, b"PLAIN")


def test_a_killed_server_is_followed_by_another_with_every_subscription_made_again(nats_cluster):
    directory, urls = nats_cluster
    listening, talking = connected(urls), connected(urls)
    heard: list[bytes] = []
    nodes = load(str(directory))
    killed = None
    try:
        listening.subscribe("hub.after", lambda subject, reply, headers, data: heard.append(data))
        listening.sync()
        port = listening._sock.getpeername()[1]
        node, = [node for node in nodes if node.url.endswith(f":{port}")]
        os.kill(node.pid, signal.SIGKILL)
        killed = node
        wait_until(lambda: listening.reconnects == 1 and listening.connected, "connected again", 30)
        assert listening._sock.getpeername()[1] != port
        listening.sync()  # its subscription is on the new server

        def heard_one() -> bool:
            if talking.connected:
                talking.publish("hub.after", b"again")
            gevent.sleep(0.2)
            return bool(heard)

        wait_until(heard_one, "a message heard after the reconnect", 30)
    finally:
        listening.close()
        talking.close()
        if killed is not None:
            restart(str(directory), killed.name)


def test_no_server_at_start_is_one_clear_error_naming_it():
    port = free_port()
    hub = HubNats([f"nats://127.0.0.1:{port}"], connect_timeout=1.0)
    with pytest.raises(BridgeError, match=f"nats://127.0.0.1:{port}: ConnectionRefusedError"):
        hub.connect()


def test_a_connection_does_not_hear_its_own_messages_but_hears_the_others(nats_cluster):
    """A writer subscribes to its own log's subject to hear a rival's takeover: its own frames must not come back."""
    _, urls = nats_cluster
    own, other = connected(urls), connected(urls)
    heard: list[bytes] = []
    try:
        own.subscribe("hub.own", lambda subject, reply, headers, data: heard.append(data))
        own.sync()
        other.sync()
        own.publish("hub.own", b"mine")
        own.sync()  # had NATS echoed it, it would have come before this PONG

        def heard_theirs() -> bool:  # again until NATS has carried the interest to the other's server
            other.publish("hub.own", b"theirs")
            gevent.sleep(0.1)
            return bool(heard)

        wait_until(heard_theirs, "the other connection's message", 30)
        assert set(heard) == {b"theirs"}
    finally:
        own.close()
        other.close()
