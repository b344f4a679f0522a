"""The hub's own NATS connection (server/nats_io/hub_nats.py), its protocol side in process: operations split anywhere
across reads come out whole and in order, headers and statuses read as nats-py shows them, a callback that fails
does not end the connection, and what it sends is the NATS wire protocol. The connection against real NATS servers
(credentials, TLS, a killed server) is in tests/cluster/test_hub_nats.py."""

from __future__ import annotations

import pytest

from mqks.server.nats_io.hub_nats import HubNats, ack_sequences, header_block, parse_headers

pytestmark = pytest.mark.timeout(10)

WIRE = (b"INFO {\"max_payload\":4096,\"connect_urls\":[\"127.0.0.1:4333\"]}\r\n"
        b"MSG a.b 1 5\r\nhello\r\n"
        b"PING\r\n"
        b"HMSG a.b 1 _INBOX.x.7 20 24\r\nNATS/1.0\r\nK: v w\r\n\r\nbody\r\n"
        b"HMSG a.b 2 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
        b"MSG a.b 1 reply.to 0\r\n\r\n")


def hub_hearing() -> tuple[HubNats, list[tuple[str, str, dict[str, str] | None, bytes]]]:
    hub = HubNats(["nats://127.0.0.1:4222"])
    heard: list[tuple[str, str, dict[str, str] | None, bytes]] = []
    hub.subscribe("a.b", lambda *message: heard.append(message))
    hub.subscribe("a.*", lambda *message: heard.append(message))
    return hub, heard


@pytest.mark.parametrize("chunk", [1, 2, 7, 64, len(WIRE)])
def test_operations_split_anywhere_across_reads_come_out_whole_and_in_order(chunk: int) -> None:
    hub, heard = hub_hearing()
    pending = b""
    for at in range(0, len(WIRE), chunk):
        piece = WIRE[at:at + chunk]
        pending = hub._dispatch(None, pending + piece)
    assert pending == b""
    assert heard == [("a.b", "", None, b"hello"),
                     ("a.b", "_INBOX.x.7", {"K": "v w"}, b"body"),
                     ("a.b", "", {"Status": "503"}, b""),
                     ("a.b", "reply.to", None, b"")]
    assert hub._out == [b"PONG\r\n"]  # the server's PING answered
    assert hub.max_payload == 4096
    assert "nats://127.0.0.1:4333" in hub._known  # a server NATS advertised, for a reconnect


def test_a_failing_callback_is_logged_and_the_next_message_still_arrives(caplog: pytest.LogCaptureFixture) -> None:
    hub = HubNats(["nats://127.0.0.1:4222"])
    heard: list[bytes] = []

    def fails(subject: str, reply: str, headers: object, data: bytes) -> None:
        if data == b"bad":
            raise ValueError("a bug")
        heard.append(data)

    hub.subscribe("x", fails)
    assert hub._dispatch(None, b"MSG x 1 3\r\nbad\r\nMSG x 1 4\r\ngood\r\n") == b""
    assert heard == [b"good"]
    assert "a callback of x failed" in caplog.text


def test_an_unsubscribed_sid_hears_nothing_and_an_error_from_nats_ends_the_connection() -> None:
    hub, heard = hub_hearing()
    hub.unsubscribe(1)
    hub._dispatch(None, b"MSG a.b 1 1\r\nx\r\n")
    assert heard == []
    hub._dispatch(None, b"-ERR 'Permissions Violation for Publish to \"x\"'\r\n")  # NATS goes on: so do we
    with pytest.raises(Exception, match="Stale Connection"):
        hub._dispatch(None, b"-ERR 'Stale Connection'\r\n")


def test_what_it_sends_is_the_nats_protocol() -> None:
    hub = HubNats(["nats://127.0.0.1:4222"])
    hub.connected = True  # as once connected: what it sends is queued for the connection's sender
    hub.subscribe("mqks.beat.g", lambda *message: None)
    hub.publish("mqks.log.g", b"r1\nr2", "_INBOX.w.3", {"Mqks-Epoch": "2", "Nats-Msg-Id": "g.2.ab.1"})
    hub.publish("mqks.beat.g", b"")
    hub.unsubscribe(1)
    block = b"NATS/1.0\r\nMqks-Epoch: 2\r\nNats-Msg-Id: g.2.ab.1\r\n\r\n"
    assert b"".join(hub._out) == (b"SUB mqks.beat.g 1\r\n"
                                  b"HPUB mqks.log.g _INBOX.w.3 %d %d\r\n%br1\nr2\r\n" % (len(block), len(block) + 5,
                                                                                        block)
                                  + b"PUB mqks.beat.g 0\r\n\r\n"
                                  + b"UNSUB 1\r\n")


def test_publishing_while_not_connected_raises_instead_of_queueing_for_a_connection_that_may_never_come() -> None:
    hub = HubNats(["nats://127.0.0.1:4222"])
    with pytest.raises(Exception, match="not connected"):
        hub.publish("x", b"y")


def test_headers_and_ack_subjects_read_as_nats_writes_them() -> None:
    headers = {"Mqks-Epoch": "3", "Mqks-Handoff": "node b"}
    assert parse_headers(header_block(headers)[:-2]) == headers
    assert parse_headers(b"NATS/1.0 408 Request Timeout\r\n") == {"Status": "408", "Description": "Request Timeout"}
    assert ack_sequences("$JS.ACK.s.c.1.41.7.1700000000.0") == (41, 7)
    assert ack_sequences("$JS.ACK.domain.ACCHASH.s.c.1.41.7.1700000000.0.token") == (41, 7)
