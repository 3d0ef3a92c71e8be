"""One apiserver replica: an HTTPS server on its own loopback IP with its own watch cache.

Reads follow k8s.io/apiserver/pkg/storage/cacher (delegator.go): GET without
resourceVersion goes to etcd, ``resourceVersion=0`` reads the cache, a LIST
without resourceVersion is a consistent read from the cache (wait until the
cache reaches etcd's current revision). Writes go to etcd (registry.py).
Requests pass through the replica's faults first, and every request is logged.
"""

from __future__ import annotations

import base64
import collections
import logging
import re
import select
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson

from guard.lab.api import (
    RESOURCES, ApiError, FieldRequirement, Obj, Resource, Selector, bad_request, gone, internal_error,
    method_not_allowed, not_found, parse_field_selector, parse_label_selector, path_not_found, resource_for,
    table, too_many_requests, unauthorized, wants_table,
)
from guard.lab import openapi
from guard.lab.api import FIELD_VALIDATION_DIRECTIVES, unknown_fields
from guard.lab.watchcache import WatchCache
from guard.lab.faults import FaultError, FaultRule, Faults
from guard.lab.pki import KeyPair
from guard.lab.registry import Registry, output_field, output_form
from guard.lab.store import EtcdClient, EtcdUnavailable

log = logging.getLogger(__name__)

MAX_BODY = 3 * 1024 * 1024  # the apiserver's request body limit
KUBE_VERSION = {"major": "1", "minor": "34", "gitVersion": "v1.34.0-ghost-lab", "gitCommit": "0000000000000000000000000000000000000000",
                "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.24.0", "compiler": "gc",
                "platform": "linux/amd64"}
ANONYMOUS_PATHS = ("/healthz", "/livez", "/readyz", "/version")


def _rv_match(ctx: _Ctx, rv: str | None) -> str | None:
    """A list's ``resourceVersionMatch``, refused as the apiserver refuses it (an unknown value; any value
    without a ``resourceVersion``)."""
    match = ctx.query.get("resourceVersionMatch")
    if match not in (None, "", "NotOlderThan", "Exact"):
        raise _list_options_invalid("FieldValueNotSupported", "Unsupported value",
                                   f'"{match}": supported values: "Exact", "NotOlderThan", ""')
    if match and rv is None:
        raise _list_options_invalid("FieldValueForbidden", "Forbidden",
                                   "resourceVersionMatch is forbidden unless resourceVersion is provided")
    return match


def _list_options_invalid(reason: str, kind: str, detail: str) -> ApiError:
    """ValidateListOptions' 422: ``ListOptions.meta.k8s.io "" is invalid: resourceVersionMatch: KIND: DETAIL``."""
    return ApiError(422, "Invalid", f'ListOptions.meta.k8s.io "" is invalid: resourceVersionMatch: {kind}: {detail}',
                    {"group": "meta.k8s.io", "kind": "ListOptions",
                     "causes": [{"reason": reason, "message": f"{kind}: {detail}", "field": "resourceVersionMatch"}]})


def _limit_param(value: str | None) -> int:
    """``limit`` as ParseInt reads it; 0 or negative: no limit."""
    if value in (None, ""):
        return 0
    if not re.fullmatch(r"[+-]?[0-9]+", value):
        raise bad_request(f'strconv.ParseInt: parsing "{value}": invalid syntax')
    return max(0, int(value))


def _decode_continue(token: str) -> tuple[str, int]:
    """A continue token (storage.DecodeContinue): base64url JSON {"v": "meta.k8s.io/v1", "rv": N, "start": KEY}."""
    try:
        doc = orjson.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        if not isinstance(doc, dict):
            raise ValueError("continue key is not valid: the token is not a JSON object")
        if doc.get("v") != "meta.k8s.io/v1":
            raise ValueError(f"continue key is not valid: server does not recognize this encoded version {doc.get('v') or ''}")
        start, rv = doc.get("start"), doc.get("rv")
        if not isinstance(start, str) or not isinstance(rv, int) or isinstance(rv, bool) or rv <= 0 \
                or start.startswith("/") or ".." in start.split("/"):
            raise ValueError("continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)")
    except ValueError as e:  # binascii.Error and orjson.JSONDecodeError are ValueErrors
        why = str(e) if str(e).startswith("continue key") else f"continue key is not valid: {e}"
        raise bad_request(f"invalid continue token: {why}") from e
    return start, rv


@dataclass(frozen=True)
class RequestRecord:
    """One request as the replica saw it. ``source``: "etcd", "cache", "fault" or "" (no storage read)."""

    method: str
    path: str
    query: dict[str, str]
    status: int
    time: float  # epoch seconds at arrival
    duration: float
    source: str = ""

    @property
    def quorum(self) -> bool:
        """A read served by etcd (GET one object without resourceVersion, or a LIST that fell back to etcd)."""
        return self.method == "GET" and self.source == "etcd"

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "query": self.query, "status": self.status,
                "time": self.time, "duration": self.duration, "source": self.source, "quorum": self.quorum}


class _Dropped(Exception):
    """Close the connection without an answer (the hang fault ended)."""


@dataclass
class _Ctx:
    method: str
    path: str
    query: dict[str, str]
    headers: Any
    handler: BaseHTTPRequestHandler
    source: str = ""
    status: int = 0
    started: float = 0.0
    t0: float = 0.0
    recorded: bool = False
    cut: bool = False  # a "cut" fault: half the answer's body, then the connection closes
    late: FaultRule | None = None  # a "late" fault: served, the answer held back until the rule lets it go
    body_cache: bytes | None = field(default=None, repr=False)

    def body(self) -> bytes:
        if self.body_cache is None:
            if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                self.body_cache = self._chunked()  # Go's net/http takes chunked bodies (kubectl create --raw -f sends one)
                return self.body_cache
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise ApiError(413, "RequestEntityTooLarge", "the request is too large")
            self.body_cache = self.handler.rfile.read(n) if n else b""
        return self.body_cache

    def _chunked(self) -> bytes:
        rfile, out = self.handler.rfile, bytearray()
        while True:
            line = rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip() or b"x", 16)
            except ValueError as e:
                self.handler.close_connection = True
                raise bad_request("malformed chunked request body") from e
            if size == 0:
                while rfile.readline(1024) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return bytes(out)
            if len(out) + size > MAX_BODY:
                self.handler.close_connection = True
                raise ApiError(413, "RequestEntityTooLarge", "the request is too large")
            out += rfile.read(size)
            rfile.readline(1024)  # the CRLF after the chunk

    def json(self) -> Any:
        try:
            return orjson.loads(self.body() or b"null")
        except ValueError as e:
            raise bad_request(f"the body of the request could not be decoded: {e}") from e


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], replica: ApiserverReplica, ssl_ctx: ssl.SSLContext) -> None:
        self.replica = replica
        self.ssl_ctx = ssl_ctx
        self.conns: set[socket.socket] = set()
        self.conns_lock = threading.Lock()
        self.closing = False
        super().__init__(addr, _Handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self.conns_lock:
            if self.closing:
                request.close()
                return
            self.conns.add(request)
        try:
            request.settimeout(10)
            # Go's net/http (the real apiserver) sets TCP_NODELAY; without it, headers and body written
            # separately meet the client's delayed ACK and every reply waits ~40 ms.
            request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # wrap_socket takes over the file descriptor: from here on only ``tls`` can shut it down
            tls = self.ssl_ctx.wrap_socket(request, server_side=True)
            tls.settimeout(300)
        except (OSError, ssl.SSLError):
            self._forget(request)
            self.shutdown_request(request)
            return
        with self.conns_lock:
            self.conns.discard(request)
            self.conns.add(tls)
            closing = self.closing
        try:
            if not closing:
                self.finish_request(tls, client_address)
        except Exception:  # noqa: BLE001 - a broken connection must not kill the server
            pass
        finally:
            self._forget(tls)
            try:
                tls.close()
            except OSError:
                pass

    def _forget(self, sock: socket.socket) -> None:
        with self.conns_lock:
            self.conns.discard(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:  # quiet
        pass

    def drop_connections(self) -> None:
        """Close every open connection (kept-alive ones and watches): a stopped replica serves nothing."""
        with self.conns_lock:
            self.closing = True
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Replies are buffered and leave when the request is done (handle_one_request flushes), as Go's
    # net/http sends a reply that fits its buffers (server.go: bufferBeforeChunkingSize, the
    # connection's 4 KiB writer): a client reads a small reply whole, not its head and then its body.
    # A watch flushes its head and each event itself.
    wbufsize = 4096
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _dispatch(self) -> None:
        self.server.replica._serve(self)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _dispatch


def _peer_gone(sock: socket.socket) -> bool:
    """A watch client sends nothing after its request: a readable socket means it closed (or misbehaves)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _query(qs: str) -> dict[str, str]:
    return {k: v[0] for k, v in urllib.parse.parse_qs(qs, keep_blank_values=True).items()}


def _bool(q: dict[str, str], key: str) -> bool:
    return q.get(key, "").lower() in ("true", "1")


def _int(q: dict[str, str], key: str) -> int | None:
    v = q.get(key)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError as e:
        raise bad_request(f"{key}: invalid value {v!r}: must be an integer") from e


class ApiserverReplica:
    """One lab kube-apiserver replica: an HTTPS server over its own watch cache (``guard.lab.watchcache``).
    Created and started by ``Lab``; ``stop()``/``start()``/``restart()`` for faults. (The guard's own
    record of a replica's address is ``guard.core.settings.Replica``.)"""

    def __init__(self, index: int, ip: str, port: int, etcd_url: str, token: str, serving: KeyPair, *,
                 bookmark_interval: float = 1.0, history_size: int = 10000, consistent_read_timeout: float = 3.0,
                 endpoints: bool = True, peer_advertise_address: bool = False) -> None:
        self.index = index
        self.ip = ip
        self.port = port
        self.url = f"https://{ip}:{port}"
        self.hostname = f"lab-apiserver-{index}"
        self.token = token
        self.faults = Faults()
        self.bookmark_interval = bookmark_interval
        self.history_size = history_size
        self.consistent_read_timeout = consistent_read_timeout
        self._endpoints = endpoints
        self._peer_advertise = peer_advertise_address
        self._etcd = EtcdClient(etcd_url)
        self.registry = Registry(self._etcd)
        self.cache: WatchCache | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=200_000)
        self._log_lock = threading.Lock()
        # Watch events written, by the watch's path and event type (what each watcher costs to decode).
        self._watch_events: collections.Counter[tuple[str, str]] = collections.Counter()
        self._ssl = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.NamedTemporaryFile("wb", suffix=".pem") as f:
            f.write(serving.cert_pem + serving.key_pem)
            f.flush()
            self._ssl.load_cert_chain(f.name)
        self.identity_lease: Obj | None = None

    def __repr__(self) -> str:
        return f"ApiserverReplica({self.index}, {self.url}, running={self.running})"

    # --- lifecycle ----------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._server is not None

    def bind(self) -> None:
        """Bind the listening socket (raises OSError if the address is taken)."""
        self._stopping = threading.Event()
        self._server = _Server((self.ip, self.port), self, self._ssl)

    def start(self, wait_ready: float = 10.0) -> None:
        """Start serving: cache built from etcd (initial LIST + WATCH), identity lease, endpoint entry.

        Waits up to ``wait_ready`` seconds for the cache; until it is ready,
        cache-served requests get 429 (and /readyz 500). If etcd is down, the
        lease and endpoint writes are retried in the background.
        """
        if self._server is None:
            self.bind()
        assert self._server is not None
        self.cache = WatchCache(self._etcd, self.faults, self.history_size, name=str(self.index))
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"replica-{self.index}", daemon=True)
        self._thread.start()
        self.cache.start(wait_ready)
        if self._endpoints:
            try:
                self._register()
            except EtcdUnavailable:
                threading.Thread(target=self._register_later, args=(self._stopping,), daemon=True,
                                 name=f"replica-{self.index}-register").start()

    def _register(self) -> None:
        peer = f"{self.ip}:{self.port}" if self._peer_advertise else None
        self.identity_lease = self.registry.write_identity_lease(self.hostname, peer)
        self.registry.reconcile_endpoints(self.ip, self.port, present=True)

    def _register_later(self, stopping: threading.Event) -> None:
        while not stopping.wait(0.2):
            try:
                self._register()
                return
            except EtcdUnavailable:
                continue

    def stop(self, graceful: bool = True) -> None:
        """Stop serving and drop the cache. ``graceful``: first leave ``default/kubernetes`` endpoints (a
        clean shutdown); ``graceful=False`` is a crash: the IP stays listed (the lab has no lease expiry)."""
        if self._server is None:
            return
        if self._endpoints and graceful:
            try:
                self.registry.reconcile_endpoints(self.ip, self.port, present=False)
            except EtcdUnavailable:
                pass
        self._stopping.set()
        server, self._server = self._server, None
        if self._thread is not None and self._thread.is_alive():
            server.shutdown()  # only a running serve_forever() can answer shutdown(); else it waits forever
        server.server_close()
        server.drop_connections()
        if self.cache is not None:
            self.cache.stop()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def restart(self) -> None:
        """Stop and start again: the new cache is rebuilt from etcd (a rolling restart heals a missed delete)."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._etcd.close()

    # --- request log --------------------------------------------------------

    def requests(self, method: str | None = None, path: str | None = None, quorum: bool | None = None,
                 since: float | None = None) -> list[RequestRecord]:
        """Logged requests, filtered: exact ``method``/``path``, ``quorum`` reads only (or not), arrived at/after ``since``."""
        with self._log_lock:
            recs = list(self._log)
        return [r for r in recs
                if (method is None or r.method == method) and (path is None or r.path == path)
                and (quorum is None or r.quorum == quorum) and (since is None or r.time >= since)]

    def clear_requests(self) -> None:
        with self._log_lock:
            self._log.clear()
            self._watch_events.clear()

    def watch_events(self) -> dict[str, dict[str, int]]:
        """Watch events written so far, by the watch's path and then event type."""
        with self._log_lock:
            counts = list(self._watch_events.items())
        out: dict[str, dict[str, int]] = {}
        for (path, typ), n in counts:
            out.setdefault(path, {})[typ] = n
        return out

    @property
    def cache_revision(self) -> int:
        return self.cache.rv if self.cache else 0

    # --- serving --------------------------------------------------------------

    def _serve(self, h: _Handler) -> None:
        if self._stopping.is_set():  # a request on a connection kept alive across stop(): no answer
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        parsed = urllib.parse.urlsplit(h.path)
        ctx = _Ctx(h.command, parsed.path, _query(parsed.query), h.headers, h, started=time.time(), t0=time.monotonic())
        try:
            try:
                self._authenticate(ctx)
                if ctx.path.startswith("/lab/"):
                    self._admin(ctx)
                else:
                    self._apply_faults(ctx)
                    self._route(ctx)
            except ApiError as e:
                self._send(ctx, e.code, e.status(), e.headers)
            except FaultError as e:
                self._send(ctx, 400, bad_request(str(e)).status())
            except EtcdUnavailable as e:
                self._send(ctx, 500, internal_error(f"etcd unavailable: {e}").status())
            except (_Dropped, ConnectionError, ssl.SSLError, TimeoutError):
                raise
            except Exception as e:  # noqa: BLE001 - never a bare traceback to the client
                log.exception("replica %s: %s %s", self.index, ctx.method, ctx.path)
                self._send(ctx, 500, internal_error(repr(e)).status())
        except _Dropped:
            h.close_connection = True
            try:
                h.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except (ConnectionError, ssl.SSLError, TimeoutError, OSError):
            h.close_connection = True
        finally:
            self._record(ctx)

    def _record(self, ctx: _Ctx) -> None:
        """Log the request once, before its answer leaves (a client reading the log next sees it)."""
        if ctx.recorded:
            return
        ctx.recorded = True
        rec = RequestRecord(ctx.method, ctx.path, ctx.query, ctx.status, ctx.started, time.monotonic() - ctx.t0, ctx.source)
        with self._log_lock:
            self._log.append(rec)

    def _authenticate(self, ctx: _Ctx) -> None:
        auth = ctx.headers.get("Authorization")
        if auth is None and ctx.path in ANONYMOUS_PATHS:
            return  # system:public-info-viewer lets anonymous users read health and version
        if auth != f"Bearer {self.token}":
            raise unauthorized()

    def _apply_faults(self, ctx: _Ctx) -> None:
        rule = self.faults.match(ctx.method, ctx.path, urllib.parse.urlsplit(ctx.handler.path).query)
        if rule is None:
            return
        if rule.action == "latency":
            self.faults.hang(rule, self._stopping)  # then served: a slow apiserver, let go early when the rule goes
        elif rule.action == "status":
            ctx.source = "fault"
            code = rule.status or 500
            if code == 429:
                raise too_many_requests()
            if code >= 500:
                raise ApiError(code, "InternalError" if code == 500 else "ServiceUnavailable",
                               "Internal error occurred: lab fault" if code == 500 else "lab fault", {"causes": [{"message": "lab fault"}]})
            # the reason a real apiserver gives with that code (k8s.io/apimachinery/pkg/api/errors)
            reason = {401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Expired",
                      413: "RequestEntityTooLarge", 415: "UnsupportedMediaType", 422: "Invalid"}.get(code, "BadRequest")
            raise ApiError(code, reason, "lab fault")
        elif rule.action == "cut":
            ctx.source, ctx.cut = "fault", True  # answered, then cut in _send
        elif rule.action == "late":
            ctx.late = rule  # served, then held in _send
        elif rule.action == "hang":
            ctx.source = "fault"
            self._record(ctx)  # logged on arrival: a hung request never gets an answer to log it by
            self.faults.hang(rule, self._stopping)
            raise _Dropped()

    def _send(self, ctx: _Ctx, code: int, body: Any, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        h = ctx.handler
        if ctx.late is not None:
            self.faults.hang(ctx.late, self._stopping)
        if ctx.method in ("POST", "PUT", "PATCH") and ctx.body_cache is None:
            try:
                ctx.body()  # drain the request body so the connection stays usable
            except ApiError:
                h.close_connection = True
        h.send_response(code)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Cache-Control", "no-cache, private")
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        ctx.status = code
        self._record(ctx)
        if ctx.cut:
            h.wfile.write(data[:len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            raise _Dropped()
        h.wfile.write(data)

    # --- routing ----------------------------------------------------------------

    def _route(self, ctx: _Ctx) -> None:
        p = ctx.path.rstrip("/") or "/"
        if p in ("/healthz", "/livez", "/readyz"):
            ready = self.cache is not None and self.cache.ready.is_set()
            if p == "/readyz" and not ready:
                self._send(ctx, 500, b"[-]watch-cache not ready\nreadyz check failed\n", content_type="text/plain; charset=utf-8")
            else:
                self._send(ctx, 200, b"ok", content_type="text/plain; charset=utf-8")
            return
        if p == "/version":
            return self._send(ctx, 200, KUBE_VERSION)
        if p == "/openapi/v3":
            return self._send(ctx, 200, openapi.index())
        if p.startswith("/openapi/v3/"):
            doc = openapi.document_bytes(p[len("/openapi/v3/"):])
            if doc is None:
                raise path_not_found()
            return self._send(ctx, 200, doc)
        if p == "/api":
            return self._send(ctx, 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self.ip}:{self.port}"}]})
        if p == "/apis":
            return self._send(ctx, 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [self._group(g) for g in self._groups()]})
        segs = p.strip("/").split("/")
        if segs[0] == "api" and len(segs) >= 2:
            group, version, rest = "", segs[1], segs[2:]
        elif segs[0] == "apis" and len(segs) == 2 and segs[1] in self._groups():
            return self._send(ctx, 200, {"kind": "APIGroup", "apiVersion": "v1", **self._group(segs[1])})
        elif segs[0] == "apis" and len(segs) >= 3:
            group, version, rest = segs[1], segs[2], segs[3:]
        else:
            raise path_not_found()
        if not rest:
            return self._send(ctx, 200, self._resource_list(group, version))
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise path_not_found()
        r = resource_for(group, version, rest[0])
        if r is None or (namespace is not None and not r.namespaced):
            raise path_not_found()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if sub not in (None, "status", "binding") or (sub == "binding" and r.plural != "pods") or (sub == "status" and r.plural not in ("pods", "nodes", "namespaces", "services") and not r.custom):
            raise path_not_found()
        m = ctx.method
        if name is None:
            if m == "GET":
                if _bool(ctx.query, "watch"):
                    return self._watch(ctx, r, namespace)
                return self._list(ctx, r, namespace)
            if m == "POST":
                if r.namespaced and namespace is None:
                    raise method_not_allowed(m)
                body = ctx.json()
                warnings = self._field_validation(ctx, r, body)
                return self._send(ctx, 201, self.registry.create(r, namespace, body), warnings)
            raise method_not_allowed(m)
        if r.namespaced and namespace is None:
            raise path_not_found()
        if sub == "binding":
            if m != "POST":
                raise method_not_allowed(m)
            self.registry.bind(namespace or "", name, ctx.json())
            return self._send(ctx, 201, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201})
        if m == "GET":
            return self._get(ctx, r, namespace, name)
        if m == "PUT":
            body = ctx.json()
            warnings = self._field_validation(ctx, r, body)
            return self._send(ctx, 200, self.registry.update(r, namespace, name, body, status_only=sub == "status"),
                              warnings)
        if m == "PATCH":
            return self._send(ctx, 200, self.registry.patch(r, namespace, name, ctx.headers.get("Content-Type") or "",
                                                            ctx.body(), status_only=sub == "status"))
        if m == "DELETE" and sub is None:
            return self._delete(ctx, r, namespace, name)
        raise method_not_allowed(m)

    def _field_validation(self, ctx: _Ctx, r: Resource, body: Any) -> dict[str, str]:
        """``fieldValidation`` on a create or update (KEP-2885): Strict refuses unknown fields (400),
        Warn answers them in a ``Warning`` header, Ignore (and no directive) keeps quiet. The lab
        checks the top level and ``metadata`` only (guard.lab.api.unknown_fields)."""
        directive = ctx.query.get("fieldValidation", "")
        if directive and directive not in FIELD_VALIDATION_DIRECTIVES:
            raise bad_request(f"fieldValidation: Unsupported value: {directive!r}: supported values: "
                              f"{', '.join(repr(d) for d in FIELD_VALIDATION_DIRECTIVES)}")
        if directive not in ("Strict", "Warn"):
            return {}
        unknown = unknown_fields(r, body)
        if not unknown:
            return {}
        if directive == "Strict":
            what = ", ".join(f'unknown field "{f}"' for f in unknown)
            raise bad_request(f'{r.kind} in version "{r.version}" cannot be handled as a {r.kind}: '
                              f"strict decoding error: {what}")
        return {"Warning": ", ".join(f'299 - "unknown field \\"{f}\\""' for f in unknown)}

    def _groups(self) -> list[str]:
        return sorted({r.group for r in RESOURCES if r.group})

    def _group(self, g: str) -> Obj:
        versions = sorted({r.version for r in RESOURCES if r.group == g})
        vs = [{"groupVersion": f"{g}/{v}", "version": v} for v in versions]
        return {"name": g, "versions": vs, "preferredVersion": vs[0]}

    def _resource_list(self, group: str, version: str) -> Obj:
        rs = [r for r in RESOURCES if (r.group, r.version) == (group, version)]
        if not rs:
            raise path_not_found()
        out = []
        for r in rs:
            entry: Obj = {"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced, "kind": r.kind,
                          "verbs": list(r.verbs)}
            if r.short_names:
                entry["shortNames"] = list(r.short_names)
            if r.categories:
                entry["categories"] = list(r.categories)
            out.append(entry)
            if r.custom:
                out.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": r.namespaced, "kind": r.kind,
                            "verbs": ["get", "patch", "update"]})
            if r.plural == "pods":
                out.append({"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding", "verbs": ["create"]})
            if r.plural in ("pods", "nodes", "namespaces", "services"):
                out.append({"name": f"{r.plural}/status", "singularName": "", "namespaced": r.namespaced, "kind": r.kind,
                            "verbs": ["get", "patch", "update"]})
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": out}

    # --- reads --------------------------------------------------------------------------

    def _ready_cache(self) -> WatchCache:
        cache = self.cache
        if cache is None or not cache.ready.is_set():
            raise too_many_requests("storage is (re)initializing")
        return cache

    def _wait_fresh(self, cache: WatchCache, rv: int) -> None:
        if not cache.wait_for(rv, self.consistent_read_timeout):
            raise ApiError(504, "Timeout", f"Too large resource version: {rv}, current: {cache.rv}",
                           {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                            "retryAfterSeconds": 1})

    def _rv_param(self, ctx: _Ctx, *, listing: bool = False) -> str | None:
        """The resourceVersion parameter, parsed as the real apiserver does (strconv.ParseUint): a LIST answers
        400 BadRequest, a GET and a WATCH 500 without a reason (what v1.36.2 answers; docs/LAB.md)."""
        rv = ctx.query.get("resourceVersion")
        if rv in (None, ""):
            return None
        if not re.fullmatch(r"[0-9]+", rv) or int(rv) >= 2**64:
            why = "invalid syntax" if not re.fullmatch(r"[0-9]+", rv) else "value out of range"
            text = f'resourceVersion: Invalid value: "{rv}": strconv.ParseUint: parsing "{rv}": {why}'
            if listing:
                raise bad_request(f"invalid resource version: {text}")
            raise ApiError(500, "", text)
        return rv

    def _get(self, ctx: _Ctx, r: Resource, namespace: str | None, name: str) -> None:
        rv = self._rv_param(ctx)
        if rv is None:
            ctx.source = "etcd"
            obj = self.registry.get_quorum(r, namespace, name)
        else:
            cache = self._ready_cache()
            ctx.source = "cache"
            if rv != "0":
                self._wait_fresh(cache, int(rv))
            cached, _ = cache.get(r.key(namespace, name))
            if cached is None:
                raise not_found(r, name)
            obj = cached
        if r.printer_columns and wants_table(ctx.headers.get("Accept")):
            return self._send(ctx, 200, table(r, [obj], str(obj["metadata"].get("resourceVersion", "")), time.time()))
        self._send(ctx, 200, output_form(r, obj))

    def _selector(self, ctx: _Ctx, r: Resource, namespace: str | None) -> Selector:
        fields = parse_field_selector(ctx.query.get("fieldSelector"), r)
        fields = [FieldRequirement(output_field(r, f.field), f.op, f.value) for f in fields]
        labels = parse_label_selector(ctx.query.get("labelSelector"))
        return Selector(namespace, tuple(fields), tuple(labels))

    def _list(self, ctx: _Ctx, r: Resource, namespace: str | None) -> None:
        sel = self._selector(ctx, r, namespace)
        rv = self._rv_param(ctx, listing=True)
        limit = _limit_param(ctx.query.get("limit"))
        cont = ctx.query.get("continue") or None
        if cont is not None:
            start, cont_rv = _decode_continue(cont)  # a bad token is named before a resourceVersion beside it
            if rv is not None:
                raise bad_request("specifying resource version is not allowed when using continue")
            return self._list_page(ctx, r, namespace, sel, limit, start, cont_rv)
        if limit and rv != "0":  # a resourceVersion=0 list is served whole from the cache: limit is ignored
            return self._list_first_page(ctx, r, namespace, sel, rv, limit)
        match = _rv_match(ctx, rv)
        if match == "Exact" and rv == "0":
            raise _list_options_invalid("FieldValueForbidden", "Forbidden",
                                       'resourceVersionMatch "exact" is forbidden for resourceVersion "0"')
        if match == "Exact":
            ctx.source = "etcd"
            try:
                items, list_rv = self.registry.list_quorum(r, namespace, int(rv or 0))
            except EtcdUnavailable as e:
                if "compacted" in str(e):
                    raise gone("The resourceVersion for the provided list is too old.") from e
                raise
            items = [o for o in items if sel.matches(o)]
        else:
            cache = self._ready_cache()
            if rv is None:
                target = self._etcd.revision()  # consistent read from cache (cacher.go ConsistentListFromCache)
                if cache.wait_for(target, self.consistent_read_timeout):
                    ctx.source = "cache"
                    items, list_rv = cache.list(r.prefix(namespace), sel.matches)
                else:  # fall back to etcd, as the cacher does when the cache can't catch up in time
                    ctx.source = "etcd"
                    items, list_rv = self.registry.list_quorum(r, namespace)
                    items = [o for o in items if sel.matches(o)]
            else:
                ctx.source = "cache"
                if rv != "0":
                    self._wait_fresh(cache, int(rv))
                items, list_rv = cache.list(r.prefix(namespace), sel.matches)
        self._send_list(ctx, r, items, {"resourceVersion": str(list_rv)})

    def _send_list(self, ctx: _Ctx, r: Resource, items: list[Obj], meta: Obj) -> None:
        """A list (or a page of one) as the client asked: a Table for kubectl (which pages with limit=500),
        else ``<Kind>List`` with each item in its output form (no apiVersion, kind); ``meta`` is its metadata
        (resourceVersion, and a page's continue and remainingItemCount)."""
        if r.printer_columns and wants_table(ctx.headers.get("Accept")):
            doc = table(r, items, meta["resourceVersion"], time.time())
            doc.setdefault("metadata", {}).update(meta)
            return self._send(ctx, 200, doc)
        out_items = []
        for o in items:
            o = output_form(r, o)
            o.pop("apiVersion", None)
            o.pop("kind", None)
            out_items.append(o)
        self._send(ctx, 200, {"kind": f"{r.kind}List", "apiVersion": r.api_version, "metadata": meta, "items": out_items})

    # --- pagination (limit / continue; storage/etcd3 store.go GetList) ---------------------------------

    def _list_first_page(self, ctx: _Ctx, r: Resource, namespace: str | None, sel: Selector, rv: str | None,
                         limit: int) -> None:
        """The first page of a list with ``limit`` (resourceVersion not "0"): read as the unpaged list would
        be (rv "" is a quorum read; resourceVersionMatch=Exact at that revision), then cut at ``limit``."""
        match = _rv_match(ctx, rv)
        if match == "Exact" or rv is None:
            return self._list_page(ctx, r, namespace, sel, limit, "", int(rv or 0))
        cache = self._ready_cache()
        ctx.source = "cache"
        self._wait_fresh(cache, int(rv or 0))
        items, list_rv = cache.list(r.prefix(namespace), lambda o: True)
        self._send_page(ctx, r, namespace, sel, limit, "", items, list_rv)

    def _list_page(self, ctx: _Ctx, r: Resource, namespace: str | None, sel: Selector, limit: int, start: str,
                   revision: int) -> None:
        """A page from etcd at ``revision`` (0: now), from the key ``start`` (relative to the list's prefix)."""
        ctx.source = "etcd"
        try:
            items, list_rv = self.registry.list_quorum(r, namespace, revision)
        except EtcdUnavailable as e:
            if "compacted" in str(e):
                raise gone("The provided continue parameter is too old to display a consistent list result. You "
                           "can start a new list without the continue parameter.") from e
            raise
        self._send_page(ctx, r, namespace, sel, limit, start, items, list_rv)

    def _send_page(self, ctx: _Ctx, r: Resource, namespace: str | None, sel: Selector, limit: int, start: str,
                   items: list[Obj], list_rv: int) -> None:
        prefix = r.prefix(namespace)

        def rel(o: Obj) -> str:
            meta = o.get("metadata") or {}
            return r.key(meta.get("namespace"), meta.get("name", ""))[len(prefix):]

        keyed = sorted(((rel(o), o) for o in items), key=lambda kv: kv[0])
        page: list[Obj] = []
        last, remaining = "", 0
        for k, o in keyed:
            if k < start:
                continue
            if limit and len(page) == limit:
                remaining += 1
                continue
            if sel.matches(o):
                page.append(o)
                last = k
        meta: Obj = {"resourceVersion": str(list_rv)}
        if remaining:
            token = orjson.dumps({"v": "meta.k8s.io/v1", "rv": list_rv, "start": last + "\x00"})
            meta["continue"] = base64.urlsafe_b64encode(token).rstrip(b"=").decode()
            if not sel.fields and not sel.labels:
                meta["remainingItemCount"] = remaining
        self._send_list(ctx, r, page, meta)

    def _watch(self, ctx: _Ctx, r: Resource, namespace: str | None) -> None:
        cache = self._ready_cache()
        ctx.source = "cache"
        sel = self._selector(ctx, r, namespace)
        rv = self._rv_param(ctx)
        timeout = _int(ctx.query, "timeoutSeconds")
        bookmarks = _bool(ctx.query, "allowWatchBookmarks")
        initial_events = _bool(ctx.query, "sendInitialEvents")
        if initial_events and ctx.query.get("resourceVersionMatch") != "NotOlderThan":
            raise ApiError(422, "Invalid", "resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan")
        h = ctx.handler
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Cache-Control", "no-cache, private")
        h.end_headers()
        h.wfile.flush()  # the head at once, as the apiserver's watch handler flushes after WriteHeader
        ctx.status = 200
        self._record(ctx)

        def write(typ: str, obj: Obj) -> None:
            line = orjson.dumps({"type": typ, "object": obj}) + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            h.wfile.flush()
            with self._log_lock:
                self._watch_events[(ctx.path, typ)] += 1

        def end() -> None:
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()

        def out(obj: Obj) -> Obj:
            return output_form(r, obj)

        try:
            start_rv = None if (rv in (None, "0") or initial_events) else int(rv)
            watcher, first = cache.watch(r.prefix(namespace), sel.matches, start_rv)
        except ApiError as e:
            write("ERROR", e.status())  # cacher.go newErrWatcher: a 200 stream carrying the error
            end()
            return
        deadline = time.monotonic() + (timeout if timeout is not None else 1800)
        last_sent = start_rv if start_rv is not None else cache.rv  # the newest resourceVersion this watcher has seen
        # cache_watcher.go process(): only events newer than the watch's resourceVersion (or its last initial
        # event's) are sent. A cache still behind that revision registers the watcher all the same, so
        # events at or below it may still arrive live.
        floor = start_rv
        try:
            for typ, obj in first:
                write(typ, out(obj))
                if start_rv is not None:
                    last_sent = max(last_sent, int(obj["metadata"]["resourceVersion"]))
                    floor = last_sent
            if initial_events:
                write("BOOKMARK", {"kind": r.kind, "apiVersion": r.api_version, "metadata": {
                    "resourceVersion": str(cache.rv), "annotations": {"k8s.io/initial-events-end": "true"}}})
            while not self._stopping.is_set() and not watcher.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                item = watcher.get(min(left, self.bookmark_interval))
                if item is not None:
                    item_rv = int(item[1]["metadata"]["resourceVersion"])
                    if floor is not None and item_rv <= floor:
                        continue
                    write(item[0], out(item[1]))
                    last_sent = max(last_sent, item_rv)
                elif _peer_gone(h.connection):
                    break  # the client hung up: don't hold a watcher until the next event or the timeout
                elif bookmarks and cache.rv > last_sent and not watcher.closed:
                    last_sent = cache.rv
                    write("BOOKMARK", {"kind": r.kind, "apiVersion": r.api_version,
                                       "metadata": {"resourceVersion": str(last_sent)}})
            if not self._stopping.is_set():
                end()
            else:
                h.close_connection = True
        finally:
            cache.forget(watcher)

    # --- deletes -----------------------------------------------------------------

    def _delete(self, ctx: _Ctx, r: Resource, namespace: str | None, name: str) -> None:
        opts = ctx.json() if ctx.body() else {}
        if opts is None:
            opts = {}
        if not isinstance(opts, dict):
            raise bad_request("DeleteOptions must be a JSON object")
        grace = _int(ctx.query, "gracePeriodSeconds")
        if grace is None and opts.get("gracePeriodSeconds") is not None:
            grace = opts["gracePeriodSeconds"]
            if not isinstance(grace, int) or isinstance(grace, bool):
                raise bad_request("gracePeriodSeconds must be an integer")
        pre = opts.get("preconditions") or {}
        if not isinstance(pre, dict) or not all(isinstance(pre.get(k), (str, type(None))) for k in ("uid", "resourceVersion")):
            raise bad_request("preconditions must be an object with string uid and resourceVersion")
        obj, gone_now = self.registry.delete(r, namespace, name, grace, pre.get("uid"), pre.get("resourceVersion"))
        if r.plural == "pods" or not gone_now:
            return self._send(ctx, 200, obj)  # pods: ReturnDeletedObject
        details: Obj = {"name": name, "kind": r.plural, "uid": obj.get("metadata", {}).get("uid", "")}
        if r.group:
            details["group"] = r.group
        self._send(ctx, 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details})

    # --- admin (/lab/...) ------------------------------------------------------------

    def _admin(self, ctx: _Ctx) -> None:
        p = ctx.path.rstrip("/")
        if p == "/lab/faults":
            if ctx.method == "GET":
                return self._send(ctx, 200, self.faults.snapshot())
            if ctx.method == "POST":
                return self._send(ctx, 201, self.faults.apply_json(ctx.json()))
            if ctx.method == "DELETE":
                self.faults.clear()
                return self._send(ctx, 200, self.faults.snapshot())
            raise method_not_allowed(ctx.method)
        if p.startswith("/lab/faults/") and ctx.method == "DELETE":
            try:
                rid = int(p.rsplit("/", 1)[1])
            except ValueError as e:
                raise bad_request("fault id must be an integer") from e
            if not self.faults.remove(rid):
                raise ApiError(404, "NotFound", f"fault {rid} not found", {"name": str(rid), "kind": "faults"})
            return self._send(ctx, 200, self.faults.snapshot())
        if p == "/lab/requests" and ctx.method == "GET":
            return self._send(ctx, 200, {"requests": [r.to_dict() for r in self.requests()],
                                         "watchEvents": self.watch_events()})
        if p == "/lab/cache" and ctx.method == "GET":
            cache = self.cache
            return self._send(ctx, 200, {"resourceVersion": str(cache.rv if cache else 0),
                                         "ready": bool(cache and cache.ready.is_set()),
                                         "objects": cache.size if cache else 0, "relists": cache.relists if cache else 0})
        raise path_not_found()
