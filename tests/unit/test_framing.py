"""guard.serving.framing: where a request head and body end, decided from bytes alone (no sockets, no gunicorn)."""

from __future__ import annotations

import pytest

from guard.serving.framing import (MAX_HEAD_BYTES, ChunkScan, FramingError, error_reply, framing_by_lines, head_end,
                                   request_framing)


def head(*lines: str) -> bytes:
    return ("\r\n".join(("POST /filter HTTP/1.1", "Host: g") + lines) + "\r\n\r\n").encode()


def test_content_length():
    out, kind, length, expect = request_framing(head("Content-Length: 12"), 100)
    assert (kind, length, expect) == ("length", 12, False) and out == head("Content-Length: 12")


def test_no_body_without_length_or_coding():
    assert request_framing(head(), 100)[1:] == ("length", 0, False)


def test_chunked_is_read_to_its_last_chunk():
    assert request_framing(head("Transfer-Encoding: gzip, chunked"), 100)[1:3] == ("chunked", 0)


def test_expect_is_answered_by_the_worker_and_dropped_from_the_head():
    out, kind, length, expect = request_framing(head("Expect: 100-continue", "Content-Length: 5"), 100)
    assert expect and length == 5 and b"expect" not in out.lower()


def test_over_the_limit_is_refused_from_the_head():
    with pytest.raises(FramingError) as e:
        request_framing(head("Content-Length: 101"), 100)
    assert (e.value.status, e.value.counted) == (413, "body-too-large")
    assert "--max-body-bytes" in e.value.reason


def test_length_and_chunked_together_is_refused():
    with pytest.raises(FramingError) as e:
        request_framing(head("Content-Length: 5", "Transfer-Encoding: chunked"), 100)
    assert e.value.status == 400


@pytest.mark.parametrize("lines", [("Content-Length: 5", "Content-Length: 6"), ("Content-Length: -1",),
                                   ("Content-Length: 0x10",), ("Transfer-Encoding: gzip",)])
def test_what_gunicorn_refuses_is_handed_on_without_a_body(lines):
    """gunicorn's parser then answers the 400/501 with its own reason; the worker reads no body for it."""
    assert request_framing(head(*lines), 100)[1:3] == ("length", 0)


def test_error_reply_is_a_complete_json_reply_that_closes():
    reply = error_reply(503, 'too "many"')
    head_part, _, body = reply.partition(b"\r\n\r\n")
    assert head_part.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"Connection: close" in head_part and f"Content-Length: {len(body)}".encode() in head_part
    assert body == b'{"error":"too \\"many\\""}'


# -- the quick reading of kube-scheduler's heads against the line-by-line one ---------------------
# (framing_by_lines is what request_framing did for every head before it had a quick reading)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LINE = st.builds(lambda name, case, sep, value: f"{getattr(name, case)()}{sep}{value}",
                  st.sampled_from(["Content-Length", "Transfer-Encoding", "Expect", "X-Content-Length", "Host",
                                   " Content-Length", "Content-Length "]),
                  st.sampled_from(["title", "lower", "upper"]), st.sampled_from([": ", ":", ":\t", " "]),
                  st.sampled_from(["5", " 5 ", "0", "-1", "0x10", "101", "100-continue", "chunked", "gzip, chunked",
                                   "content-length", "g", ""]))


@settings(max_examples=400, deadline=None)
@given(st.lists(_LINE, max_size=3))
def test_the_quick_reading_frames_every_head_as_the_line_by_line_one(lines):
    h = head(*lines)
    try:
        want: object = framing_by_lines(h, 100)
    except FramingError as e:
        want = e.status
    try:
        got: object = request_framing(h, 100)
    except FramingError as e:
        got = e.status
    assert got == want


# -- the head's end and its limit ---------------------------------------------------------------------


def test_head_end_is_just_past_the_blank_line_and_none_while_incomplete():
    request = head("Content-Length: 2") + b"{}"
    assert head_end(request) == len(request) - 2
    assert head_end(request[:len(request) - 4]) is None


def test_a_head_over_the_limit_is_refused_with_431_complete_or_not():
    big = b"POST /filter HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES
    with pytest.raises(FramingError) as e:
        head_end(big)  # no blank line yet, but already too long
    assert (e.value.status, e.value.counted) == (431, "head-too-large")
    with pytest.raises(FramingError):
        head_end(big + b"\r\n\r\n")
    assert head_end(b"GET / HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES - 23) + b"\r\n\r\n") == MAX_HEAD_BYTES


# -- chunked bodies, as their bytes arrive ---------------------------------------------------------------


def test_chunked_body_ends_after_its_trailers_found_piece_by_piece():
    start = head("Transfer-Encoding: chunked")
    request = start + b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n" + b"NEXT"
    scan = ChunkScan(len(start))
    ends = [scan.scan(request[:n], len(start), 100) for n in range(len(start), len(request) + 1)]
    end = len(request) - len(b"NEXT")
    assert ends[-1] == end and all(e is None for e in ends[:end - len(start)])
    assert scan.size == 11


@pytest.mark.parametrize("body, status", [
    (b"zz\r\nab\r\n0\r\n\r\n", 400),  # not hex
    (b"2\r\nabXY0\r\n\r\n", 400),  # data not followed by CRLF
    (b"65\r\n", 413),  # 101 bytes declared, 100 allowed
    (b"3" * 9000, 400),  # a size line that never ends
])
def test_malformed_or_oversized_chunks_are_refused(body, status):
    start = head("Transfer-Encoding: chunked")
    with pytest.raises(FramingError) as e:
        ChunkScan(len(start)).scan(start + body, len(start), 100)
    assert e.value.status == status
