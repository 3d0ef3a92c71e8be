"""The gunicorn worker: deadlines on every connection, enforced where connections are accepted.

gunicorn's ``gthread`` worker hands a freshly accepted, blocking socket to a pool
thread, which then does the TLS handshake and reads the request line, headers
and body with no deadline: 16 clients that send one byte and wait hold all 16
threads, and kube-scheduler's next ``/filter`` gets no answer (issue 12).

:class:`GuardWorker` keeps gthread's process model, thread pool, arbiter
heartbeat, signals and graceful shutdown, and moves everything a slow client
can stall into its single event-loop thread, on non-blocking sockets:

1. **accept**: a connection beyond ``--max-connections-per-client`` (by
   source address) or ``--max-connections`` (per worker) gets a 503 with
   ``{"error": reason}`` at once (after the TLS handshake on an HTTPS port,
   which is bounded like any other) and is closed; at most
   max(16, ``--max-connections`` / 8) are being refused at once, and a refusal
   beyond that is a close without a word, so refusals hold no room. At the
   total limit the oldest connection that has not sent a request head yet, of
   the source address with the most connections, is closed to make room: a
   connection that has (kube-scheduler's kept-alive one) is never closed for a
   new one, and a flood of stalled connections only displaces itself. Past
   twice the total limit, counting refused and closing connections, a new one
   is closed without a word.
2. **TLS handshake** (``do_handshake_on_connect=False``), within
   ``--tls-handshake-timeout``. The peer certificate is kept for the app
   (``environ["ghost_guard.peer_cert"]``).
3. **request line and headers**, within ``--header-timeout`` (64 KiB at most,
   431 above).
4. **body**: ``Content-Length`` bytes, or a chunked body decoded up to
   ``--max-body-bytes`` (413 above, before reading it), within
   ``--body-timeout`` or the time the body needs at ``--body-min-rate``
   bytes per second, whichever is longer.
   Bytes received beyond 64 KiB are reserved from ``--max-buffered-bytes`` as
   they arrive (never from a declared length: a stalled head holds nothing),
   and a reply over 64 KiB holds its whole size until it is sent; a request
   that crosses the budget gets a 503, a reply that does not fit is replaced by
   one.
5. Only then is the **complete request** handed to a pool thread, which
   parses it with gunicorn's own parser from memory, runs the WSGI app,
   collects the reply in memory and sends what the socket takes at once
   (non-blocking): a pool thread never waits for a client. A call in exactly
   the shape kube-scheduler sends (:func:`plain_call`: ``POST /filter`` or
   ``/preempt`` over HTTP/1.1, a JSON body with a ``Content-Length``, within
   ``--max-body-bytes``, well-formed header lines) goes to the app's
   **direct lane** instead (``app.extensions[DIRECT_LANE]``, guard.http.filter):
   body in, status and JSON out, without gunicorn's parser, the WSGI environ and
   gunicorn's response object, which were half of the guard's CPU per call.
   When its answer needs no waiting (an ``alive`` verdict verified ahead, a body
   of at most 128 KiB, a permitted caller: the lane's ``answer_now``), the loop
   answers it itself, with no hand-off to a pool thread and back; that is
   bounded CPU work with no waiting on the apiserver or the client (the reply is
   written non-blocking; the access-log line, when on, goes to stderr as the
   loop's own log lines do). When the pod's quorum GET is already in flight (a
   background verification not landed yet), the call is **parked** (state
   PARKED, no thread, the socket unwatched): the GET's thread wakes the loop
   when it lands (``method_queue``), and the loop answers from that read
   (the lane's ``answer_landed``) or, when the read alone cannot answer (a
   ghost, a pod gone since), hands the call to a pool thread. A call still
   parked ``PARK_MARGIN`` before its budget ends goes to a pool thread too,
   which waits out the rest of the same budget. A request over ``LARGE_CALL``
   (16 KiB) takes a pool thread only while no other of its source address's
   does (state QUEUED meanwhile, no thread, not read), so large forged calls
   from one address cannot occupy the pool; one still queued when its budget
   ends gets a 503. Everything
   else, well-formed or not, takes a pool thread and the WSGI path, which answers
   it or refuses it with the reason.
6. The loop **writes the rest of the reply** within ``--write-timeout`` (a reader too
   slow for it is cut off), then keeps the connection for the next request
   for ``--keepalive-timeout`` at most, or closes it (lingering up to 1 s
   for the client's FIN so the reply is not lost to a reset).

A deadline missed closes the connection and counts it in
``ghost_guard_connections_rejected_total{reason}``.
"""

from __future__ import annotations

import errno
import re
import selectors
import socket
import ssl
import time
from collections import Counter as _Tally
from collections import deque
from email.utils import formatdate
from functools import partial
from http import HTTPStatus
from typing import Any

from gunicorn import http
from gunicorn.http import wsgi
from gunicorn.workers.gthread import ThreadWorker

from guard.http.lane import DIRECT_LANE, PEER_CERT

# Largest request line + headers accepted (gunicorn's own per-line and per-field limits apply as well).
MAX_HEAD_BYTES = 64 * 1024
# A closing connection waits this long for the client's FIN (so the reply is not reset away).
LINGER_SECONDS = 1.0
# A request or reply this small is always buffered; a larger one reserves its bytes from --max-buffered-bytes
# (a request as its bytes arrive, never from a declared length; a reply whole, until it is sent).
SMALL_REQUEST = 64 * 1024
# A request larger than this is a large call: at most LARGE_PER_CLIENT of one source address's run in the
# pool at once; the others wait their turn (state QUEUED, no thread, not read) within the request budget.
LARGE_CALL = 16 * 1024
LARGE_PER_CLIENT = 1
# Deadlines are checked on this tick.
TICK = 0.05

HANDSHAKE, HEAD, BODY, BUSY, WRITE, IDLE, LINGER = "handshake", "head", "body", "busy", "write", "idle", "linger"
# A call waiting, without a thread, for its pod's quorum GET in flight (the direct lane's Waiting).
PARKED = "parked"
# A large call waiting for its client's turn at a pool thread (LARGE_PER_CLIENT).
QUEUED = "queued"
# A parked call still waiting this long before its budget runs out goes to a pool thread, which waits
# out the rest (the loop checks deadlines once a TICK, so it may see this one up to a TICK late).
PARK_MARGIN = 2 * TICK
# What a missed deadline means, per state (None: a normal close, not counted).
EXPIRED = {HANDSHAKE: "tls-handshake-timeout", HEAD: "header-timeout", BODY: "body-timeout", WRITE: "write-timeout",
           IDLE: None, LINGER: None}

_STATUS = {400: "Bad Request", 413: "Content Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}

_REASONS = {200: "OK", 403: "Forbidden", **_STATUS}


def _reason(status: int) -> str:
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
    import orjson

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


class Conn:
    """One client connection, owned by the event loop."""

    __slots__ = ("sock", "addr", "ip", "server", "tls", "state", "deadline", "buf", "events", "peer_cert",
                 "head", "head_len", "kind", "need", "body_start", "chunk_pos", "chunk_bytes", "in_trailer",
                 "out", "keep", "reject", "closed", "reserved", "counted", "parked", "proven", "born", "refusing",
                 "large")

    def __init__(self, sock, addr, server, tls: bool) -> None:
        self.sock = sock
        self.addr = addr
        self.ip = addr[0] if isinstance(addr, tuple) else str(addr)
        self.server = server
        self.tls = tls
        self.state = HANDSHAKE if tls else HEAD
        self.deadline = 0.0
        self.buf = bytearray()
        self.events = 0
        self.peer_cert = None
        self.out = memoryview(b"")
        self.keep = False
        self.reject: bytes | None = None
        self.closed = False
        self.reserved = 0  # bytes of --max-buffered-bytes held by this connection's request and reply
        self.counted = False  # counted towards the connection limits (admitted, not refused, not closing)
        self.parked: _Parked | None = None  # the call waiting for its GET (state PARKED)
        self.proven = False  # a request head was read: never evicted for a new connection
        self.born = time.monotonic()
        self.refusing = False  # refused (a 503 or a close), counted in GuardWorker.refusing until closed
        self.large = False  # holds one of its client's LARGE_PER_CLIENT turns
        self.reset()

    def reset(self) -> None:
        self.head = b""
        self.head_len = 0
        self.kind = "length"
        self.need = 0
        self.body_start = 0.0
        self.chunk_pos = 0
        self.chunk_bytes = 0
        self.in_trailer = False


class _Parked:
    """A parked call: the direct lane's Waiting, and what a pool thread needs if it takes the call over."""

    __slots__ = ("waiting", "request", "keep")

    def __init__(self, request: bytes, keep: bool) -> None:
        self.waiting: Any = None
        self.request = request
        self.keep = keep


class _Capture:
    """The socket a pool thread's gunicorn Response writes to: the reply is collected, never sent from the thread."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def sendall(self, data) -> None:
        self.parts.append(data if type(data) is bytes else bytes(data))

    def send(self, data) -> int:
        self.sendall(data)
        return len(data)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class GuardWorker(ThreadWorker):
    """gthread with an event loop that owns every connection until its request is complete (see the module doc)."""

    def init_process(self) -> None:
        from guard import metrics

        s = self.app.settings
        self.settings = s
        self.rejected = metrics.CONNECTIONS_REJECTED
        self.open_gauge = metrics.CONNECTIONS_OPEN
        self.parked_gauge = metrics.CALLS_PARKED
        self.buffered_gauge = metrics.BUFFERED_BYTES
        self.queued_gauge = metrics.CALLS_QUEUED
        self.next_sample = 0.0
        self.tls = getattr(self.app, "tls", None)
        self.conns: set[Conn] = set()
        self.per_client: _Tally = _Tally()
        self.buffered = 0  # bytes reserved by large requests being read, run or answered
        self.admitted = 0  # open connections not being refused
        self.refusing = 0  # connections being refused (their 503 on its way); at most refusing_max
        self.refusing_max = max(16, s.max_connections // 8)
        self.large_running: _Tally = _Tally()  # large calls in the pool, per source address
        self.large_waiting: dict[str, deque] = {}  # large calls waiting their turn, per source address
        self.accept_paused_until = 0.0
        self.direct: Any = None  # the app's direct lane, once loaded (load_wsgi)
        self._answering = False  # the loop is answering a request itself (_dispatch)
        _raise_open_files_limit(4 * s.max_connections + 256)
        super().init_process()

    # --- registration --------------------------------------------------------------------------------

    def _want(self, conn: Conn, events: int) -> None:
        if conn.events == events:
            return
        if conn.events:
            self.poller.modify(conn.sock, events, conn)
        else:
            self.poller.register(conn.sock, events, conn)
        conn.events = events

    def _unwatch(self, conn: Conn) -> None:
        if conn.events:
            try:
                self.poller.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
            conn.events = 0

    def _release(self, conn: Conn) -> None:
        self.buffered -= conn.reserved
        conn.reserved = 0

    def _uncount(self, conn: Conn) -> None:
        """No longer counted towards the limits: closed, or closing (lingering for the client's FIN)."""
        if conn.counted:
            conn.counted = False
            self.admitted -= 1
            self.per_client[conn.ip] -= 1
            if self.per_client[conn.ip] <= 0:
                del self.per_client[conn.ip]

    def _close(self, conn: Conn, reason: str | None) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._release(conn)
        self._unwatch(conn)
        try:
            conn.sock.close()
        except OSError:
            pass
        self.conns.discard(conn)
        self._uncount(conn)
        if conn.refusing:
            conn.refusing = False
            self.refusing -= 1
        self.nr_conns = len(self.conns)
        if reason:
            self.rejected.labels(reason).inc()

    # --- accept --------------------------------------------------------------------------------------

    def accept(self, listener) -> None:
        s = self.settings
        for _ in range(64):
            try:
                sock, addr = listener.accept()
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ECONNABORTED):
                    # Out of file descriptors (EMFILE/ENFILE) or worse: stop accepting for a moment
                    # instead of spinning on a listener that stays readable.
                    self.log.warning("accept failed, pausing accepts for 0.5s: %s", e)
                    self.set_accept_enabled(False)
                    self.accept_paused_until = time.monotonic() + 0.5
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            conn = Conn(sock, addr, listener.getsockname(), self.tls is not None)
            if len(self.conns) >= 2 * s.max_connections:  # refusing and closing ones too: not even a 503
                self.rejected.labels("over-total-limit").inc()
                sock.close()
                continue
            reason: str | None = None
            why = ""
            if self.per_client[conn.ip] >= s.max_connections_per_client:
                reason, why = "over-client-limit", (f"too many connections from {conn.ip} (limit "
                                                    f"{s.max_connections_per_client}, --max-connections-per-client)")
            elif self.admitted >= s.max_connections and not self._evict_stalled():
                reason, why = "over-total-limit", f"too many connections (limit {s.max_connections}, --max-connections)"
            if reason is not None:
                self.rejected.labels(reason).inc()
                if self.refusing >= self.refusing_max:  # a refusal costs the admitted ones nothing: no 503
                    sock.close()
                    continue
                conn.reject = error_reply(503, why)
                conn.refusing = True
                self.refusing += 1
            else:
                self.per_client[conn.ip] += 1
                self.admitted += 1
                conn.counted = True
            if self.tls is not None:
                try:
                    conn.sock = self.tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ssl.SSLError):
                    sock.close()
                    self._uncount(conn)
                    if conn.refusing:
                        conn.refusing = False
                        self.refusing -= 1
                    continue
                conn.deadline = time.monotonic() + s.tls_handshake_timeout
            else:
                conn.deadline = time.monotonic() + s.header_timeout
            self.conns.add(conn)
            self.nr_conns = len(self.conns)
            if conn.reject is not None and self.tls is None:
                self._send_reply(conn, conn.reject, keep=False)
            else:
                self._want(conn, selectors.EVENT_READ)

    def _evict_stalled(self) -> bool:
        """At the total limit, close the oldest connection that has not sent a request head yet (in its
        TLS handshake or its first head), of the source address with the most connections, to make
        room; False if there is none. A connection that has sent a head (kube-scheduler's kept-alive
        one) is never closed for a new one: a flood of stalled connections only displaces itself."""
        stalled = [c for c in self.conns if c.counted and not c.proven and c.state in (HANDSHAKE, HEAD)]
        if not stalled:
            return False
        victim = min(stalled, key=lambda c: (-self.per_client[c.ip], c.born))
        self._close(victim, "stalled-evicted")
        return True

    # --- the connection state machine ----------------------------------------------------------------

    def _on_event(self, conn: Conn) -> None:
        if conn.closed:
            return
        if conn.state == HANDSHAKE:
            self._handshake(conn)
        elif conn.state == WRITE:
            self._write(conn)
        elif conn.state in (HEAD, BODY, IDLE, LINGER):
            self._read(conn)

    def _handshake(self, conn: Conn) -> None:
        try:
            conn.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._want(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._want(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as e:
            self.log.debug("tls handshake with %s failed: %s", conn.ip, e)
            self._close(conn, "tls-handshake-failed")
            return
        try:
            conn.peer_cert = conn.sock.getpeercert() or None
        except (ValueError, OSError):
            conn.peer_cert = None
        if conn.reject is not None:
            self._send_reply(conn, conn.reject, keep=False)
            return
        conn.state = HEAD
        conn.deadline = time.monotonic() + self.settings.header_timeout
        self._want(conn, selectors.EVENT_READ)
        self._read(conn)  # the request may have come with the handshake's last flight

    def _read(self, conn: Conn) -> None:
        while True:
            try:
                chunk = conn.sock.recv(65536)
            except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
                self._want(conn, selectors.EVENT_READ)  # (after a TLS read that wanted to write)
                return
            except ssl.SSLWantWriteError:
                self._want(conn, selectors.EVENT_WRITE)
                return
            except (OSError, ssl.SSLError):
                self._close(conn, None)
                return
            if not chunk:
                if conn.state == BODY:  # half-closed mid-body: it may still read why
                    got = len(conn.buf) - conn.head_len
                    self.rejected.labels("body-incomplete").inc()
                    self._send_reply(conn, error_reply(400, f"could not read the request body: the client "
                                                            f"stopped sending after {got} bytes"
                                                            + (f" of {conn.need - conn.head_len}"
                                                               if conn.kind == "length" else "")), keep=False)
                    return
                self._close(conn, None)  # the client went away (or finished lingering)
                return
            if conn.state == LINGER:
                continue  # discard until the client's FIN or the linger deadline
            if conn.state == IDLE:
                conn.state = HEAD
                conn.deadline = time.monotonic() + self.settings.header_timeout
            conn.buf += chunk
            if self._advance(conn):
                return

    def _advance(self, conn: Conn) -> bool:
        """Frame the buffered bytes; True once the connection stopped reading (dispatched, answered, closed)."""
        s = self.settings
        try:
            if len(conn.buf) > max(SMALL_REQUEST, conn.reserved):  # reserved as the bytes arrive
                self._reserve(conn, len(conn.buf))
            if conn.state == HEAD:
                end = conn.buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(conn.buf) > MAX_HEAD_BYTES:
                        raise FramingError(431, f"request line and headers larger than {MAX_HEAD_BYTES} bytes",
                                           "head-too-large")
                    return False
                if end + 4 > MAX_HEAD_BYTES:
                    raise FramingError(431, f"request line and headers larger than {MAX_HEAD_BYTES} bytes",
                                       "head-too-large")
                head, kind, length, expect = request_framing(bytes(conn.buf[:end + 4]), s.max_body_bytes)
                conn.proven = True
                now = time.monotonic()
                conn.head, conn.head_len, conn.kind = head, end + 4, kind
                conn.state, conn.body_start = BODY, now
                if kind == "length":
                    conn.need = conn.head_len + length
                    conn.deadline = now + max(s.body_timeout, length / s.body_min_rate)
                else:
                    conn.chunk_pos = conn.head_len
                    conn.deadline = now + s.body_timeout
                if expect and len(conn.buf) < conn.head_len + 1:
                    try:
                        conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
                    except (OSError, ssl.SSLError):
                        pass  # the client sends the body after its own short wait anyway
            if conn.state == BODY:
                if conn.kind == "length":
                    if len(conn.buf) < conn.need:
                        return False
                    end = conn.need
                else:
                    chunked_end = self._scan_chunks(conn)
                    if chunked_end is None:
                        return False
                    end = chunked_end
                request = conn.head + bytes(conn.buf[conn.head_len:end])
                del conn.buf[:end]
                self._dispatch(conn, request)
                return True
        except FramingError as e:
            self.rejected.labels(e.counted).inc()
            self._send_reply(conn, error_reply(e.status, e.reason), keep=False)
            return True
        return False

    def _reserve(self, conn: Conn, size: int) -> None:
        """Hold ``size`` bytes of --max-buffered-bytes for this connection's request (what it has sent:
        the request, then its reply, stay in memory until the reply is out). FramingError 503 when
        they do not fit."""
        size = -(-size // SMALL_REQUEST) * SMALL_REQUEST  # in 64 KiB steps
        if self.buffered - conn.reserved + size > self.settings.max_buffered_bytes:
            raise FramingError(503, f"too many large requests in flight (--max-buffered-bytes "
                               f"{self.settings.max_buffered_bytes}); retry", "over-buffer-limit")
        self.buffered += size - conn.reserved
        conn.reserved = size

    def _scan_chunks(self, conn: Conn) -> int | None:
        """Where a chunked body ends in the buffer, or None while incomplete. Raises FramingError."""
        s, buf, pos = self.settings, conn.buf, conn.chunk_pos
        if len(buf) - conn.head_len > 2 * s.max_body_bytes + 65536:  # framing overhead beyond reason
            raise FramingError(413, f"request body larger than the limit ({s.max_body_bytes} bytes, "
                               "--max-body-bytes)", "body-too-large")
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if len(buf) - pos > 8192:
                    raise FramingError(400, "chunk size or trailer line too long", "bad-framing")
                return None
            if conn.in_trailer:
                if eol == pos:  # the empty line that ends the trailers
                    return eol + 2
                conn.chunk_pos = pos = eol + 2
                continue
            field = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
            if not field or any(c not in b"0123456789abcdefABCDEF" for c in field) or len(field) > 16:
                raise FramingError(400, f"invalid chunk size {field[:20]!r}", "bad-framing")
            size = int(field, 16)
            if size == 0:
                conn.in_trailer = True
                conn.chunk_pos = pos = eol + 2
                continue
            if conn.chunk_bytes + size > s.max_body_bytes:
                raise FramingError(413, f"request body larger than the limit ({s.max_body_bytes} bytes, "
                                   "--max-body-bytes)", "body-too-large")
            end = eol + 2 + size
            if len(buf) < end + 2:
                return None
            if buf[end:end + 2] != b"\r\n":
                raise FramingError(400, "chunk data not followed by CRLF", "bad-framing")
            conn.chunk_bytes += size
            conn.chunk_pos = pos = end + 2
            conn.deadline = conn.body_start + s.body_timeout + conn.chunk_bytes / s.body_min_rate

    def _dispatch(self, conn: Conn, request: bytes) -> None:
        # A verb call whose answer is ready (an alive verdict verified ahead) is answered here in the
        # loop: no hand-off to a pool thread and back. Not while another request waits behind it on
        # the connection (pipelined), nor from within such an answer (its reply's write may read on).
        # A call whose pod's quorum GET is in flight already is parked, without a thread, until it lands.
        if self.direct is not None and not conn.buf and not self._answering:
            self._answering = True
            try:
                now = self._answer_now(conn, request)
                if isinstance(now, tuple):
                    self._send_reply(conn, now[0], keep=now[1])
                if now is not None:
                    return
            finally:
                self._answering = False
        self._to_pool(conn, request)

    def _to_pool(self, conn: Conn, request: bytes, arrived: float | None = None) -> None:
        conn.state, conn.deadline = BUSY, 0.0
        self._unwatch(conn)
        if len(request) > LARGE_CALL:
            if self.large_running[conn.ip] >= LARGE_PER_CLIENT:  # its client's turn is taken: wait for it
                arrived = time.monotonic() if arrived is None else arrived
                conn.state, conn.deadline = QUEUED, arrived + self.settings.request_budget
                self.large_waiting.setdefault(conn.ip, deque()).append((conn, request, arrived))
                return
            self.large_running[conn.ip] += 1
            conn.large = True
        future = self.tpool.submit(self._serve_and_send, conn, request, arrived)
        future.add_done_callback(lambda f: self.method_queue.defer(self._served, conn, f))

    def _next_large(self, ip: str) -> None:
        """A large call of ``ip`` left the pool: the next one waiting for its turn goes in."""
        self.large_running[ip] -= 1
        if self.large_running[ip] <= 0:
            del self.large_running[ip]
        waiting = self.large_waiting.get(ip)
        while waiting:
            conn, request, arrived = waiting.popleft()
            if not conn.closed and conn.state == QUEUED:
                self._to_pool(conn, request, arrived)
                break
        if not waiting:
            self.large_waiting.pop(ip, None)

    def _dequeue(self, conn: Conn) -> None:
        """A queued large call's budget ran out before its turn came: a 503 with the reason."""
        waiting = self.large_waiting.get(conn.ip)
        if waiting:
            for item in waiting:
                if item[0] is conn:
                    waiting.remove(item)
                    break
            if not waiting:
                self.large_waiting.pop(conn.ip, None)
        self.rejected.labels("over-client-calls").inc()
        self._send_reply(conn, error_reply(503, f"too many large calls from {conn.ip} at once (each waits for the "
                                                "one before it, within --request-budget); retry"), keep=False)

    def _answer_now(self, conn: Conn, request: bytes) -> tuple[bytes, bool] | str | None:
        """(reply, keep-alive) when the app's direct lane can answer at once without waiting (its
        ``answer_now``); PARKED when the call waits for its pod's GET in flight (answered by
        :meth:`_landed`); else None: the request goes to a pool thread as any other."""
        call = plain_call(request, self.direct_paths, self.direct_max_body)
        if call is None:
            return None
        path, body, keep = call
        parked = _Parked(request, keep)
        try:
            answered = self.direct.answer_now(path, body, conn.ip, conn.peer_cert,
                                              partial(self.method_queue.defer, self._landed, conn, parked))
        except Exception:
            self.log.exception("answering %s in the event loop failed; a pool thread answers it", path)
            return None
        if answered is None:
            return None
        if not isinstance(answered, tuple):
            parked.waiting = answered
            conn.parked = parked
            conn.state, conn.deadline = PARKED, answered.arrived + self.settings.request_budget - PARK_MARGIN
            self._unwatch(conn)
            return PARKED
        status, payload = answered
        keep = keep and self.alive
        return plain_reply(status, _reason(status), payload, keep), keep

    def _landed(self, conn: Conn, parked: _Parked) -> None:
        """The GET a parked call waits for has landed (deferred to the loop by the GET's thread):
        answer the call here, or hand it to a pool thread when the read alone cannot answer it."""
        if conn.closed or conn.parked is not parked:  # conn.parked is set only while PARKED
            return  # taken over by a pool thread at its deadline already
        conn.parked = None
        try:
            answered = self.direct.answer_landed(parked.waiting)
        except Exception:
            self.log.exception("answering a parked call in the event loop failed; a pool thread answers it")
            answered = None
        if answered is None:
            self._to_pool(conn, parked.request, parked.waiting.arrived)
            return
        status, payload = answered
        keep = parked.keep and self.alive
        self._answering = True
        try:
            self._send_reply(conn, plain_reply(status, _reason(status), payload, keep), keep=keep)
        finally:
            self._answering = False

    def _unpark(self, conn: Conn) -> None:
        """A parked call's GET has not landed with PARK_MARGIN of its budget left: a pool thread
        takes it over and waits out the rest (Checker.check, the same budget)."""
        parked, conn.parked = conn.parked, None
        assert parked is not None
        self._to_pool(conn, parked.request, parked.waiting.arrived)

    def load_wsgi(self) -> None:
        super().load_wsgi()
        lane = getattr(self.wsgi, "extensions", {}).get(DIRECT_LANE)
        self.direct = lane
        if lane is not None:
            self.direct_paths = frozenset(p.encode("ascii") for p in lane.paths)
            self.direct_max_body = lane.max_body

    def _serve(self, conn: Conn, request: bytes, arrived: float | None = None) -> tuple[bytes, bool]:
        """In a pool thread: parse the complete request from memory, run the app, collect the reply.
        ``arrived``: when the call's budget began, if it was parked first (default: now)."""
        if self.direct is not None:
            # Any body the worker took (its bytes are held against --max-buffered-bytes already): gunicorn's
            # parser spends ~30 ms of GIL reading a 4 MiB body back out of memory, which the loop waits out.
            call = plain_call(request, self.direct_paths, self.settings.max_body_bytes)
            if call is not None:
                path, body, keep = call
                status, payload = self.direct(path, body, conn.ip, conn.peer_cert, arrived)
                keep = keep and self.alive
                return plain_reply(status, _reason(status), payload, keep), keep
        out = _Capture()
        req = None
        try:
            parser = http.get_parser(self.cfg, iter([request]), conn.addr)
            req = next(parser)
            resp, environ = wsgi.create(req, out, conn.addr, conn.server, self.cfg)
            environ["wsgi.multithread"] = True
            environ[PEER_CERT] = conn.peer_cert
            if not self.alive:
                resp.force_close()
            respiter = self.wsgi(environ, resp.start_response)
            try:
                for item in respiter:
                    resp.write(item)
                resp.close()
            finally:
                if hasattr(respiter, "close"):
                    respiter.close()
            return out.getvalue(), not resp.should_close()
        except StopIteration:
            return b"", False
        except Exception as e:  # gunicorn's parser errors get its 4xx; anything else a 500
            if out.parts:  # the reply had started: nothing sane can follow it
                self.log.exception("error after the reply started")
                return out.getvalue(), False
            self.handle_error(req, out, conn.addr, e)
            return out.getvalue(), False

    def _serve_and_send(self, conn: Conn, request: bytes, arrived: float | None = None) -> tuple[memoryview, bool, bool]:
        """In a pool thread: the reply, and as much of it as the socket takes right now (never waiting).

        The loop does not touch a connection while its request runs, so the thread may write
        to it; whatever does not fit at once is left to the loop and its write deadline.
        Returns (the rest of the reply, keep-alive, the connection broke).
        """
        data, keep = self._serve(conn, request, arrived)
        rest = memoryview(data)
        if len(data) > SMALL_REQUEST:  # the loop reserves a large reply from the budget before a byte of it is sent
            return rest, keep, False
        try:
            while rest:
                rest = rest[conn.sock.send(rest):]
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            pass  # the same view goes to the loop: a TLS write is retried with the same bytes
        except (OSError, ssl.SSLError):
            return rest, False, True
        return rest, keep, False

    def _served(self, conn: Conn, future) -> None:
        if conn.large:
            conn.large = False
            self._next_large(conn.ip)
        if conn.closed:
            return
        try:
            rest, keep, broken = future.result()
        except Exception:
            self.log.exception("request handling failed")
            rest, keep, broken = memoryview(error_reply(500, "internal error; see the guard's log")), False, False
        if broken:
            self._close(conn, None)
            return
        self._send_reply(conn, rest, keep=keep and self.alive)

    def _send_reply(self, conn: Conn, data: bytes | memoryview, *, keep: bool) -> None:
        out = data if isinstance(data, memoryview) else memoryview(data)
        whole = len(out.obj) if isinstance(out.obj, (bytes, bytearray)) else len(out)  # what stays in memory
        if out and whole > SMALL_REQUEST:  # a large reply holds --max-buffered-bytes until it is sent
            try:
                self._reserve(conn, whole)
            except FramingError as e:
                self.rejected.labels(e.counted).inc()
                if len(out) < whole:  # part of it is out already: nothing can follow but the close
                    self._close(conn, None)
                    return
                out, keep = memoryview(error_reply(503, f"a reply of {whole} bytes does not fit --max-buffered-"
                                                        f"bytes ({self.settings.max_buffered_bytes}) while other "
                                                        "replies wait to be read; retry")), False
        elif conn.reserved:  # the request's bytes are gone with its thread
            self._release(conn)
        conn.state, conn.keep = WRITE, keep
        conn.out = out
        conn.deadline = time.monotonic() + self.settings.write_timeout
        self._write(conn)

    def _write(self, conn: Conn) -> None:
        while conn.out:
            try:
                sent = conn.sock.send(conn.out)
            except (ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                self._want(conn, selectors.EVENT_WRITE)
                return
            except ssl.SSLWantReadError:
                self._want(conn, selectors.EVENT_READ)
                return
            except (OSError, ssl.SSLError):
                self._close(conn, None)
                return
            conn.out = conn.out[sent:]
        self._release(conn)
        if not conn.keep:
            self._linger(conn)
            return
        conn.reset()
        conn.state, conn.deadline = IDLE, time.monotonic() + self.settings.keepalive_timeout
        self._want(conn, selectors.EVENT_READ)
        if conn.buf:  # a pipelined request is here already
            conn.state, conn.deadline = HEAD, time.monotonic() + self.settings.header_timeout
            if self._advance(conn):
                return
        if conn.tls and conn.sock.pending():
            self._read(conn)

    def _linger(self, conn: Conn) -> None:
        """Half-close, then wait briefly for the client's FIN so unread request bytes don't reset the reply away."""
        conn.state, conn.deadline = LINGER, time.monotonic() + LINGER_SECONDS
        conn.buf.clear()
        self._uncount(conn)  # bounded by LINGER_SECONDS (and the hard cap of twice --max-connections)
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except (OSError, ValueError):
            self._close(conn, None)
            return
        self._want(conn, selectors.EVENT_READ)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self.conns if c.deadline and now >= c.deadline]:
            if conn.state == PARKED:
                self._unpark(conn)
                continue
            if conn.state == QUEUED:
                self._dequeue(conn)
                continue
            reason = EXPIRED.get(conn.state)
            if conn.reject is not None and reason:
                reason = None  # already counted as over a limit
            self._close(conn, reason)

    # --- the loop ------------------------------------------------------------------------------------

    def _poll(self, timeout: float) -> None:
        try:
            events = self.poller.select(timeout)
        except OSError as e:
            if e.errno != errno.EINTR:
                raise
            return
        for key, _ in events:
            if isinstance(key.data, Conn):
                self._on_event(key.data)
            else:
                key.data(key.fileobj)

    def run(self) -> None:
        self.poller.register(self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks)
        self.set_accept_enabled(True)
        notified = 0.0
        while self.alive:
            # The heartbeat gunicorn's arbiter checks (a utime of the worker's tmp file, --timeout 30 s):
            # once a second is plenty, not once per event (it was 2 % of the guard's CPU per pod).
            if time.monotonic() - notified >= 1.0:
                self.notify()
                notified = time.monotonic()
            if self.accept_paused_until and time.monotonic() >= self.accept_paused_until:
                self.accept_paused_until = 0.0
                self.set_accept_enabled(True)
            self._poll(TICK)
            if not self.is_parent_alive():
                break
            now = time.monotonic()
            self._expire(now)
            if now >= self.next_sample:
                self.next_sample = now + 1.0
                self.open_gauge.set(len(self.conns))
                self.parked_gauge.set(sum(1 for c in self.conns if c.state == PARKED))
                self.queued_gauge.set(sum(1 for c in self.conns if c.state == QUEUED))
                self.buffered_gauge.set(self.buffered)

        # Graceful stop: no new connections; idle ones close now; requests being read, run or
        # written finish (with "Connection: close") within gunicorn's graceful timeout.
        self.set_accept_enabled(False)
        stop_by = time.monotonic() + self.cfg.graceful_timeout
        while self.conns and time.monotonic() < stop_by:
            for conn in [c for c in self.conns if c.state in (IDLE, HANDSHAKE) or (c.state == HEAD and not c.buf)]:
                self._close(conn, None)
            for conn in self.conns:
                conn.keep = False
            self.notify()
            self._poll(TICK)
            self._expire(time.monotonic())
        for conn in list(self.conns):
            self._close(conn, None)
        self.tpool.shutdown(wait=False)
        self.poller.close()
        self.method_queue.close()
        for s in self.sockets:
            s.close()


def _raise_open_files_limit(wanted: int) -> None:
    """Lift the soft open-files limit towards ``wanted`` (never above the hard limit): each connection is a file."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
