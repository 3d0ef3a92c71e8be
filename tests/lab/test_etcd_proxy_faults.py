"""guard.lab.real.etcdproxy on a real etcd: forwarding (status, message, metadata, deadline) and each fault.

A gRPC client speaks raw etcd protobuf (encoded with guard.lab.real.etcdwire's field helpers)
to the proxy and to etcd directly. The apiserver-level proof is tests/real/test_etcd_proxy.py.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading

import pytest

# The proxy's module first: it imports grpc without fork handlers (see its top; the test below).
pytest.importorskip("guard.lab.real.etcdproxy", reason="the etcd proxy needs grpcio (the lab extra)")
import grpc  # noqa: E402

from guard.lab.etcd import Etcd, _die_with_parent  # noqa: E402
from guard.lab.harness import eventually  # noqa: E402
from guard.lab.real import etcdwire as w  # noqa: E402
from guard.lab.real.etcdproxy import EtcdProxy  # noqa: E402


@pytest.fixture(scope="module")
def etcd():
    e = Etcd()
    e.start()
    yield e
    e.close()


@pytest.fixture
def proxy(etcd):
    with EtcdProxy(f"127.0.0.1:{etcd.client_port}") as p:
        yield p


def channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target.removeprefix("http://"))


def put(ch: grpc.Channel, key: str, value: bytes = b"v") -> int:
    """PutRequest{key=1, value=2} → PutResponse.header.revision."""
    resp = ch.unary_unary("/etcdserverpb.KV/Put")(w.encode_field(1, key.encode()) + w.encode_field(2, value),
                                                  timeout=10)
    return header_rev(resp)


def delete(ch: grpc.Channel, key: str) -> int:
    return header_rev(ch.unary_unary("/etcdserverpb.KV/DeleteRange")(w.encode_field(1, key.encode()), timeout=10))


def header_rev(resp: bytes) -> int:
    return w.header_revision(resp)  # every etcd response has header = 1 with revision = 3


class Watcher:
    """One etcd Watch stream on a key prefix: WatchRequest{create_request=1: WatchCreateRequest{key=1,
    range_end=2, prev_kv=6}}; responses collected in ``got``."""

    def __init__(self, ch: grpc.Channel, prefix: str = "/registry/pods/") -> None:
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        create = w.encode_field(1, prefix.encode()) + w.encode_field(2, end.encode()) + w.encode_field(6, 1)
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._requests.put(w.encode_field(1, create))
        self.got: list[bytes] = []
        self.error: grpc.RpcError | None = None
        self.call = ch.stream_stream("/etcdserverpb.Watch/Watch")(self._iter(), metadata=[("hasleader", "true")])
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        eventually(lambda: self.got, 10, what="the watch created")

    def _iter(self):
        while (item := self._requests.get()) is not None:
            yield item

    def _read(self) -> None:
        try:
            for resp in self.call:
                self.got.append(resp)
        except grpc.RpcError as e:
            self.error = e

    def events(self) -> list[tuple[int, bytes, int]]:
        return [(e.type, e.key, e.kv.mod_revision) for r in list(self.got) for e in w.events(r)]

    def revision(self) -> int:
        return max((w.header_revision(r) for r in list(self.got)), default=0)

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


def test_the_lab_forks_its_processes_beside_a_live_proxy(proxy):
    """The lab starts etcd and the apiservers by fork with a preexec_fn (``_die_with_parent``) from a process
    that may hold a live proxy. With grpc's fork support on, grpc's at-fork handler started a poller thread
    in the child that aborted it (SIGABRT) when subprocess closed the inherited descriptors: about 3 % of such
    starts, seen as "etcd exited with -6" in the suite. 300 in a row all start now."""
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "false"
    with channel(proxy.url) as ch:
        put(ch, "/registry/fork-check")  # the proxy's server and its channel to etcd both live
        failed = []
        for _ in range(300):
            p = subprocess.run(["true"], preexec_fn=_die_with_parent, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, timeout=30)
            if p.returncode != 0:
                failed.append((p.returncode, p.stderr[-200:]))
    assert not failed, failed


def test_unary_calls_forward_answers_status_codes_and_messages(etcd, proxy):
    direct, via = channel(etcd.url), channel(proxy.url)
    rev = put(via, "/registry/pods/default/fwd", b"hello")
    rng = w.encode_field(1, b"/registry/pods/default/fwd")
    got_direct = direct.unary_unary("/etcdserverpb.KV/Range")(rng, timeout=10)
    got_via = via.unary_unary("/etcdserverpb.KV/Range")(rng, timeout=10)
    assert header_rev(got_via) >= rev

    def kvs(resp: bytes) -> list[w.KeyValue]:  # RangeResponse.kvs = 2
        return [w.parse_kv(f.value) for f in w.fields(resp) if f.number == 2 and isinstance(f.value, bytes)]

    assert [(kv.key, kv.value) for kv in kvs(got_via)] == [(b"/registry/pods/default/fwd", b"hello")]
    assert kvs(got_via) == kvs(got_direct)
    # etcd's error, code and message (etcd's client maps errors by message), unchanged
    with pytest.raises(grpc.RpcError) as e:
        via.unary_unary("/etcdserverpb.KV/Range")(b"", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "etcdserver: key is not provided"
    # an unknown method: UNIMPLEMENTED from etcd, through the stream path
    with pytest.raises(grpc.RpcError) as e:
        via.unary_unary("/etcdserverpb.Nope/Nothing")(b"", timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_unary_method_answers_a_stream_stream_call(etcd, proxy):
    """What the proxy's stream path relies on: on the wire a unary call is a stream of one message each
    way, so etcd answers a stream-stream call of Range as the unary call (and the proxy's stream-stream
    handler serves unary callers: an unknown method above got etcd's own UNIMPLEMENTED through it)."""
    direct = channel(etcd.url)
    put(direct, "/registry/pods/default/wire", b"w")
    rng = w.encode_field(1, b"/registry/pods/default/wire")
    unary = direct.unary_unary("/etcdserverpb.KV/Range")(rng, timeout=10)
    streamed = list(direct.stream_stream("/etcdserverpb.KV/Range")(iter([rng]), timeout=10))
    assert streamed == [unary]


def test_metadata_and_deadlines_reach_the_upstream():
    """A small upstream that answers with the metadata and deadline it was called with."""
    seen: dict = {}

    def echo(request, context):
        seen["md"] = dict(context.invocation_metadata())
        seen["left"] = context.time_remaining()
        return request

    from concurrent import futures
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                         handlers=[grpc.method_handlers_generic_handler(
                             "etcdserverpb.KV", {"Range": grpc.unary_unary_rpc_method_handler(echo)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with EtcdProxy(f"127.0.0.1:{port}") as p:
            out = channel(p.url).unary_unary("/etcdserverpb.KV/Range")(b"abc", timeout=7,
                                                                         metadata=[("hasleader", "true")])
            assert out == b"abc"
            assert seen["md"]["hasleader"] == "true"
            # the deadline travels as a grpc-timeout header, which gRPC rounds up to its unit at each hop (the
            # client's and the proxy's): a few milliseconds over 7 s, never the upstream's default (none)
            assert 0 < seen["left"] <= 7.1
    finally:
        server.stop(None)


def test_drop_deletes_hides_the_deleting_writes_and_keeps_the_revision(etcd, proxy):
    ch = channel(proxy.url)
    key = "/registry/pods/default/ghost"
    value = w.encode_stored_object(name="ghost", namespace="default", uid="uid-1")
    terminating = w.encode_stored_object(name="ghost", namespace="default", uid="uid-1", deletion_seconds=30)
    watcher = Watcher(ch)
    try:
        proxy.faults.drop_deletes("default", "ghost")
        put(ch, key, value)  # the creation is not a deletion: seen
        put(ch, key, terminating)  # sets deletionTimestamp: dropped
        rev = delete(ch, key)  # dropped
        other = put(ch, "/registry/pods/default/other", w.encode_stored_object(name="other", namespace="default"))
        eventually(lambda: watcher.revision() >= other, 10, what="the watch reached the later write")
        seen = [(t, k) for t, k, _ in watcher.events()]
        assert seen == [(w.PUT, key.encode()), (w.PUT, b"/registry/pods/default/other")]
        # the response that carried only the DELETE still came, emptied: its header revision says rev
        assert rev in [w.header_revision(r) for r in watcher.got if not w.events(r)]
        dropped = [(e.type, e.name, e.uid, e.resource_version) for e in proxy.faults.dropped]
        assert dropped == [("MODIFIED", "ghost", "uid-1", rev - 1), ("DELETED", "ghost", "uid-1", rev)]
        assert proxy.faults.snapshot()["dropDeletes"][0]["dropped"] == 1
    finally:
        watcher.close()


def test_drop_creates_hides_only_the_creation(etcd, proxy):
    ch = channel(proxy.url)
    key = "/registry/pods/default/missing"
    watcher = Watcher(ch)
    try:
        proxy.faults.drop_creates("default", "missing", count=1)
        created = put(ch, key, w.encode_stored_object(name="missing", namespace="default"))
        touched = put(ch, key, w.encode_stored_object(name="missing", namespace="default"))
        eventually(lambda: watcher.revision() >= touched, 10, what="the watch reached the second write")
        assert [(t, r) for t, _, r in watcher.events()] == [(w.PUT, touched)]
        assert [(e.type, e.resource_version) for e in proxy.faults.dropped] == [("ADDED", created)]
        assert proxy.faults.drop_rules() == []  # count spent
    finally:
        watcher.close()


def test_a_frozen_watch_holds_responses_and_forwards_them_in_order(etcd, proxy):
    ch = channel(proxy.url)
    watcher = Watcher(ch)
    direct = Watcher(channel(etcd.url))
    try:
        proxy.faults.freeze_watch()
        assert proxy.faults.watch_frozen
        before = len(watcher.got)
        revs = [put(ch, f"/registry/pods/default/f{i}") for i in range(5)]
        # etcd sent them (a direct watch has them all) while the proxied watch holds them
        eventually(lambda: direct.revision() >= revs[-1], 10, what="the direct watch saw the writes")
        assert len(watcher.got) == before
        assert watcher.error is None
        proxy.faults.unfreeze_watch()
        eventually(lambda: watcher.revision() >= revs[-1], 10, what="the held responses forwarded")
        mods = [r for t, k, r in watcher.events() if k.startswith(b"/registry/pods/default/f")]
        assert mods == revs
    finally:
        watcher.close()
        direct.close()


def test_unreachable_fails_new_calls_and_cuts_open_streams(etcd, proxy):
    ch = channel(proxy.url)
    watcher = Watcher(ch)
    proxy.faults.unreachable()
    eventually(lambda: watcher.error is not None, 10, what="the open watch cut")
    assert watcher.error.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as e:
        put(ch, "/registry/pods/default/u")
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    proxy.faults.reachable()
    assert put(ch, "/registry/pods/default/u") > 0
    proxy.faults.unreachable()
    proxy.faults.clear()  # clear() makes it reachable too
    assert put(ch, "/registry/pods/default/u") > 0


def test_latency_delays_matching_methods_until_removed(etcd, proxy):
    ch = channel(proxy.url)
    rule = proxy.faults.latency(30, r"/etcdserverpb\.KV/Range")
    put(ch, "/registry/pods/default/lat")  # Put does not match: not delayed
    rng = ch.unary_unary("/etcdserverpb.KV/Range")
    with pytest.raises(grpc.RpcError) as e:
        rng(w.encode_field(1, b"/registry/pods/default/lat"), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    future = rng.future(w.encode_field(1, b"/registry/pods/default/lat"), timeout=20)
    assert not future.done()  # held by the rule (30 s), released by its removal
    proxy.faults.remove(rule.id)
    assert header_rev(future.result()) > 0
