"""The line splitter and request parser on raw bytes: no sockets, no broker."""

import pytest

from mqks.server.wire.protocol import (
    LineSplitter,
    delivery_tail,
    event_of,
    format_error,
    format_ok,
    looks_like_http,
    msg_id_of,
    ok_body,
    rid_of,
    with_field,
)

pytestmark = [pytest.mark.timeout(10), pytest.mark.core]


def test_lines_split_across_reads_are_joined():
    splitter = LineSplitter()
    assert splitter.feed(b"m1 publish e1 he") == []
    assert splitter.feed(b"llo\nm2 publish") == [b"m1 publish e1 hello"]
    assert splitter.feed(b" e2 x\n") == [b"m2 publish e2 x"]


def test_many_lines_in_one_read_come_out_in_order():
    splitter = LineSplitter()
    chunk = b"".join(b"m%d publish e %d\n" % (i, i) for i in range(1000))
    assert splitter.feed(chunk) == [b"m%d publish e %d" % (i, i) for i in range(1000)]


def test_crlf_line_endings_are_stripped_even_when_split_between_reads():
    splitter = LineSplitter()
    assert splitter.feed(b"p1 ping a\r\np2 ping b\r") == [b"p1 ping a"]
    assert splitter.feed(b"\n") == [b"p2 ping b"]


def test_a_carriage_return_inside_data_is_kept():
    assert LineSplitter().feed(b"p ping a\rb\n") == [b"p ping a\rb"]


def test_empty_lines_come_out_empty_for_the_dispatcher_to_skip():
    assert LineSplitter().feed(b"\n\r\np ping\n") == [b"", b"", b"p ping"]


def test_overlong_line_is_rejected_with_its_rid_and_the_next_line_survives():
    splitter = LineSplitter(max_line_bytes=100)
    lines = splitter.feed(b"big publish e " + b"x" * 200)
    assert lines == [None]
    assert splitter.rejected.popleft()[0] == b"big"
    assert splitter.feed(b"y" * 500) == []  # still discarding up to the newline
    assert splitter.feed(b"yyy\nok ping 1\n") == [b"ok ping 1"]


def test_overlong_complete_line_within_one_read_is_rejected():
    splitter = LineSplitter(max_line_bytes=100)
    lines = splitter.feed(b"a ping 1\nbig ping " + b"x" * 150 + b"\nb ping 2\n")
    assert lines == [b"a ping 1", None, b"b ping 2"]
    rid, reason = splitter.rejected.popleft()
    assert rid == b"big" and "longer than 100" in reason


def test_non_utf8_line_is_rejected_and_valid_utf8_passes():
    splitter = LineSplitter()
    lines = splitter.feed(b"bad publish e \xff\xfe\nok publish e caf\xc3\xa9\n")
    assert lines == [None, b"ok publish e caf\xc3\xa9"]
    rid, reason = splitter.rejected.popleft()
    assert rid == b"bad" and "UTF-8" in reason


def test_garbage_bytes_never_raise():
    splitter = LineSplitter(max_line_bytes=64)
    junk = bytes(range(256)) * 20
    for start in range(0, len(junk), 37):
        splitter.feed(junk[start : start + 37])
    assert all(isinstance(rid, bytes) for rid, _ in splitter.rejected)


def test_rid_of_broken_lines():
    assert rid_of(b"r1 publish") == b"r1"
    assert rid_of(b"noseparator") == b"-"
    assert rid_of(b"\xff\xfe x") == b"-"


def test_replies_format():
    assert format_ok(b"p1") == b"p1 ok \n"
    assert format_ok(b"p1", b"data here") == b"p1 ok data here\n"
    assert format_error(b"r1", "7f", 'unknown action "x"\nsecond') == b'r1 error 7f unknown action "x" second\n'


@pytest.mark.parametrize("line", [b"GET / HTTP/1.1", b"POST /x HTTP/1.1", b"Host: localhost:25000"])
def test_http_is_recognised(line):
    assert looks_like_http(line)


def test_mqks_lines_are_not_http():
    assert not looks_like_http(b"GETTER consume q e")


def test_a_delivery_tail_is_read_back_by_the_tails_field_readers():
    tail = delivery_tail(b"m1", b"orders.new,reply=0w7", b"a b")
    assert tail == b" ok m1 event=orders.new,reply=0w7 a b"
    assert msg_id_of(tail) == b"m1" and event_of(tail) == b"orders.new,reply=0w7"  # the header, as it is held
    assert with_field(delivery_tail(b"m2", b"e", b""), b",retry=1") == b" ok m2 event=e,retry=1 "


def test_an_ok_body_is_what_follows_the_ok_and_nothing_for_another_answer():
    assert ok_body(b"q1 ok {\"queue\": \"a b\"}") == b'{"queue": "a b"}'
    assert ok_body(b"q1 ok ") == b"" and ok_body(b"q1 error e1 no") == b""
