"""The client's pure line helpers (client/wire.py): no broker, no sockets."""

from __future__ import annotations

import pytest

from mqks.client import wire


@pytest.mark.parametrize("data, expected", [
    (b"m1 event=e1 d1", (b"m1", b"e1", 0, b"d1")),
    (b"m1 event=e1,retry=3 two words", (b"m1", b"e1", 3, b"two words")),
    (b"m1 event=e1 ", (b"m1", b"e1", 0, b"")),
    (b"m1 event=e1", (b"m1", b"e1", 0, b"")),
    (b"m1 event=a,b,retry=1 x", (b"m1", b"a,b", 1, b"x")),
    (b"--update event=e1 d", (b"--update", b"e1", 0, b"d")),
    # events holding retry-like text (issue 16): read whole, never int() of client text
    (b"m1 event=x,retry=z hello", (b"m1", b"x,retry=z", 0, b"hello")),
    (b"m1 event=y,retry=5,retry=1 hi", (b"m1", b"y,retry=5", 1, b"hi")),
    (b"m1 event=x,retry= d", (b"m1", b"x,retry=", 0, b"d")),
    (b"m1 event=x,RETRY=2 d", (b"m1", b"x,RETRY=2", 0, b"d")),
    # a field a newer server appends is skipped, not glued to the event
    (b"m1 event=e1,retry=2,seq=7 d", (b"m1", b"e1", 2, b"d")),
    (b"m1 event=e1,seq=7 d", (b"m1", b"e1", 0, b"d")),
])
def test_split_delivery(data: bytes, expected: tuple) -> None:
    assert wire.split_delivery(data) == expected


def test_split_delivery_refuses_other_lines() -> None:
    with pytest.raises(ValueError):
        wire.split_delivery(b"--update q1 e1")


def test_update_lines_are_told_from_deliveries() -> None:
    assert wire.is_update(b"--update q1 e1 e2 --manual-ack")
    assert not wire.is_update(b"--update event=e1 data")
    assert wire.split_update(b"--update q1 e1 user.*.x --delete-queue-when-unused=5.0 --manual-ack") == (
        "q1", ["e1", "user.*.x"])
    assert wire.split_update(b"--update q1") == ("q1", [])


def test_split_answer_accepts_ok_with_or_without_trailing_space() -> None:
    assert wire.split_answer(b"r1 ok ") == (b"r1", b"ok", b"")
    assert wire.split_answer(b"r1 ok") == (b"r1", b"ok", b"")
    assert wire.split_answer(b"r1 error x7 bad thing") == (b"r1", b"error", b"x7 bad thing")
    assert wire.split_error(b"x7 bad thing") == ("x7", "bad thing")
    assert wire.split_error(b"x7") == ("x7", "")


@pytest.mark.parametrize("bad", ["", "two words", "tab\there", "--flag", "new\nline"])
def test_tokens_refuse_what_would_break_the_line(bad: str) -> None:
    with pytest.raises(ValueError):
        wire.encode_token(bad, "event")


@pytest.mark.parametrize("bad", ["a\nb", "a\rb", "a\tb", b"a\nb"])
def test_data_refuses_line_breaks_and_tabs(bad: str | bytes) -> None:
    with pytest.raises(ValueError):
        wire.encode_data(bad)


def test_data_keeps_spaces_and_unicode() -> None:
    assert wire.encode_data("héllo wörld  ") == "héllo wörld  ".encode()
    with pytest.raises(TypeError):
        wire.encode_data(42)


def test_consume_flags_as_the_broker_prints_them() -> None:
    assert wire.consume_flags(True, 5, 10) == [b"--delete-queue-when-unused=5.0", b"--manual-ack", b"--prefetch=10"]
    assert wire.consume_flags(False, True, 0) == [b"--delete-queue-when-unused"]
    assert wire.consume_flags(False, None, 0) == []
    with pytest.raises(ValueError):
        wire.consume_flags(False, None, 3)


def test_only_plain_publishes_are_resent_after_a_reconnect() -> None:
    assert wire.is_fire_and_forget_publish(b"m1 publish e1 data\n")
    assert not wire.is_fire_and_forget_publish(b"m1 publish --confirm e1 data\n")
    assert not wire.is_fire_and_forget_publish(b"a1 ack c1 m1\n")


def test_spark_source_reads_headers_as_the_clients_parser_does() -> None:
    pytest.importorskip("pyspark")
    pa = pytest.importorskip("pyarrow")
    from pyspark.sql.pandas.types import to_arrow_schema

    from mqks.spark.source import source_struct, to_record_batch

    schema = source_struct()
    arrow_schema = to_arrow_schema(schema, timezone="UTC")
    cases = [  # (fetch answer line, (event, retry, data)) as wire.split_header_fields reads the head
        (b"m1 event=x,retry=z,seq=1 hello", ("x,retry=z", 0, "hello")),
        (b"m2 event=y,retry=5,retry=1,seq=2 hi", ("y,retry=5", 1, "hi")),
        (b"m3 event=e1,retry=2,seq=7 d e", ("e1", 2, "d e")),
        (b"m4 event=a,b,seq=8 ", ("a,b", 0, "")),
    ]
    plain = b"m9 event=plain,seq=9 z"
    for line, expected in cases:
        head = line.split(b" ")[1][len(b"event="):]
        event, fields = wire.split_header_fields(head)
        assert (event.decode(), fields.get(b"retry", 0)) == expected[:2]
        for lines in ([line], [line, plain]):  # odd lines go the Python way, with all the batch's lines
            got = to_record_batch(lines, "q", schema.fieldNames(), arrow_schema, pa).to_pydict()
            assert (got["event"][0], got["retry"][0], got["data"][0]) == expected
            assert got["seq"][0] == int(line.split(b"seq=")[1].split(b" ")[0])
