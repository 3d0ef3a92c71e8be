"""Read and edit etcd v3 watch responses and stored Kubernetes objects on the protobuf wire (pure: no I/O).

Hand-written for the few fields the fault proxy needs, no generated code and no protobuf
dependency. Field numbers, from etcd's ``api/etcdserverpb/rpc.proto`` and ``api/mvccpb/kv.proto``
(3.5, unchanged on main)::

    message WatchResponse { ResponseHeader header = 1; int64 watch_id = 2; bool created = 3;
                            bool canceled = 4; int64 compact_revision = 5; string cancel_reason = 6;
                            bool fragment = 7; repeated mvccpb.Event events = 11; }
    message ResponseHeader { uint64 cluster_id = 1; uint64 member_id = 2; int64 revision = 3;
                             uint64 raft_term = 4; }
    message Event { EventType type = 1 /* PUT = 0, DELETE = 1 */; KeyValue kv = 2; KeyValue prev_kv = 3; }
    message KeyValue { bytes key = 1; int64 create_revision = 2; int64 mod_revision = 3;
                       int64 version = 4; bytes value = 5; int64 lease = 6; }

A stored Kubernetes object (k8s.io/apiserver storage, the default ``--storage-media-type``
application/vnd.kubernetes.protobuf) is the 4-byte magic ``k8s\\x00`` then a ``runtime.Unknown``
(typeMeta = 1, raw = 2, contentEncoding = 3, contentType = 4) whose ``raw`` is the object; every
object has ``metadata = 1`` (``ObjectMeta``: name = 1, namespace = 3, uid = 5,
deletionTimestamp = 9, from k8s.io/apimachinery ``pkg/apis/meta/v1/generated.proto``). An
apiserver run with ``--storage-media-type=application/json`` stores JSON instead; both are read.
An object encrypted at rest (``k8s:enc:`` prefix) cannot be read: :func:`object_meta` says None.

Editing keeps every byte it does not remove: :func:`without_events` copies the other fields of a
``WatchResponse`` (the header above all: its revision is what lets a watch cache advance past the
events it never saw) exactly as they came.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# wire types
VARINT, I64, LEN, I32 = 0, 1, 2, 5

# WatchResponse
WR_HEADER, WR_WATCH_ID, WR_CREATED, WR_CANCELED, WR_COMPACT_REVISION, WR_CANCEL_REASON, WR_FRAGMENT, WR_EVENTS = (
    1, 2, 3, 4, 5, 6, 7, 11)
# ResponseHeader
HDR_CLUSTER_ID, HDR_MEMBER_ID, HDR_REVISION, HDR_RAFT_TERM = 1, 2, 3, 4
# Event
EV_TYPE, EV_KV, EV_PREV_KV = 1, 2, 3
PUT, DELETE = 0, 1
# KeyValue
KV_KEY, KV_CREATE_REVISION, KV_MOD_REVISION, KV_VERSION, KV_VALUE, KV_LEASE = 1, 2, 3, 4, 5, 6
# runtime.Unknown, an object, ObjectMeta
UNKNOWN_RAW = 2
OBJ_METADATA = 1
META_NAME, META_NAMESPACE, META_UID, META_DELETION_TIMESTAMP = 1, 3, 5, 9

K8S_MAGIC = b"k8s\x00"


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


# --- the wire -----------------------------------------------------------------

def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the unsigned varint at ``pos``."""
    result = shift = 0
    n = len(buf)
    while True:
        if pos >= n:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint too long")


def as_int64(value: int) -> int:
    """A varint read as protobuf int64 (two's complement on 64 bits)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class Field:
    number: int
    wire_type: int
    value: int | bytes  # the varint (unsigned), or the bytes of a LEN / I64 / I32 field
    start: int  # the field's span in the message, tag included
    end: int


def fields(buf: bytes) -> Iterator[Field]:
    """Every field of a message, in wire order (WireError on malformed bytes)."""
    pos, n = 0, len(buf)
    while pos < n:
        start = pos
        tag, pos = read_varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise WireError("field number 0")
        value: int | bytes
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos)
        elif wire_type == LEN:
            length, pos = read_varint(buf, pos)
            if pos + length > n:
                raise WireError("truncated length-delimited field")
            value, pos = buf[pos:pos + length], pos + length
        elif wire_type == I64:
            if pos + 8 > n:
                raise WireError("truncated fixed64")
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire_type == I32:
            if pos + 4 > n:
                raise WireError("truncated fixed32")
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        yield Field(number, wire_type, value, start, pos)


def encode_varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_field(number: int, value: int | bytes) -> bytes:
    """One field: an int as a varint, bytes as length-delimited."""
    if isinstance(value, bytes):
        return encode_varint(number << 3 | LEN) + encode_varint(len(value)) + value
    return encode_varint(number << 3 | VARINT) + encode_varint(value)


# --- etcd messages ------------------------------------------------------------

@dataclass(frozen=True)
class KeyValue:
    key: bytes = b""
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    value: bytes = b""
    lease: int = 0

    def encode(self) -> bytes:
        """proto3 encoding (zero values left out, as Go's marshaller does)."""
        out = b""
        for number, v in ((KV_KEY, self.key), (KV_CREATE_REVISION, self.create_revision),
                          (KV_MOD_REVISION, self.mod_revision), (KV_VERSION, self.version),
                          (KV_VALUE, self.value), (KV_LEASE, self.lease)):
            if v:
                out += encode_field(number, v)
        return out


def parse_kv(buf: bytes) -> KeyValue:
    key = value = b""
    create = mod = version = lease = 0
    for f in fields(buf):
        if f.number == KV_KEY and isinstance(f.value, bytes):
            key = f.value
        elif f.number == KV_VALUE and isinstance(f.value, bytes):
            value = f.value
        elif isinstance(f.value, int):
            if f.number == KV_CREATE_REVISION:
                create = as_int64(f.value)
            elif f.number == KV_MOD_REVISION:
                mod = as_int64(f.value)
            elif f.number == KV_VERSION:
                version = as_int64(f.value)
            elif f.number == KV_LEASE:
                lease = as_int64(f.value)
    return KeyValue(key, create, mod, version, value, lease)


@dataclass(frozen=True)
class Event:
    type: int  # PUT or DELETE
    kv: KeyValue
    prev_kv: KeyValue | None = None

    @property
    def key(self) -> bytes:
        return self.kv.key

    @property
    def created(self) -> bool:
        """The PUT that created the key (k8s.io/apiserver storage/etcd3 makes it an ADDED)."""
        return self.type == PUT and self.kv.create_revision == self.kv.mod_revision

    def encode(self) -> bytes:
        out = encode_field(EV_TYPE, self.type) if self.type else b""
        out += encode_field(EV_KV, self.kv.encode())
        if self.prev_kv is not None:
            out += encode_field(EV_PREV_KV, self.prev_kv.encode())
        return out


def parse_event(buf: bytes) -> Event:
    typ = 0
    kv = KeyValue()
    prev: KeyValue | None = None
    for f in fields(buf):
        if f.number == EV_TYPE and isinstance(f.value, int):
            typ = f.value
        elif f.number == EV_KV and isinstance(f.value, bytes):
            kv = parse_kv(f.value)
        elif f.number == EV_PREV_KV and isinstance(f.value, bytes):
            prev = parse_kv(f.value)
    return Event(typ, kv, prev)


def events(response: bytes) -> list[Event]:
    """The events of a ``WatchResponse``, in order."""
    return [parse_event(f.value) for f in fields(response)
            if f.number == WR_EVENTS and isinstance(f.value, bytes)]


def header_revision(response: bytes) -> int:
    """``header.revision`` of a ``WatchResponse`` (0 when absent)."""
    for f in fields(response):
        if f.number == WR_HEADER and isinstance(f.value, bytes):
            for h in fields(f.value):
                if h.number == HDR_REVISION and isinstance(h.value, int):
                    return as_int64(h.value)
    return 0


def without_events(response: bytes, drop: Iterable[int]) -> bytes:
    """The ``WatchResponse`` without the events at the indexes ``drop`` (positions in :func:`events`);
    every other byte (the header, watch_id, flags, the other events) kept as it was."""
    dropped = set(drop)
    if not dropped:
        return response
    out = bytearray()
    i = 0
    for f in fields(response):
        if f.number == WR_EVENTS and f.wire_type == LEN:
            keep = i not in dropped
            i += 1
            if not keep:
                continue
        out += response[f.start:f.end]
    return bytes(out)


def encode_watch_response(*, revision: int = 0, watch_id: int = 0, created: bool = False, canceled: bool = False,
                          compact_revision: int = 0, cancel_reason: str = "", fragment: bool = False,
                          evs: Iterable[Event] = (), cluster_id: int = 0, member_id: int = 0,
                          raft_term: int = 0) -> bytes:
    """A ``WatchResponse`` as etcd encodes it (fields in number order, zero values left out)."""
    header = b"".join(encode_field(n, v) for n, v in ((HDR_CLUSTER_ID, cluster_id), (HDR_MEMBER_ID, member_id),
                                                       (HDR_REVISION, revision), (HDR_RAFT_TERM, raft_term)) if v)
    out = encode_field(WR_HEADER, header)
    for number, v in ((WR_WATCH_ID, watch_id), (WR_CREATED, int(created)), (WR_CANCELED, int(canceled)),
                      (WR_COMPACT_REVISION, compact_revision), (WR_CANCEL_REASON, cancel_reason.encode()),
                      (WR_FRAGMENT, int(fragment))):
        if v:
            out += encode_field(number, v)
    for ev in evs:
        out += encode_field(WR_EVENTS, ev.encode())
    return out


# --- keys and stored objects --------------------------------------------------

def parse_key(key: bytes, prefix: str = "/registry") -> tuple[str, str, str] | None:
    """(resource, namespace, name) of a storage key: ``/registry/pods/NS/NAME`` → ("pods", NS, NAME),
    ``/registry/minions/NAME`` → ("nodes", "", NAME); None for other keys."""
    try:
        text = key.decode()
    except UnicodeDecodeError:
        return None
    if not text.startswith(prefix + "/"):
        return None
    parts = text[len(prefix) + 1:].split("/")
    if len(parts) == 3:
        resource, namespace, name = parts
    elif len(parts) == 2:
        resource, name = parts
        namespace = ""
    else:
        return None
    if not resource or not name:
        return None
    return ("nodes" if resource == "minions" else resource), namespace, name


def storage_key(resource: str, namespace: str | None, name: str, prefix: str = "/registry") -> str:
    """The etcd key the apiserver stores an object under (nodes are ``minions``)."""
    resource = "minions" if resource == "nodes" else resource
    return f"{prefix}/{resource}/{namespace}/{name}" if namespace else f"{prefix}/{resource}/{name}"


@dataclass(frozen=True)
class ObjectMeta:
    name: str
    namespace: str
    uid: str
    deleting: bool  # metadata.deletionTimestamp is set


def _len_field(buf: bytes, number: int) -> bytes | None:
    found = None
    for f in fields(buf):
        if f.number == number and isinstance(f.value, bytes):
            found = f.value  # the last one wins, as in protobuf
    return found


def object_meta(value: bytes) -> ObjectMeta | None:
    """The metadata of a stored Kubernetes object (protobuf with the ``k8s\\x00`` envelope, or JSON);
    None when the value is neither (empty, encrypted, malformed)."""
    if value.startswith(K8S_MAGIC):
        try:
            raw = _len_field(value[len(K8S_MAGIC):], UNKNOWN_RAW)
            meta = _len_field(raw, OBJ_METADATA) if raw is not None else None
            if meta is None:
                return None
            name = namespace = uid = ""
            deleting = False
            for f in fields(meta):
                if isinstance(f.value, bytes):
                    if f.number == META_NAME:
                        name = f.value.decode(errors="replace")
                    elif f.number == META_NAMESPACE:
                        namespace = f.value.decode(errors="replace")
                    elif f.number == META_UID:
                        uid = f.value.decode(errors="replace")
                    elif f.number == META_DELETION_TIMESTAMP:
                        deleting = True
            return ObjectMeta(name, namespace, uid, deleting)
        except WireError:
            return None
    if value[:1] == b"{":
        try:
            obj = json.loads(value)
        except ValueError:
            return None
        meta_json = obj.get("metadata") if isinstance(obj, dict) else None
        if not isinstance(meta_json, dict):
            return None
        return ObjectMeta(str(meta_json.get("name") or ""), str(meta_json.get("namespace") or ""),
                          str(meta_json.get("uid") or ""), bool(meta_json.get("deletionTimestamp")))
    return None


def has_deletion_timestamp(value: bytes) -> bool:
    """A stored object whose ``metadata.deletionTimestamp`` is set."""
    meta = object_meta(value)
    return meta is not None and meta.deleting


def encode_stored_object(*, name: str = "", namespace: str = "", uid: str = "", deletion_seconds: int | None = None,
                         kind: str = "Pod", api_version: str = "v1", spec: bytes = b"") -> bytes:
    """A stored object as the apiserver writes it in protobuf (for tests): ``k8s\\x00`` + runtime.Unknown."""
    meta = b"".join(encode_field(n, v.encode()) for n, v in ((META_NAME, name), (META_NAMESPACE, namespace),
                                                             (META_UID, uid)) if v)
    meta += encode_field(8, encode_field(1, 1_700_000_000))  # creationTimestamp
    if deletion_seconds is not None:
        meta += encode_field(META_DELETION_TIMESTAMP, encode_field(1, deletion_seconds) if deletion_seconds else b"")
    obj = encode_field(OBJ_METADATA, meta) + (encode_field(2, spec) if spec else b"")
    type_meta = encode_field(1, api_version.encode()) + encode_field(2, kind.encode())
    unknown = encode_field(1, type_meta) + encode_field(UNKNOWN_RAW, obj) + encode_field(4, b"")
    return K8S_MAGIC + unknown
