"""A gRPC proxy in front of etcd, one per real kube-apiserver replica: the real backend's fault injector.

The replica is started with ``--etcd-servers`` = :attr:`EtcdProxy.url`. Every etcd method is
forwarded as raw bytes (no protobuf decoding) with its metadata (etcd's client sends e.g.
``hasleader`` on watches), deadline, cancellation, status code and message (the etcd client maps
errors by their message). Only ``etcdserverpb.Watch/Watch`` responses are looked at, and only
while a drop rule or a freeze asks for it; :attr:`EtcdProxy.faults` (:class:`ProxyFaults`) has the
Python lab's fault vocabulary (``guard.lab.faults.Faults``), meaning the same thing:

- ``drop_deletes(ns, name)``: the replica's watch cache never sees the PUT that sets
  ``metadata.deletionTimestamp`` nor the DELETE of matching keys (the incident). The rest of the
  response, its header above all, goes on: the client sees a response emptied of events as a
  progress notification at the header's revision (etcd client ``WatchResponse.IsProgressNotify``;
  k8s.io/apiserver storage/etcd3 ``watcher.go`` turns it into a progress event), so the cache's
  resourceVersion advances past the lost events, as in the incident.
- ``drop_creates(ns, name)``: the PUT that created the key (create_revision == mod_revision)
  is dropped; a later write to the key reaches the cache (see ``guard.lab.faults.DropRule``).
- ``freeze_watch()`` / ``unfreeze_watch()``: every Watch response is held (the streams stay open,
  etcd's side is still read so etcd never sees a slow watcher), and forwarded in order on unfreeze.
- ``latency(seconds, method_regex)`` (and ``add("hang", path=regex)``): forwarded calls whose gRPC
  method (``/etcdserverpb.KV/Range``) fully matches wait first; removing the rule lets them go.
- ``unreachable()`` / ``reachable()``: new calls fail with UNAVAILABLE at once and open streams are
  cut with UNAVAILABLE (what a dead etcd connection looks like to the apiserver's client).

Rules apply to what is forwarded from the moment they exist; a watch opened later reads etcd's
history through the proxy too, so a replayed event meets the same rules.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

# Before grpc is first imported: no fork handlers. The lab forks etcd and the apiservers with a preexec_fn
# (PR_SET_PDEATHSIG), so fork() runs grpc's pthread_atfork handlers. With fork support on, the child's handler
# restarts an epoll poller thread, which then aborts the child (SIGABRT, "Epoll1Poller ... epoll_wait error: Bad
# file descriptor") when subprocess closes the inherited descriptors before exec: 9 of 300 such starts failed
# beside a live proxy, 0 of 1,200 without fork support. No child of the lab uses gRPC from Python.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402

from guard.lab.faults import DroppedEvent, FaultError, FaultRule, Faults
from guard.lab.real import etcdwire

WATCH = "/etcdserverpb.Watch/Watch"
# etcd's streaming methods (rpc.proto, v3election.proto, grpc health); every other method of a known
# service is unary. A method of an unknown service goes through the stream-stream path, which carries
# any cardinality: on the wire a unary call is a stream of one message each way.
STREAMING = frozenset({WATCH, "/etcdserverpb.Lease/LeaseKeepAlive", "/etcdserverpb.Maintenance/Snapshot",
                       "/v3electionpb.Election/Observe", "/grpc.health.v1.Health/Watch"})
KNOWN_SERVICES = frozenset({"etcdserverpb.KV", "etcdserverpb.Watch", "etcdserverpb.Lease", "etcdserverpb.Cluster",
                            "etcdserverpb.Maintenance", "etcdserverpb.Auth", "v3lockpb.Lock", "v3electionpb.Election",
                            "grpc.health.v1.Health"})
# headers gRPC itself sets on the wire; the rest of a call's metadata is forwarded
_RESERVED = ("user-agent", "te", "content-type", "grpc-", ":")
_UNLIMITED = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_SERVER_OPTIONS = _UNLIMITED + [
    ("grpc.so_reuseport", 0),  # never share a port with another listener
    # etcd's Go client pings (keepalive); a strict server would answer with GOAWAY "too many pings"
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


def _forwardable(metadata: Any) -> tuple[tuple[str, Any], ...]:
    return tuple((k, v) for k, v in (metadata or ()) if not k.startswith(_RESERVED))


class ProxyFaults(Faults):
    """``guard.lab.faults.Faults`` for one replica's etcd traffic (thread-safe).

    Request faults are ``latency`` and ``hang`` on gRPC methods (``path`` is a regex over the
    method, e.g. ``/etcdserverpb.KV/Range``); ``status`` has no gRPC meaning here."""

    def __init__(self) -> None:
        super().__init__()
        self._unreachable = False
        self._wakers: set[Callable[[], None]] = set()

    def add(self, action: str, *, method: str | None = None, path: str | None = None, status: int | None = None,
            seconds: float | None = None, count: int | None = None, query: str | None = None) -> FaultRule:
        if action not in ("latency", "hang"):
            raise FaultError("the etcd proxy's request faults are latency and hang (use unreachable() to fail calls)")
        if method is not None or query is not None or status is not None:
            raise FaultError("an etcd call has no HTTP method, query or status: use path (a gRPC method regex)")
        return super().add(action, path=path, seconds=seconds, count=count)

    def latency(self, seconds: float, method_regex: str | None = None, *, count: int | None = None) -> FaultRule:
        """Delay forwarded calls (stream calls: their opening) whose gRPC method fully matches ``method_regex``
        (all when None) by ``seconds``, or until the rule is removed or the faults cleared."""
        return self.add("latency", path=method_regex, seconds=seconds, count=count)

    def unreachable(self) -> None:
        """This replica loses etcd: new calls fail with UNAVAILABLE, open streams are cut."""
        with self._lock:
            self._unreachable = True
            self._generation += 1
            self._lock.notify_all()
        self._wake()

    def reachable(self) -> None:
        with self._lock:
            self._unreachable = False

    @property
    def is_unreachable(self) -> bool:
        return self._unreachable

    def unfreeze_watch(self) -> None:
        super().unfreeze_watch()
        self._wake()

    def clear(self) -> None:
        """Remove every rule, unfreeze the watch, make etcd reachable, release delayed calls."""
        with self._lock:
            self._unreachable = False
        super().clear()
        self._wake()

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        snap["unreachable"] = self._unreachable
        return snap

    # --- for the proxy --------------------------------------------------------

    def _subscribe(self, waker: Callable[[], None]) -> None:
        with self._lock:
            self._wakers.add(waker)

    def _unsubscribe(self, waker: Callable[[], None]) -> None:
        with self._lock:
            self._wakers.discard(waker)

    def _wake(self) -> None:
        with self._lock:
            wakers = list(self._wakers)
        for w in wakers:
            w()

    def _has_drops(self) -> bool:
        return bool(self._drops)

    def _filter(self, response: bytes) -> bytes:
        """The Watch response this replica is let see (drop rules applied)."""
        if not self._drops:
            return response
        try:
            evs = etcdwire.events(response)
        except etcdwire.WireError:
            return response
        drop: list[int] = []
        rules = self.drop_rules()
        for i, ev in enumerate(evs):
            where = etcdwire.parse_key(ev.key)
            if where is None or not any(r.matches(*where) for r in rules):
                continue
            resource, namespace, name = where
            kind = "DELETED" if ev.type == etcdwire.DELETE else ("ADDED" if ev.created else "MODIFIED")
            meta = etcdwire.object_meta(ev.kv.value) if ev.type == etcdwire.PUT else None
            prev = etcdwire.object_meta(ev.prev_kv.value) if ev.prev_kv is not None and ev.prev_kv.value else None
            if self.should_drop(kind, resource, namespace, name, meta is not None and meta.deleting,
                                prev is not None and prev.deleting, created=ev.created):
                known = meta or prev
                uid = known.uid if known is not None else ""
                self.record_drop(DroppedEvent(kind, resource, namespace, name, uid, ev.kv.mod_revision))
                drop.append(i)
        return etcdwire.without_events(response, drop) if drop else response


class _Stream:
    """One open Watch stream: etcd's responses read by a thread into ``held``, sent on by the handler."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.held: collections.deque[bytes] = collections.deque()
        self.done = False
        self.error: grpc.RpcError | None = None

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


class EtcdProxy:
    """``EtcdProxy(upstream="127.0.0.1:2379").start()``; ``.url`` for ``--etcd-servers``; ``.close()``."""

    def __init__(self, upstream: str = "127.0.0.1:2379", host: str = "127.0.0.1", port: int = 0, *,
                 max_workers: int = 512) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.host = host
        self.port = port
        self.max_workers = max_workers
        self.faults = ProxyFaults()
        self._server: grpc.Server | None = None
        self._channel: grpc.Channel | None = None
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        self._calls: set[Any] = set()  # open upstream stream calls (cut by unreachable())
        self._calls_lock = threading.Lock()
        self._stopping = threading.Event()
        self.faults._subscribe(self._on_fault_change)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> EtcdProxy:
        if self._server is not None:
            return self
        self._stopping.clear()
        self._channel = grpc.insecure_channel(self.upstream, options=_UNLIMITED)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="etcdproxy"),
                             handlers=[_Generic(self)], options=_SERVER_OPTIONS)
        port = server.add_insecure_port(f"{self.host}:{self.port}")
        if not port:
            raise OSError(f"etcd proxy: cannot listen on {self.host}:{self.port}")
        self.port = port
        server.start()
        self._server = server
        return self

    def close(self) -> None:
        self._stopping.set()
        server, self._server = self._server, None
        if server is not None:
            server.stop(grace=None).wait(5)
        self._cut_all()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._handlers.clear()

    def __enter__(self) -> EtcdProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- forwarding -----------------------------------------------------------

    def _handler(self, method: str) -> grpc.RpcMethodHandler:
        h = self._handlers.get(method)
        if h is None:
            service = method.lstrip("/").split("/", 1)[0]
            assert self._channel is not None
            if method == WATCH:
                up = self._channel.stream_stream(method)
                h = grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._watch(up, it, ctx))
            elif method in STREAMING or service not in KNOWN_SERVICES:
                up = self._channel.stream_stream(method)
                h = grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._stream(method, up, it, ctx))
            else:
                up1 = self._channel.unary_unary(method)
                h = grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._unary(method, up1, req, ctx))
            self._handlers[method] = h
        return h

    def _before_call(self, method: str, context: grpc.ServicerContext) -> None:
        faults = self.faults
        if faults._unreachable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "etcd proxy: unreachable (lab fault)")
        if faults._rules:
            rule = faults.match("POST", method)
            if rule is not None:
                faults.hang(rule, self._stopping)
                if rule.action == "hang" or faults._unreachable:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "etcd proxy: hung call released (lab fault)")

    def _unary(self, method: str, upstream: Any, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._before_call(method, context)
        future = upstream.future(request, timeout=_timeout(context),
                                 metadata=_forwardable(context.invocation_metadata()))
        context.add_callback(future.cancel)
        try:
            response: bytes = future.result()
        except grpc.FutureCancelledError:  # the caller went away (context callback above)
            context.abort(grpc.StatusCode.CANCELLED, "etcd proxy: call cancelled")
        except grpc.RpcError as e:
            _abort_like(context, e)
        trailing = future.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(_forwardable(trailing))
        return response

    def _open(self, method: str, upstream: Any, requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        self._before_call(method, context)
        call = upstream(_quietly(requests), timeout=_timeout(context),
                        metadata=_forwardable(context.invocation_metadata()))
        context.add_callback(call.cancel)
        with self._calls_lock:
            self._calls.add(call)
        if self.faults._unreachable:  # went unreachable while we opened it
            call.cancel()
        return call

    def _close_call(self, call: Any) -> None:
        with self._calls_lock:
            self._calls.discard(call)
        call.cancel()

    def _stream(self, method: str, upstream: Any, requests: Iterator[bytes],
                context: grpc.ServicerContext) -> Iterator[bytes]:
        call = self._open(method, upstream, requests, context)
        try:
            yield from call
        except grpc.RpcError as e:
            self._end(context, e)
        finally:
            self._close_call(call)

    def _watch(self, upstream: Any, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        call = self._open(WATCH, upstream, requests, context)
        stream = _Stream()
        faults = self.faults
        faults._subscribe(stream.wake)

        def read() -> None:
            try:
                for response in call:
                    with stream.cond:
                        stream.held.append(response)
                        stream.cond.notify_all()
            except grpc.RpcError as e:
                stream.error = e
            finally:
                with stream.cond:
                    stream.done = True
                    stream.cond.notify_all()

        reader = threading.Thread(target=read, name="etcdproxy-watch", daemon=True)
        reader.start()
        try:
            while True:
                with stream.cond:
                    while True:
                        if faults._unreachable or self._stopping.is_set():
                            break
                        if stream.held and not faults._frozen:
                            break
                        if stream.done and not stream.held:
                            break
                        if not context.is_active():
                            return
                        stream.cond.wait(1.0)
                    if faults._unreachable or self._stopping.is_set():
                        context.abort(grpc.StatusCode.UNAVAILABLE, "etcd proxy: unreachable (lab fault)")
                    if not stream.held:  # done
                        break
                    batch = list(stream.held)
                    stream.held.clear()
                for response in batch:
                    yield faults._filter(response)
            if stream.error is not None:
                self._end(context, stream.error)
        finally:
            faults._unsubscribe(stream.wake)
            self._close_call(call)

    def _end(self, context: grpc.ServicerContext, e: grpc.RpcError) -> None:
        if self.faults._unreachable or self._stopping.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "etcd proxy: unreachable (lab fault)")
        _abort_like(context, e)

    # --- faults ---------------------------------------------------------------

    def _on_fault_change(self) -> None:
        if self.faults._unreachable:
            self._cut_all()

    def _cut_all(self) -> None:
        with self._calls_lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()


def _quietly(requests: Iterator[bytes]) -> Iterator[bytes]:
    """The caller's request stream, ending (instead of raising) when the caller's call ends."""
    try:
        yield from requests
    except grpc.RpcError:
        return


def _timeout(context: grpc.ServicerContext) -> float | None:
    """The caller's deadline as a timeout for the upstream call; None without one (grpc reports a huge value)."""
    left = context.time_remaining()
    return None if left is None or left > 1e8 else left


def _abort_like(context: grpc.ServicerContext, e: grpc.RpcError) -> None:
    """End the proxied call as etcd ended the upstream one (status code, message, trailing metadata)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    if trailing:
        context.set_trailing_metadata(_forwardable(trailing))
    context.abort(code, details or "")


class _Generic(grpc.GenericRpcHandler):
    def __init__(self, proxy: EtcdProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        return self._proxy._handler(method)


__all__ = ["EtcdProxy", "ProxyFaults", "STREAMING", "WATCH"]
