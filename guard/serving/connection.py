"""The connection state machine: deadlines on every connection, enforced where connections are accepted.

gunicorn's ``gthread`` worker hands a freshly accepted, blocking socket to a pool
thread, which then does the TLS handshake and reads the request line, headers
and body with no deadline: 16 clients that send one byte and wait hold all 16
threads, and kube-scheduler's next ``/filter`` gets no answer (issue 12).

:class:`ConnectionLoop` runs inside the gunicorn worker (guard.serving.worker.GuardWorker, which
keeps gthread's process model, thread pool, arbiter heartbeat, signals and graceful shutdown and is the
one place that touches gunicorn's internals: the loop sees them only through :class:`Host`) and moves
everything a slow client can stall into the worker's single event-loop thread, on non-blocking sockets.
What bytes mean (heads, bodies, replies) is guard.serving.framing, pure; this module is the states:

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
   parses it with gunicorn's own parser from memory (Host.serve_wsgi), runs the WSGI app,
   collects the reply in memory and sends what the socket takes at once
   (non-blocking): a pool thread never waits for a client. A call in exactly
   the shape kube-scheduler sends (framing.plain_call: ``POST /filter`` or
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
   loop's own log lines do). When it needs a thread (a miss: the pod's quorum GET), the lane
   hands back the call it decoded (a Waiting), and the pool thread answers that (the lane's
   ``answer_taken``): a call is framed and decoded once. When the pod's quorum GET is already in flight (a
   background verification not landed yet), the call is **parked** (state
   PARKED, no thread, the socket unwatched): the GET's thread wakes the loop
   when it lands (Host.defer), and the loop answers from that read
   (the lane's ``answer_landed``) or, when the read alone cannot answer (a
   ghost, a pod gone since), hands the decoded call to a pool thread. A call still
   parked ``PARK_MARGIN`` before its budget ends goes to a pool thread too,
   which waits out the rest of the same budget. A request over ``LARGE_CALL``
   (16 KiB) takes a pool thread only while no other of its source address's
   does, and one over ``OFFLOAD_BYTES`` (256 KiB) only while a helper process
   is free too (guard.serving.offload decodes its body and encodes its answer
   there, so no other call waits on the GIL for it): state QUEUED meanwhile,
   no thread, not read, turns given address by address; so large forged calls
   cannot occupy the pool or the GIL; one still queued when its budget ends
   gets a 503. Everything
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
import logging
import selectors
import socket
import ssl
import time
from collections import Counter as _Tally
from collections import deque
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable, Protocol

from guard.core.settings import Settings
from guard.serving.framing import (ChunkScan, FramingError, error_reply, head_end, plain_call, plain_reply,
                                   request_framing, status_phrase)
from guard.serving.offload import BUDGET_SHARE, OFFLOAD_BYTES, Offload

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


class Conn:
    """One client connection, owned by the event loop."""

    __slots__ = ("sock", "addr", "ip", "server", "tls", "state", "deadline", "buf", "events", "peer_cert",
                 "head", "head_len", "kind", "need", "body_start", "chunks",
                 "out", "keep", "reject", "closed", "reserved", "counted", "parked", "proven", "born", "refusing",
                 "large", "huge")

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
        self.refusing = False  # refused (a 503 or a close), counted in ConnectionLoop.refusing until closed
        self.large = False  # holds one of its client's LARGE_PER_CLIENT turns
        self.huge = False  # holds one of the OFFLOAD helper turns too
        self.reset()

    def reset(self) -> None:
        self.head = b""
        self.head_len = 0
        self.kind = "length"
        self.need = 0
        self.body_start = 0.0
        self.chunks: ChunkScan | None = None  # a chunked body's scan


class _Parked:
    """A call the direct lane decoded but did not answer (its Waiting: parked on a GET in flight, or for
    a pool thread at once), and what a pool thread needs to answer it (the lane's answer_taken, never
    decoding it again)."""

    __slots__ = ("waiting", "request", "keep")

    def __init__(self, request: bytes, keep: bool) -> None:
        self.waiting: Any = None
        self.request = request
        self.keep = keep


class Host(Protocol):
    """What the loop needs from the process it runs in (guard.serving.worker.GuardWorker, the only
    implementation: the adapter onto gunicorn's gthread internals)."""

    log: logging.Logger
    # The selector the loop polls; the host has registered its listeners (accepting) and its wake-up
    # channel (defer) in it, with a callable as their data: called with the ready file object.
    selector: selectors.BaseSelector
    graceful_timeout: float

    @property
    def alive(self) -> bool:
        """False once the worker was asked to stop (a reply then closes its connection)."""

    def defer(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` in the loop's thread soon (safe to call from any thread)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` in a pool thread."""

    def accepting(self, on: bool) -> None:
        """Watch the listeners (their ready callback is :meth:`ConnectionLoop.accept`), or stop."""

    def connections(self, count: int) -> None:
        """How many connections the loop holds now (the host may report it)."""

    def heartbeat(self) -> None:
        """Tell the process supervisor the loop is alive (called about once a second)."""

    def parent_alive(self) -> bool:
        """False once the supervisor is gone: the loop stops."""

    def serve_wsgi(self, conn: Conn, request: bytes, codec: Any) -> tuple[bytes, bool]:
        """In a pool thread: the complete reply of any request through the WSGI app, and keep-alive.
        ``codec`` (unless None) decodes a verb call's body and encodes its answer (environ[CODEC])."""



class ConnectionLoop:
    """Every connection of one worker, in one thread: accept, handshake, head, body, dispatch, reply,
    keep-alive, linger, deadlines (see the module doc). ``lane``: the app's direct lane, if it offers one."""

    def __init__(self, host: Host, settings: Settings, tls: Any, lane: Any) -> None:
        from guard import metrics

        s = settings
        self.host = host
        self.log = host.log
        self.selector = host.selector
        self.settings = s
        self.rejected = metrics.CONNECTIONS_REJECTED
        self.open_gauge = metrics.CONNECTIONS_OPEN
        self.parked_gauge = metrics.CALLS_PARKED
        self.buffered_gauge = metrics.BUFFERED_BYTES
        self.queued_gauge = metrics.CALLS_QUEUED
        self.next_sample = 0.0
        self.tls = tls
        self.conns: set[Conn] = set()
        self.per_client: _Tally = _Tally()
        self.buffered = 0  # bytes reserved by large requests being read, run or answered
        self.admitted = 0  # open connections not being refused
        self.refusing = 0  # connections being refused (their 503 on its way); at most refusing_max
        self.refusing_max = max(16, s.max_connections // 8)
        self.large_running: _Tally = _Tally()  # large calls in the pool, per source address
        self.large_waiting: dict[str, deque] = {}  # large calls waiting their turn, per source address
        # Helper processes that decode and encode calls over OFFLOAD_BYTES (guard.serving.offload): at most one
        # such call each in the pool at once.
        self.offload = Offload() if lane is not None else None
        self.offload_count = self.offload.count if self.offload is not None else 0
        self.huge_running = 0
        self.accept_paused_until = 0.0
        self.direct: Any = lane  # the app's direct lane (guard.http.lane.DIRECT_LANE), or None
        if lane is not None:
            self.direct_paths = frozenset(p.encode("ascii") for p in lane.paths)
            self.direct_max_body = lane.max_body
        self._answering = False  # the loop is answering a request itself (_dispatch)

    # --- registration --------------------------------------------------------------------------------

    def _want(self, conn: Conn, events: int) -> None:
        if conn.events == events:
            return
        if conn.events:
            self.selector.modify(conn.sock, events, conn)
        else:
            self.selector.register(conn.sock, events, conn)
        conn.events = events

    def _unwatch(self, conn: Conn) -> None:
        if conn.events:
            try:
                self.selector.unregister(conn.sock)
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
        self.host.connections(len(self.conns))
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
                    self.host.accepting(False)
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
            self.host.connections(len(self.conns))
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
                head_len = head_end(conn.buf)
                if head_len is None:
                    return False
                head, kind, length, expect = request_framing(bytes(conn.buf[:head_len]), s.max_body_bytes)
                conn.proven = True
                now = time.monotonic()
                conn.head, conn.head_len, conn.kind = head, head_len, kind
                conn.state, conn.body_start = BODY, now
                if kind == "length":
                    conn.need = conn.head_len + length
                    conn.deadline = now + max(s.body_timeout, length / s.body_min_rate)
                else:
                    conn.chunks = ChunkScan(conn.head_len)
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
                with memoryview(conn.buf) as view:  # one copy of a body (megabytes, under the GIL), not three
                    if len(conn.head) == conn.head_len:  # the head as it came (no Expect dropped)
                        request = bytes(view[:end])
                    else:
                        request = conn.head + bytes(view[conn.head_len:end])
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
        """Where a chunked body ends in the buffer, or None while incomplete (its deadline moved on by
        the bytes it has sent). Raises FramingError."""
        s, chunks = self.settings, conn.chunks
        assert chunks is not None
        before = chunks.size
        end = chunks.scan(conn.buf, conn.head_len, s.max_body_bytes)
        if chunks.size != before:
            conn.deadline = conn.body_start + s.body_timeout + chunks.size / s.body_min_rate
        return end

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

    def _to_pool(self, conn: Conn, request: bytes, arrived: float | None = None, taken: _Parked | None = None) -> None:
        conn.state, conn.deadline = BUSY, 0.0
        self._unwatch(conn)
        if len(request) > LARGE_CALL:
            huge = len(request) > OFFLOAD_BYTES and self.offload is not None
            if not self._turn_free(conn.ip, huge):  # wait for a turn (a free one is never left while one waits)
                arrived = time.monotonic() if arrived is None else arrived
                conn.state, conn.deadline = QUEUED, arrived + self.settings.request_budget
                self.large_waiting.setdefault(conn.ip, deque()).append((conn, request, arrived, taken))
                return
            self._take_turn(conn, huge)
        self._submit(conn, request, arrived, taken)

    def _submit(self, conn: Conn, request: bytes, arrived: float | None, taken: _Parked | None = None) -> None:
        future = self.host.submit(self._serve_and_send, conn, request, arrived, taken)
        future.add_done_callback(lambda f: self.host.defer(self._served, conn, f))

    def _turn_free(self, ip: str, huge: bool) -> bool:
        """Whether a large call of ``ip`` may take a pool thread now: its client has no other there, and
        a call for a helper process (``huge``) finds one free (no thread ever waits for a helper)."""
        return self.large_running[ip] < LARGE_PER_CLIENT and (not huge or self.huge_running < self.offload_count)

    def _take_turn(self, conn: Conn, huge: bool) -> None:
        self.large_running[conn.ip] += 1
        conn.large = True
        if huge:
            self.huge_running += 1
            conn.huge = True

    def _next_large(self, conn: Conn) -> None:
        """A large call left the pool: the calls waiting for a turn that is free now go in, one client
        address after another (the address served last goes to the back)."""
        self.large_running[conn.ip] -= 1
        if self.large_running[conn.ip] <= 0:
            del self.large_running[conn.ip]
        if conn.huge:
            conn.huge = False
            self.huge_running -= 1
        for ip in list(self.large_waiting):
            waiting = self.large_waiting[ip]
            while waiting and (waiting[0][0].closed or waiting[0][0].state != QUEUED):
                waiting.popleft()
            if waiting:
                first, request, arrived, taken = waiting[0]
                huge = len(request) > OFFLOAD_BYTES and self.offload is not None
                if not self._turn_free(ip, huge):
                    continue
                waiting.popleft()
                first.state, first.deadline = BUSY, 0.0
                self._take_turn(first, huge)
                self._submit(first, request, arrived, taken)
            del self.large_waiting[ip]
            if waiting:
                self.large_waiting[ip] = waiting  # to the back of the round

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
                                                f"one before it, and a call over {OFFLOAD_BYTES} bytes for one of "
                                                f"{self.offload_count} helper processes, within --request-budget); "
                                                "retry"), keep=False)

    def _answer_now(self, conn: Conn, request: bytes) -> tuple[bytes, bool] | str | None:
        """(reply, keep-alive) when the app's direct lane can answer at once without waiting (its
        ``answer_now``); PARKED when the call waits for its pod's GET in flight (answered by
        :meth:`_landed`); BUSY when the lane decoded it but it needs a thread (handed to one with the
        decoded call); else None: the request goes to a pool thread as any other."""
        call = plain_call(request, self.direct_paths, self.direct_max_body)
        if call is None:
            return None
        path, body, keep = call
        parked = _Parked(request, keep)
        try:
            answered = self.direct.answer_now(path, body, conn.ip, conn.peer_cert,
                                              partial(self.host.defer, self._landed, conn, parked))
        except Exception:
            self.log.exception("answering %s in the event loop failed; a pool thread answers it", path)
            return None
        if answered is None:
            return None
        if not isinstance(answered, tuple):
            parked.waiting = answered
            if not answered.joined:  # decoded, but it needs a thread (a miss): handed on as it is
                self._to_pool(conn, request, answered.arrived, parked)
                return BUSY
            conn.parked = parked
            conn.state, conn.deadline = PARKED, answered.arrived + self.settings.request_budget - PARK_MARGIN
            self._unwatch(conn)
            return PARKED
        status, payload = answered
        keep = keep and self.host.alive
        return plain_reply(status, status_phrase(status), payload, keep), keep

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
            self._to_pool(conn, parked.request, parked.waiting.arrived, parked)
            return
        status, payload = answered
        keep = parked.keep and self.host.alive
        self._answering = True
        try:
            self._send_reply(conn, plain_reply(status, status_phrase(status), payload, keep), keep=keep)
        finally:
            self._answering = False

    def _unpark(self, conn: Conn) -> None:
        """A parked call's GET has not landed with PARK_MARGIN of its budget left: a pool thread
        takes it over and waits out the rest (Checker.check, the same budget)."""
        parked, conn.parked = conn.parked, None
        assert parked is not None
        self._to_pool(conn, parked.request, parked.waiting.arrived, parked)

    def _serve(self, conn: Conn, request: bytes, arrived: float | None = None,
               taken: _Parked | None = None) -> tuple[bytes, bool]:
        """In a pool thread: the reply to a complete request, and whether the connection stays open.
        ``arrived``: when the call's budget began, if it was parked first (default: now). ``taken``: the
        call as the direct lane decoded it in the loop (answered as it is, never decoded again)."""
        if taken is not None:
            status, payload = self.direct.answer_taken(taken.waiting)
            keep = taken.keep and self.host.alive
            return plain_reply(status, status_phrase(status), payload, keep), keep
        if self.direct is not None:
            # Any body the worker took (its bytes are held against --max-buffered-bytes already): gunicorn's
            # parser spends ~30 ms of GIL reading a 4 MiB body back out of memory, which the loop waits out.
            call = plain_call(request, self.direct_paths, self.settings.max_body_bytes)
            if call is not None:
                path, body, keep = call
                if conn.huge and self.offload is not None:  # decoded and encoded by a helper process
                    start = time.monotonic() if arrived is None else arrived
                    with self.offload.codec(start + BUDGET_SHARE * self.settings.request_budget) as codec:
                        status, payload = self.direct(path, body, conn.ip, conn.peer_cert, arrived, codec)
                else:
                    status, payload = self.direct(path, body, conn.ip, conn.peer_cert, arrived)
                keep = keep and self.host.alive
                return plain_reply(status, status_phrase(status), payload, keep), keep
        if conn.huge and self.offload is not None:  # any other shape of a large call: the same helpers
            start = time.monotonic() if arrived is None else arrived
            with self.offload.codec(start + BUDGET_SHARE * self.settings.request_budget) as codec:
                return self.host.serve_wsgi(conn, request, codec)
        return self.host.serve_wsgi(conn, request, None)

    def _serve_and_send(self, conn: Conn, request: bytes, arrived: float | None = None,
                        taken: _Parked | None = None) -> tuple[memoryview, bool, bool]:
        """In a pool thread: the reply, and as much of it as the socket takes right now (never waiting).

        The loop does not touch a connection while its request runs, so the thread may write
        to it; whatever does not fit at once is left to the loop and its write deadline.
        Returns (the rest of the reply, keep-alive, the connection broke).
        """
        data, keep = self._serve(conn, request, arrived, taken)
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
            self._next_large(conn)
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
        self._send_reply(conn, rest, keep=keep and self.host.alive)

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
            events = self.selector.select(timeout)
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
        self.host.accepting(True)
        notified = 0.0
        while self.host.alive:
            # The heartbeat gunicorn's arbiter checks (a utime of the worker's tmp file, --timeout 30 s):
            # once a second is plenty, not once per event (it was 2 % of the guard's CPU per pod).
            if time.monotonic() - notified >= 1.0:
                self.host.heartbeat()
                notified = time.monotonic()
            if self.accept_paused_until and time.monotonic() >= self.accept_paused_until:
                self.accept_paused_until = 0.0
                self.host.accepting(True)
            self._poll(TICK)
            if not self.host.parent_alive():
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
        self.host.accepting(False)
        stop_by = time.monotonic() + self.host.graceful_timeout
        while self.conns and time.monotonic() < stop_by:
            for conn in [c for c in self.conns if c.state in (IDLE, HANDSHAKE) or (c.state == HEAD and not c.buf)]:
                self._close(conn, None)
            for conn in self.conns:
                conn.keep = False
            self.host.heartbeat()
            self._poll(TICK)
            self._expire(time.monotonic())
        for conn in list(self.conns):
            self._close(conn, None)
        if self.offload is not None:
            self.offload.close()
