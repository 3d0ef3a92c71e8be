"""guard.lab.real.etcdwire: etcd watch responses and stored Kubernetes objects read and edited on the wire.

Round trips through an independent encoder (written here from rpc.proto / kv.proto field numbers,
not etcdwire's own): encode a message, read it, drop events, read it back. Mutants (a wrong field
number, a dropped header) must fail the same checks.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.lab.real import etcdwire as w

# --- an independent encoder (the field numbers of etcd's rpc.proto and kv.proto) ---------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def ld(number: int, data: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(data)) + data


def vi(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value) if value else b""


def kv_bytes(key: bytes, create: int, mod: int, version: int, value: bytes, lease: int = 0) -> bytes:
    # KeyValue: key=1 create_revision=2 mod_revision=3 version=4 value=5 lease=6
    return ld(1, key) + vi(2, create) + vi(3, mod) + vi(4, version) + (ld(5, value) if value else b"") + vi(6, lease)


def event_bytes(typ: int, kv: bytes, prev: bytes | None = None) -> bytes:
    # Event: type=1 kv=2 prev_kv=3
    return vi(1, typ) + ld(2, kv) + (ld(3, prev) if prev is not None else b"")


def response_bytes(revision: int, watch_id: int, evs: list[bytes], *, created: bool = False,
                   cluster_id: int = 14841639068965178418, fragment: bool = False) -> bytes:
    # WatchResponse: header=1 (ResponseHeader: cluster_id=1 member_id=2 revision=3 raft_term=4)
    # watch_id=2 created=3 canceled=4 compact_revision=5 cancel_reason=6 fragment=7 events=11
    header = vi(1, cluster_id) + vi(2, 10276657743932975437) + vi(3, revision) + vi(4, 2)
    return (ld(1, header) + vi(2, watch_id) + vi(3, int(created)) + vi(7, int(fragment))
            + b"".join(ld(11, e) for e in evs))


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-.", min_size=1, max_size=12)
keys = st.builds(lambda ns, name: f"/registry/pods/{ns}/{name}".encode(), _names, _names)
revs = st.integers(min_value=1, max_value=2**62)


@st.composite
def watch_events(draw):
    typ = draw(st.sampled_from([w.PUT, w.DELETE]))
    key = draw(keys)
    mod = draw(revs)
    create = draw(st.one_of(st.just(mod), st.integers(min_value=1, max_value=mod)))
    value = draw(st.binary(max_size=64)) if typ == w.PUT else b""
    prev = draw(st.none() | st.binary(max_size=32))
    raw = event_bytes(typ, kv_bytes(key, create if typ == w.PUT else 0, mod, 1 if typ == w.PUT else 0, value),
                      kv_bytes(key, 1, mod - 1 if mod > 1 else 1, 1, prev) if prev is not None else None)
    return raw, (typ, key, create if typ == w.PUT else 0, mod, value)


@given(st.lists(watch_events(), max_size=8), revs, st.integers(min_value=0, max_value=2**40), st.data())
@settings(max_examples=100, deadline=None)
def test_read_then_drop_events_round_trip(evs, revision, watch_id, data):
    raw = response_bytes(revision, watch_id, [e for e, _ in evs])
    got = w.events(raw)
    assert [(e.type, e.key, e.kv.create_revision, e.kv.mod_revision, e.kv.value) for e in got] == [x for _, x in evs]
    assert w.header_revision(raw) == revision

    drop = data.draw(st.sets(st.integers(min_value=0, max_value=max(len(evs) - 1, 0))) if evs else st.just(set()))
    edited = w.without_events(raw, drop)
    kept = [e for i, e in enumerate(evs) if i not in drop]
    # byte-identical to the response etcd would have sent with only the kept events
    assert edited == response_bytes(revision, watch_id, [e for e, _ in kept])
    assert [(e.type, e.key) for e in w.events(edited)] == [(x[0], x[1]) for _, x in kept]
    assert w.header_revision(edited) == revision


@given(st.lists(watch_events(), max_size=5), revs)
@settings(max_examples=50, deadline=None)
def test_the_module_encoder_agrees_with_the_independent_one(evs, revision):
    raw = response_bytes(revision, 7, [e for e, _ in evs], cluster_id=0)
    parsed = w.events(raw)
    again = w.encode_watch_response(revision=revision, watch_id=7, member_id=10276657743932975437, raft_term=2,
                                    evs=parsed)
    assert w.events(again) == parsed
    assert w.header_revision(again) == revision


def test_a_progress_notification_keeps_its_header_when_every_event_goes():
    raw = response_bytes(42, 3, [event_bytes(w.DELETE, kv_bytes(b"/registry/pods/default/a", 0, 41, 0, b""))])
    edited = w.without_events(raw, [0])
    assert w.events(edited) == []
    assert w.header_revision(edited) == 42
    assert edited == response_bytes(42, 3, [])


def test_negative_int64_and_unknown_fields_survive():
    kv = kv_bytes(b"/registry/pods/a/b", 5, 6, 1, b"v", lease=-1) + vi(15, 9) + varint(16 << 3 | 5) + b"abcd"
    raw = response_bytes(6, 1, [event_bytes(w.PUT, kv)]) + varint(20 << 3 | 1) + b"12345678"
    (ev,) = w.events(raw)
    assert ev.kv.lease == -1 and ev.kv.mod_revision == 6
    assert w.without_events(raw, []) == raw
    assert w.without_events(raw, [0]) == response_bytes(6, 1, []) + varint(20 << 3 | 1) + b"12345678"


@pytest.mark.parametrize("bad", [b"\x0a\x05ab", b"\x80", b"\x5a\x02\x0a", b"\x0b"])
def test_malformed_bytes_raise_wire_error(bad):
    with pytest.raises(w.WireError):
        w.events(bad)


# --- mutants must fail the checks above ---------------------------------------------------------


def test_a_wrong_field_number_is_caught():
    """A reader that took events from field 10 (or kv from field 3) would not see them."""
    raw = response_bytes(9, 1, [event_bytes(w.PUT, kv_bytes(b"/registry/pods/a/b", 9, 9, 1, b"x"))])
    mutant = raw.replace(varint(11 << 3 | 2), varint(10 << 3 | 2))
    assert len(w.events(raw)) == 1
    assert w.events(mutant) == []
    mutant_kv = response_bytes(9, 1, [vi(1, 0) + ld(3, kv_bytes(b"/registry/pods/a/b", 9, 9, 1, b"x"))])
    assert w.events(mutant_kv)[0].key == b""  # prev_kv is not kv


def test_dropping_the_header_is_caught():
    """An edit that lost the header would lose the revision the watch cache advances by."""
    raw = response_bytes(77, 1, [event_bytes(w.DELETE, kv_bytes(b"/registry/pods/a/b", 0, 77, 0, b""))])
    good = w.without_events(raw, [0])
    headerless = b"".join(raw[f.start:f.end] for f in w.fields(raw) if f.number not in (1, 11))
    assert w.header_revision(good) == 77
    assert w.header_revision(headerless) == 0
    assert good != headerless


# --- keys and stored objects -----------------------------------------------------------------


def test_parse_key():
    assert w.parse_key(b"/registry/pods/default/web-0") == ("pods", "default", "web-0")
    assert w.parse_key(b"/registry/minions/node-1") == ("nodes", "", "node-1")
    assert w.parse_key(b"/registry/pods/") is None
    assert w.parse_key(b"/other/pods/a/b") is None
    assert w.parse_key(b"/registry/services/specs/default/kubernetes") is None
    assert w.storage_key("nodes", None, "n1") == "/registry/minions/n1"
    assert w.storage_key("pods", "ns", "p") == "/registry/pods/ns/p"


def pod_protobuf(deletion: bool, *, field: int = 9) -> bytes:
    """A Pod as the apiserver stores it: k8s\\x00 + runtime.Unknown{typeMeta=1, raw=2, contentEncoding=3,
    contentType=4}; raw = Pod{metadata=1 (ObjectMeta: name=1 namespace=3 uid=5 creationTimestamp=8
    deletionTimestamp=9 deletionGracePeriodSeconds=10), spec=2, status=3}."""
    meta = ld(1, b"web-0") + ld(3, b"default") + ld(5, b"0b6c-uid") + ld(8, vi(1, 1_700_000_000))
    if deletion:
        meta += ld(field, vi(1, 1_700_000_030)) + vi(10, 30)
    pod = ld(1, meta) + ld(2, ld(2, b"containers")) + ld(3, ld(1, b"Pending"))
    unknown = ld(1, ld(1, b"v1") + ld(2, b"Pod")) + ld(2, pod) + ld(3, b"") + ld(4, b"")
    return b"k8s\x00" + unknown


def test_deletion_timestamp_in_protobuf():
    meta = w.object_meta(pod_protobuf(True))
    assert meta == w.ObjectMeta("web-0", "default", "0b6c-uid", True)
    assert w.has_deletion_timestamp(pod_protobuf(True))
    assert not w.has_deletion_timestamp(pod_protobuf(False))
    # the timestamp under another field number (annotations = 12) is not a deletionTimestamp
    assert not w.has_deletion_timestamp(pod_protobuf(True, field=12))
    assert w.has_deletion_timestamp(w.encode_stored_object(name="a", deletion_seconds=5))
    assert not w.has_deletion_timestamp(w.encode_stored_object(name="a"))


def test_deletion_timestamp_in_json_and_unreadable_values():
    obj = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n", "uid": "u"}}
    assert w.object_meta(json.dumps(obj).encode()) == w.ObjectMeta("p", "n", "u", False)
    obj["metadata"]["deletionTimestamp"] = "2026-12-02T04:00:00Z"
    assert w.has_deletion_timestamp(json.dumps(obj).encode())
    for value in (b"", b"k8s:enc:aescbc:v1:key1:....", b"k8s\x00\x80", b"{not json", b"[]"):
        assert w.object_meta(value) is None
        assert not w.has_deletion_timestamp(value)


@given(st.text(max_size=20), st.text(max_size=20), st.text(max_size=40), st.none() | st.integers(0, 2**40))
@settings(max_examples=100, deadline=None)
def test_stored_object_round_trip(name, namespace, uid, deletion):
    meta = w.object_meta(w.encode_stored_object(name=name, namespace=namespace, uid=uid, deletion_seconds=deletion))
    assert meta == w.ObjectMeta(name, namespace, uid, deletion is not None)
