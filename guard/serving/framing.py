"""HTTP/1.1 framing, pure: no sockets, no gunicorn, no clock but the Date header's.

What the worker's event loop (guard.serving.connection) needs to know about bytes: where a request
head ends and how large it may be (:func:`head_end`), where its body ends (:func:`request_framing`,
:class:`ChunkScan`), whether a complete request is exactly kube-scheduler's verb call
(:func:`plain_call`, handed to the app's direct lane), and the bytes of a reply (:func:`plain_reply`,
:func:`error_reply`). Every refusal is a :class:`FramingError` with the status, the reason the client
reads and the ``ghost_guard_connections_rejected_total`` label. Unit tests:
tests/unit/test_framing.py, tests/unit/test_plain_call.py.
"""

from __future__ import annotations

import re
import time
from email.utils import formatdate
from http import HTTPStatus

import orjson

# Largest request line + headers accepted (gunicorn's own per-line and per-field limits apply as well).
MAX_HEAD_BYTES = 64 * 1024
# A chunk-size or trailer line longer than this is refused.
MAX_CHUNK_LINE = 8192

_STATUS = {400: "Bad Request", 413: "Content Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}

_REASONS = {200: "OK", 403: "Forbidden", **_STATUS}


def status_phrase(status: int) -> str:
    try:
        return _REASONS.get(status) or HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


# gunicorn's own default limits on a request head (limit_request_line, _fields, _field_size): a head
# beyond them is left to gunicorn, which refuses it.
_MAX_LINE, _MAX_FIELDS, _MAX_FIELD = 4094, 100, 8190
# Header lines, each with the CRLF before it: a token, a colon, a value without control characters.
_FIELDS = re.compile(rb"(?:\r\n[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*)*\r\n")


def plain_call(request: bytes, paths: frozenset[bytes], max_body: int) -> tuple[str, bytes, bool] | None:
    """(path, body, keep-alive) of a complete request in exactly the shape kube-scheduler sends its
    verb calls, else None: ``POST <one of paths> HTTP/1.1`` (no query), header lines that are
    ``token: value`` with no control characters, one ``Content-Type`` of ``application/json``
    (parameters allowed), one ``Content-Length`` of at most ``max_body`` that the body matches, no
    ``Transfer-Encoding``, within gunicorn's head limits. ``Connection: close`` ends keep-alive.

    None is always safe (the request takes the WSGI lanes, which give the same answers), so a head
    this cannot judge at a glance (over ``_MAX_FIELD`` bytes of fields) falls through too. The
    fields are checked in one pass (``_FIELDS``); every ``\r\n`` in them then ends a line, so a
    header is found by its lower-cased name after one."""
    end = request.find(b"\r\n\r\n")
    if end < 0:
        return None
    first = request.find(b"\r\n")
    if first > _MAX_LINE:
        return None
    parts = request[:first].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1" or parts[1] not in paths:
        return None
    fields = request[first:end + 2]  # "\r\nname: value" for each line, then "\r\n"
    if len(fields) > _MAX_FIELD or fields.count(b"\r\n") > _MAX_FIELDS + 1 or not _FIELDS.fullmatch(fields):
        return None
    low = fields.lower()
    json_type = _one_value(low, b"\r\ncontent-type:")
    length = _one_value(low, b"\r\ncontent-length:")
    if json_type is None or length is None or not length.isdigit() or b"\r\ntransfer-encoding:" in low:
        return None
    size = int(length)
    if json_type.split(b";", 1)[0].strip(b" \t") != b"application/json" or size > max_body:
        return None
    body = request[end + 4:]
    if len(body) != size:
        return None
    keep = True
    at = low.find(_CONNECTION)
    while at >= 0:
        at += len(_CONNECTION)
        value = low[at:low.find(b"\r\n", at)]
        if b"close" in (t.strip(b" \t") for t in value.split(b",")):
            keep = False
        at = low.find(_CONNECTION, at)
    return parts[1].decode("ascii"), body, keep


_CONNECTION = b"\r\nconnection:"


def _one_value(fields: bytes, name: bytes) -> bytes | None:
    """The stripped value of the one field line starting ``name`` in ``fields`` (checked and
    lower-cased by plain_call), or None if there is none or more than one."""
    at = fields.find(name)
    if at < 0 or fields.find(name, at + 1) >= 0:
        return None
    start = at + len(name)
    return fields[start:fields.find(b"\r\n", start)].strip(b" \t")


_date: tuple[int, bytes] = (0, b"")


def _http_date() -> bytes:
    """The Date header's value, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, formatdate(now, usegmt=True).encode("ascii"))
    return _date[1]


def plain_reply(status: int, reason: str, payload: bytes, keep: bool) -> bytes:
    """A complete HTTP/1.1 reply with a JSON payload (the direct lane's)."""
    return b"".join((f"HTTP/1.1 {status} {reason}\r\nDate: ".encode("ascii"), _http_date(),
                     b"\r\nConnection: keep-alive" if keep else b"\r\nConnection: close",
                     b"\r\nContent-Type: application/json\r\nContent-Length: ", str(len(payload)).encode("ascii"),
                     b"\r\n\r\n", payload))


def error_reply(status: int, reason: str) -> bytes:
    """A complete HTTP/1.1 reply with ``{"error": reason}`` that closes the connection."""
    body = orjson.dumps({"error": reason})
    return (f"HTTP/1.1 {status} {_STATUS[status]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class FramingError(Exception):
    def __init__(self, status: int, reason: str, counted: str) -> None:
        super().__init__(reason)
        self.status, self.reason, self.counted = status, reason, counted


_CONTENT_LENGTH = b"\r\ncontent-length:"


def request_framing(head: bytes, max_body: int) -> tuple[bytes, str, int, bool]:
    """(head to hand on, "length" or "chunked", Content-Length, expects 100-continue) of a request head.

    Only what is needed to find where the request ends; gunicorn's parser judges the
    rest. An ``Expect`` header is answered here and dropped from the head.
    """
    low = head.lower()
    if b"expect" not in low and b"transfer-encoding" not in low:
        # kube-scheduler's heads: nothing to drop, no coding, one Content-Length or none, found at
        # once when its name at a line's start is the only mention of it (another line so named
        # would be another mention): the same result as the line-by-line reading below.
        at = low.find(_CONTENT_LENGTH)
        if at < 0 and b"content-length" not in low:
            return head, "length", 0, False
        if at >= 0 and low.count(b"content-length") == 1:
            at += len(_CONTENT_LENGTH)
            return head, "length", _length(head[at:head.find(b"\r\n", at)].strip(), max_body), False
    return framing_by_lines(head, max_body)


def framing_by_lines(head: bytes, max_body: int) -> tuple[bytes, str, int, bool]:
    """:func:`request_framing` for any head, every line read (what its quick reading must agree with)."""
    lines = head[:-4].split(b"\r\n")
    kept, lengths, codings, expect = [lines[0]], [], [], False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        key = name.strip().lower()
        if key == b"expect":
            expect = value.strip().lower() == b"100-continue"
            continue
        if key == b"content-length":
            lengths.append(value.strip())
        elif key == b"transfer-encoding":
            codings += [c.strip().lower() for c in value.split(b",")]
        kept.append(line)
    out = b"\r\n".join(kept) + b"\r\n\r\n"
    if codings:
        if lengths:
            raise FramingError(400, "both Content-Length and Transfer-Encoding", "bad-framing")
        if codings[-1] != b"chunked":
            return out, "length", 0, False  # gunicorn answers an unsupported coding
        return out, "chunked", 0, expect
    if not lengths or len(set(lengths)) != 1 or not lengths[0].isdigit():
        return out, "length", 0, False  # (gunicorn answers 400 to a bad length, with the reason)
    return out, "length", _length(lengths[0], max_body), expect


def _length(value: bytes, max_body: int) -> int:
    """The body length a Content-Length value gives (0 for one gunicorn will refuse: it answers
    400 with the reason); FramingError 413 over ``max_body``."""
    if not value.isdigit():
        return 0
    length = int(value)
    if length > max_body:
        raise FramingError(413, f"request body of {length} bytes is larger than the limit ({max_body} bytes, "
                           "--max-body-bytes)", "body-too-large")
    return length


def head_end(buf: bytes | bytearray) -> int | None:
    """Where the request head in ``buf`` ends (just past its blank line), None while it is incomplete.
    FramingError 431 once it is (or must be) longer than MAX_HEAD_BYTES."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD_BYTES:
            raise FramingError(431, f"request line and headers larger than {MAX_HEAD_BYTES} bytes", "head-too-large")
        return None
    if end + 4 > MAX_HEAD_BYTES:
        raise FramingError(431, f"request line and headers larger than {MAX_HEAD_BYTES} bytes", "head-too-large")
    return end + 4


class ChunkScan:
    """Where a chunked body ends, found as its bytes arrive: :meth:`scan` resumes where it stopped.

    ``pos`` is the next unread chunk-size (or trailer) line in the buffer, ``size`` the data bytes
    seen so far (what ``--body-min-rate`` is measured on)."""

    __slots__ = ("pos", "size", "in_trailer")

    def __init__(self, pos: int) -> None:
        self.pos = pos
        self.size = 0
        self.in_trailer = False

    def scan(self, buf: bytes | bytearray, body_start: int, max_body: int) -> int | None:
        """The end of the chunked body (just past its trailers) in ``buf``, or None while incomplete.
        ``body_start``: where the body starts in ``buf``. Raises FramingError (413 over ``max_body``
        data bytes, 400 for a malformed chunk)."""
        pos = self.pos
        if len(buf) - body_start > 2 * max_body + 65536:  # framing overhead beyond reason
            raise FramingError(413, f"request body larger than the limit ({max_body} bytes, --max-body-bytes)",
                               "body-too-large")
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if len(buf) - pos > MAX_CHUNK_LINE:
                    raise FramingError(400, "chunk size or trailer line too long", "bad-framing")
                return None
            if self.in_trailer:
                if eol == pos:  # the empty line that ends the trailers
                    return eol + 2
                self.pos = pos = eol + 2
                continue
            field = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
            if not field or any(c not in b"0123456789abcdefABCDEF" for c in field) or len(field) > 16:
                raise FramingError(400, f"invalid chunk size {field[:20]!r}", "bad-framing")
            size = int(field, 16)
            if size == 0:
                self.in_trailer = True
                self.pos = pos = eol + 2
                continue
            if self.size + size > max_body:
                raise FramingError(413, f"request body larger than the limit ({max_body} bytes, --max-body-bytes)",
                                   "body-too-large")
            end = eol + 2 + size
            if len(buf) < end + 2:
                return None
            if buf[end:end + 2] != b"\r\n":
                raise FramingError(400, "chunk data not followed by CRLF", "bad-framing")
            self.size += size
            self.pos = pos = end + 2
