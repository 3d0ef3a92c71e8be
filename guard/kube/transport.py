"""The quorum GET's transport: GETs over kept-alive HTTP/1.1 connections to one apiserver.

The quorum GET runs once per pod the scheduler is about to place, so its CPU is the guard's
cost per pod. Through urllib3 (the kubernetes client's pool) one GET cost about 0.96 ms of CPU
in this process, most of it in urllib3's request and response objects and in ``http.client``'s
header parsing (the ``email`` package); ``Kube.quorum_get`` on this module takes about 0.33 ms,
the token refresh hook and decoding included (``python -m benchmarks.quorum_get_cpu``,
docs/BENCHMARKS.md).

What stays urllib3's: opening a connection. :class:`Connections` builds
``urllib3.connection.HTTPSConnection`` with the keyword arguments the kubernetes client gives its
own pool (``guard.kube.config.connection_settings``: the kubeconfig's CA, client certificate,
``tls-server-name``, hostname checking, socket options) and calls its ``connect()``: the TCP
connect and the TLS handshake, verified exactly as the client's own calls are. One thing differs:
urllib3 builds an ``SSLContext`` for each connection and loads the CA and the client certificate
into it (about 1 ms of CPU, more with a CA bundle; 16 connections open at once when the pre-verifier's
threads start a burst), so :class:`Connections` builds that context once, the way urllib3 builds it,
and gives it to every connection; a CA, certificate or key file that changes on disk (a rotation)
makes the next connection build it again, as urllib3 would have read the new files.

What is ours: writing one GET, reading the reply with ``httptools`` (llhttp, the parser of
Node.js and uvicorn: status line, headers, ``Content-Length`` or chunked body) within one deadline
for the whole exchange, a bound on the reply's size, and keeping the connection for the next GET.
A kept connection that the server closed while it was idle is noticed before it is used
(readable with nothing owed to us), as urllib3 does, and never retried after the request was
written: a GET is sent at most once.

Through a proxy (``configuration.proxy`` and the host not in ``no_proxy``) ``guard.kube.reads`` keeps the
client's pool, which speaks CONNECT and SOCKS.
"""

from __future__ import annotations

import os
import select
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httptools
import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.util.ssl_ import ALPN_PROTOCOLS, create_urllib3_context, resolve_cert_reqs
from urllib3.util.ssl_match_hostname import CertificateError

# A pod is at most about 1.5 MiB in etcd; its JSON is larger, but not this large.
MAX_REPLY_BYTES = 8 * 1024 * 1024
READ_SIZE = 64 * 1024
# Of a status line's reason phrase ("Not Found"), at most this much is kept.
MAX_REASON_BYTES = 256


class GetError(Exception):
    """No usable reply. ``kind``: ``timeout``, ``tls``, ``connection`` or ``protocol``; ``name`` says what
    happened in one word (an exception's type name, as the guard's fail-open reasons give it)."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"{kind}: {name}")
        self.kind, self.name = kind, name


class Reply:
    __slots__ = ("status", "reason", "body")

    def __init__(self, status: int, reason: str, body: bytes) -> None:
        self.status, self.reason, self.body = status, reason, body


class _Reading:
    """httptools' callbacks for one reply."""

    __slots__ = ("parser", "reason", "parts", "size", "messages", "done", "keep_alive", "too_large")

    def __init__(self) -> None:
        self.parser: Any = None
        self.keep_alive = False
        self.too_large = False
        self.reason = b""
        self.parts: list[bytes] = []
        self.size = 0
        self.messages = 0
        self.done = False

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_status(self, data: bytes) -> None:
        if self.messages == 1 and len(self.reason) < MAX_REASON_BYTES:  # llhttp streams the line: keep a bound
            self.reason = (self.reason + data)[:MAX_REASON_BYTES]

    def on_body(self, data: bytes) -> None:
        if self.messages != 1:  # bytes after our reply: never part of it
            return
        self.size += len(data)
        if self.size > MAX_REPLY_BYTES:
            self.too_large = True
            raise GetError("protocol", "ReplyTooLarge")  # httptools stops parsing (HttpParserCallbackError)
        self.parts.append(data)

    def on_message_complete(self) -> None:
        if self.messages == 1:
            self.done = True
            self.keep_alive = self.parser.should_keep_alive()  # llhttp resets it once the callback returns

    def read_more(self, sock: Any, timeout: float) -> None:
        """One read from ``sock`` (waiting at most ``timeout``) fed to the parser. Raises GetError."""
        with _socket_errors():
            sock.settimeout(timeout)
            data = sock.recv(READ_SIZE)
        if not data:
            raise GetError("connection", "RemoteDisconnected")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if self.too_large:
                raise GetError("protocol", "ReplyTooLarge") from e
            if not self.done:
                raise GetError("protocol", type(e).__name__) from e
            self.messages += 1  # bytes after our reply that are no reply: keep ours, drop the connection


@contextmanager
def _socket_errors() -> Iterator[None]:
    """Socket and TLS errors as GetError."""
    try:
        yield
    except (TimeoutError, ssl.SSLWantReadError, ssl.SSLWantWriteError) as e:
        raise GetError("timeout", "TimeoutError") from e
    except ssl.SSLError as e:
        raise GetError("tls", type(e).__name__) from e
    except OSError as e:
        raise GetError("connection", type(e).__name__) from e


class _Conn:
    __slots__ = ("http", "sock")

    def __init__(self, http: HTTPConnection) -> None:
        self.http = http
        self.sock: Any = http.sock

    def close(self) -> None:
        try:
            self.http.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass


class Connections:
    """Kept-alive connections to one apiserver URL (``https://host:port`` or ``http://``), for GETs."""

    def __init__(self, url: str, settings: dict[str, Any], *, keep: int) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("https", "http") or not parts.hostname:
            raise ValueError(f"not an apiserver URL: {url!r}")
        self.url = url
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._settings = settings if self._https else {k: v for k, v in settings.items() if k == "socket_options"}
        # The TLS context every connection shares (built at the first connect, again when a file it read changes),
        # and the connection's other keyword arguments: the files are read into the context, not by each connect.
        self._tls_files = tuple(p for p in (settings.get(k) for k in _TLS_FILE_KEYS) if p) if self._https else ()
        self._tls: tuple[tuple[object, ...], ssl.SSLContext] | None = None
        self._conn_settings = {k: v for k, v in self._settings.items() if k not in _TLS_KEYS}
        self._keep = max(1, keep)
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False

    def get(self, path: str, headers: dict[str, str], timeout: float) -> Reply:
        """GET ``path`` (already percent-encoded) within ``timeout`` seconds in all. Raises GetError."""
        deadline = time.monotonic() + timeout
        request = self._request(path, headers)
        conn = self._idle_conn() or self._connect(deadline)
        try:
            reply, keep = self._exchange(conn, request, deadline)
        except BaseException:
            conn.close()
            raise
        if keep:
            self._give_back(conn)
        else:
            conn.close()
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # --- the parts ------------------------------------------------------------------------------

    def _request(self, path: str, headers: dict[str, str]) -> bytes:
        lines = [f"GET {path} HTTP/1.1", f"Host: {self._host_header}"]
        for name, value in headers.items():
            value = str(value)
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
                raise GetError("protocol", "InvalidHeader")  # a token with a line break: never sent
            lines.append(f"{name}: {value}")
        if not path.startswith("/") or any(c in path for c in " \r\n"):
            raise GetError("protocol", "InvalidPath")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", errors="strict")

    def _idle_conn(self) -> _Conn | None:
        """The most recently used kept connection that is still open, or None."""
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()
            if _still_open(conn.sock):
                return conn
            conn.close()

    def _give_back(self, conn: _Conn) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._keep:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self, deadline: float) -> _Conn:
        left = deadline - time.monotonic()
        if left <= 0:
            raise GetError("timeout", "TimeoutError")
        if self._https:
            context = self._context()
            http: HTTPConnection = HTTPSConnection(self._host, self._port, timeout=left, ssl_context=context,
                                                   **self._conn_settings)
        else:
            http = HTTPConnection(self._host, self._port, timeout=left, **self._settings)
        try:
            http.connect()
        except urllib3.exceptions.NewConnectionError as e:  # before its base class ConnectTimeoutError
            http.close()
            raise GetError("connection", type(e).__name__) from e
        except (urllib3.exceptions.ConnectTimeoutError, TimeoutError) as e:
            http.close()
            raise GetError("timeout", type(e).__name__) from e
        except (ssl.SSLError, CertificateError, urllib3.exceptions.SSLError) as e:
            http.close()
            raise GetError("tls", type(e).__name__) from e
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as e:
            http.close()
            raise GetError("connection", type(e).__name__) from e
        return _Conn(http)

    def _context(self) -> ssl.SSLContext:
        """The shared TLS context, built again when a CA, certificate or key file changed since it was built.
        Raises GetError("tls") when it cannot be built (a file missing or unreadable, an encrypted key)."""
        stamp = tuple(_file_stamp(p) for p in self._tls_files)
        tls = self._tls
        if tls is not None and tls[0] == stamp:
            return tls[1]
        try:
            context = _build_context(self._settings)
        except (ssl.SSLError, urllib3.exceptions.SSLError, OSError, ValueError) as e:
            raise GetError("tls", type(e).__name__) from e
        self._tls = (stamp, context)
        return context

    def _exchange(self, conn: _Conn, request: bytes, deadline: float) -> tuple[Reply, bool]:
        """Write the request, read one reply. Returns it and whether the connection may be kept."""
        sock = conn.sock
        reading = _Reading()
        parser = reading.parser = httptools.HttpResponseParser(reading)
        with _socket_errors():
            sock.settimeout(_left(deadline))
            sock.sendall(request)
        while not reading.done:
            reading.read_more(sock, _left(deadline))
        keep = reading.messages == 1 and reading.keep_alive and not (self._https and sock.pending())
        reply = Reply(parser.get_status_code(), reading.reason.decode("latin-1").strip(), b"".join(reading.parts))
        return reply, keep


# The settings urllib3 reads into a TLS context at each connect (here: once, into the shared one), and of them the files.
# (cert_reqs stays a connection's setting too: urllib3 sets it on the context at each connect, the same value.)
_TLS_FILE_KEYS = ("ca_certs", "cert_file", "key_file")
_TLS_KEYS = ("ca_cert_data", *_TLS_FILE_KEYS)


def _build_context(settings: dict[str, Any]) -> ssl.SSLContext:
    """The context urllib3 2.x builds for a connection with these settings (``connection.
    _ssl_wrap_socket_and_match_hostname`` and ``util.ssl_.ssl_wrap_socket`` with no context given): its defaults
    and ``cert_reqs``, the CA (the system's when the kubeconfig names none), the client certificate (an encrypted
    key refused, never a passphrase prompt), ALPN. Hostname checks stay per connection (urllib3's, as before)."""
    context = create_urllib3_context(cert_reqs=resolve_cert_reqs(settings.get("cert_reqs")))
    ca_certs, ca_data = settings.get("ca_certs"), settings.get("ca_cert_data")
    if ca_certs or ca_data:
        context.load_verify_locations(ca_certs, None, ca_data)
    else:
        context.load_default_certs()
    cert_file, key_file = settings.get("cert_file"), settings.get("key_file")
    if key_file and _key_file_encrypted(key_file):
        raise urllib3.exceptions.SSLError("Client private key is encrypted, password is required")
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(ALPN_PROTOCOLS)
    return context


def _key_file_encrypted(path: str) -> bool:
    """urllib3's own test (its private ``_is_key_file_encrypted``, kept out of our imports): a PEM header
    saying ENCRYPTED (``Proc-Type: 4,ENCRYPTED`` or ``BEGIN ENCRYPTED PRIVATE KEY``)."""
    with open(path, errors="replace") as f:
        return any("ENCRYPTED" in line for line in f)


def _file_stamp(path: str) -> tuple[int, int, int] | None:
    """What tells a changed file: inode, size, modification time (None: not there now)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise GetError("timeout", "TimeoutError")
    return left


def _still_open(sock: Any) -> bool:
    """A kept connection is usable when nothing is waiting to be read on it: a server that closed
    it while idle left an EOF (or a close_notify) there; anything else is bytes we never asked for."""
    try:
        if sock.fileno() < 0 or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            return False
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False
