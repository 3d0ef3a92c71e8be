"""A replica's listing of unscheduled pods, read one pod at a time as it arrives (pure: bytes in, lean dicts out).

The guard lists every replica's cache of unscheduled pods every few seconds (guard/engine/prepare.py,
the missing-pod checks): with a backlog of 10,000 pending pods a listing is ~16 MB of JSON, and
decoding it whole builds ~60 MB more of Python objects per replica (every field of every pod:
managedFields, containers, status), three replicas at once (issue 29). The guard needs six fields
of each pod.

So the items are split at kube-apiserver's item boundaries (Go's encoding/json writes a PodList as
``{"kind":...,"metadata":{...},"items":[{"metadata":{...},...},{"metadata":{...},...}]}``, no
whitespace) and decoded one at a time, each reduced to :data:`KEPT_METADATA` and ``spec.nodeName``
at once, **as the body's pieces arrive** (:func:`read_pod_list_stream`): the peak is one piece of the
body plus one pod, never the body. The separator ``},{"metadata":{`` holds raw quotes, so it is never
inside a JSON string; one found inside a pod (a nested list of objects whose first key is
``metadata``) leaves a piece with an unclosed container, which does not decode, and the piece grows
to the next separator. A piece is decoded as one value, else as the comma-separated values it holds
(wrapped in ``[...]``: several pods where one does not begin with ``metadata``). Every byte of the
items is in a decoded piece or is the comma between two, and the head and the closing ``]}`` are
checked, so a listing read this way is valid JSON, read as decoding it whole reads it.

What this cannot split: any other shape (whitespace, ``items`` before ``metadata``, keys after
``items``), a piece that still does not decode after :data:`MAX_TRIES` separators, or a piece over
:data:`MAX_ITEM_BYTES`. Met before the first pod was read (so nothing was dropped), the body is
read to its end and decoded whole (the old way; that also gives the error of a bad body): the
answer is what decoding the whole body gives, reduced. Met later, the stream raises ``ValueError``
(the listing fails, the replica's view says so); kube-apiserver does not write such bodies.
:func:`read_pod_list` (a whole body in hand) always falls back to decoding it whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import orjson

# What the guard reads of a listed pod: its identity, its age (kube-scheduler's order), whether it
# is terminating, and (from spec) whether it is bound (guard.core.verdict.is_pending).
KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp", "deletionTimestamp")

_ITEMS = b',"items":['
_SEP = b'},{"metadata":{'
_CLOSE = b"]}"
_SPACE = b" \t\r\n"

MAX_HEAD_BYTES = 64 * 1024  # the list's kind, apiVersion and metadata before its items
MAX_ITEM_BYTES = 8 * 1024 * 1024  # one pod's JSON (etcd stores objects of up to 1.5 MiB by default)
MAX_TRIES = 64  # separators inside one pod before the listing is not split


class NotSplit(ValueError):
    """The listing is not kube-apiserver's shape (or is not JSON): decode it whole if it is in hand."""


def lean(obj: Any) -> dict[str, Any]:
    """The fields of a pod object the guard's listings use; anything not a pod object gives ``{}``."""
    if not isinstance(obj, dict):
        return {}
    out: dict[str, Any] = {}
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        out["metadata"] = {k: meta[k] for k in KEPT_METADATA if k in meta}
    spec = obj.get("spec")
    if isinstance(spec, dict) and "nodeName" in spec:
        out["spec"] = {"nodeName": spec["nodeName"]}
    return out


def read_pod_list(body: bytes) -> tuple[str, list[dict[str, Any]]]:
    """(the list's resourceVersion, its items reduced by :func:`lean`) of a PodList's JSON body, the
    same as decoding it whole and reducing; raises ``ValueError`` (``orjson.JSONDecodeError``) for
    a body that is not JSON."""
    try:
        return _Splitter((body,), keep=False).read()
    except NotSplit:
        return _whole(body)


def read_pod_list_stream(pieces: Iterable[bytes]) -> tuple[str, list[dict[str, Any]]]:
    """:func:`read_pod_list` of the body whose pieces (any sizes, cut anywhere) ``pieces`` yields,
    without ever holding the whole body (but for a body kube-apiserver does not write, see the
    module's docstring). Raises ``ValueError`` for a body that is not JSON, and for one that stops
    being splittable after its first pod."""
    reader = _Splitter(pieces, keep=True)
    try:
        return reader.read()
    except NotSplit:
        if reader.kept is None:
            raise ValueError("a pod listing kube-apiserver would not write: not split past its first pod") from None
        return _whole(b"".join([*reader.kept, *reader.pieces]))


class _Splitter:
    """One listing read from its pieces: ``buf`` holds what is not read yet (from ``at``), ``kept``
    every piece until the first pod is read (``None`` after: the body can no longer be decoded whole)."""

    def __init__(self, pieces: Iterable[bytes], *, keep: bool) -> None:
        self.pieces: Iterator[bytes] = iter(pieces)
        self.kept: list[bytes] | None = [] if keep else None
        self.buf = b""
        self.at = 0
        self.eof = False

    def more(self) -> None:
        """The next piece appended to ``buf``, what was read before ``at`` dropped (``at`` becomes 0)."""
        piece = next(self.pieces, None)
        if piece is None:
            self.eof = True
            return
        if self.kept is not None:
            self.kept.append(piece)
        self.buf = self.buf[self.at:] + piece if self.at else self.buf + piece
        self.at = 0

    def read(self) -> tuple[str, list[dict[str, Any]]]:
        while (found := self.buf.find(_ITEMS)) < 0:
            if self.eof or len(self.buf) > MAX_HEAD_BYTES:
                raise NotSplit("no items")
            self.more()
        try:
            head = orjson.loads(self.buf[:found] + b"}")
        except orjson.JSONDecodeError:
            raise NotSplit("head") from None
        if not isinstance(head, dict):
            raise NotSplit("head")
        self.at = found + len(_ITEMS)
        items: list[dict[str, Any]] = []
        while self.piece(items):
            pass
        return _rv(head), items

    def piece(self, items: list[dict[str, Any]]) -> bool:
        """Read the pods from ``at`` to the next item boundary into ``items``: True when more follow,
        False at the list's end. A piece is one pod or more (where a pod does not begin with
        ``{"metadata":{``), or the start of one (a separator inside a pod): then it grows to the next."""
        scan, tries = self.at + 1, 0
        while True:
            nxt = self.buf.find(_SEP, scan)
            if nxt < 0:
                if not self.eof:
                    if len(self.buf) - self.at > MAX_ITEM_BYTES:
                        raise NotSplit(f"a pod over {MAX_ITEM_BYTES} bytes")
                    scan = max(self.at + 1, len(self.buf) - len(_SEP) + 1) - self.at
                    self.more()
                    scan += self.at
                    continue
                objs = self.decode(self.tail())
                if objs is None:
                    raise NotSplit("the last pods")
                items.extend(lean(o) for o in objs)
                return False
            objs = self.decode(nxt + 1)
            if objs is not None:
                items.extend(lean(o) for o in objs)
                self.at = nxt + 2
                self.kept = None  # pods read: the body is no longer whole anywhere
                return True
            tries += 1
            if tries > MAX_TRIES:
                raise NotSplit("separators inside a pod")
            scan = nxt + 1

    def decode(self, end: int) -> list[Any] | None:
        """The values from ``at`` to ``end`` (one pod, or several separated by commas, or none), None
        when they are not complete JSON values."""
        view = memoryview(self.buf)[self.at:end]
        try:
            return [orjson.loads(view)]
        except orjson.JSONDecodeError:
            pass
        try:
            return orjson.loads(b"[" + view + b"]")  # type: ignore[no-any-return]
        except orjson.JSONDecodeError:
            return None

    def tail(self) -> int:
        """Read to the body's end, which must be "]}" (and whitespace): where the "]}" begins."""
        while not self.eof:
            if len(self.buf) - self.at > MAX_ITEM_BYTES:
                raise NotSplit(f"a pod over {MAX_ITEM_BYTES} bytes")
            self.more()
        end = len(self.buf.rstrip(_SPACE)) - len(_CLOSE)
        if end < self.at or self.buf[end:end + len(_CLOSE)] != _CLOSE:
            raise NotSplit("the end")
        return end


def _whole(body: bytes) -> tuple[str, list[dict[str, Any]]]:
    doc = orjson.loads(body)
    if not isinstance(doc, dict):
        return "", []
    items = doc.get("items") or []
    return _rv(doc), [lean(i) for i in items] if isinstance(items, list) else []


def _rv(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata")
    return str((meta.get("resourceVersion") if isinstance(meta, dict) else None) or "")
