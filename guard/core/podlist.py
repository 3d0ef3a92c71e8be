"""A replica's listing of unscheduled pods, read one pod at a time (pure: bytes in, lean dicts out).

The guard lists every replica's cache of unscheduled pods every few seconds (guard/engine/prepare.py,
the missing-pod checks): with a backlog of 10,000 pending pods a listing is ~16 MB of JSON, and
decoding it whole builds ~60 MB more of Python objects per replica (every field of every pod:
managedFields, containers, status), three replicas at once (issue 29: the guard's peak RSS
grew from 150 MiB to over 400 MiB with the backlog). The guard needs six fields of each pod.

So the items are split at kube-apiserver's item boundaries (Go's encoding/json writes a PodList as
``{"kind":...,"metadata":{...},"items":[{"metadata":{...},...},{"metadata":{...},...}]}``, no
whitespace) and decoded one at a time, each reduced to :data:`KEPT_METADATA` and ``spec.nodeName``
at once: the peak is the body plus one pod. The separator ``},{"metadata":{`` holds raw quotes, so it
is never inside a JSON string; one found inside a pod (a nested list of objects whose first key is
``metadata``) leaves a piece with an unclosed container, which does not decode. Any piece that does
not decode, or any other shape, and the body is decoded whole (the old way), which also gives the
error of a bad one: the answer is always what decoding the whole body gives, reduced.
"""

from __future__ import annotations

from typing import Any

import orjson

# What the guard reads of a listed pod: its identity, its age (kube-scheduler's order), whether it
# is terminating, and (from spec) whether it is bound (guard.core.verdict.is_pending).
KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "creationTimestamp", "deletionTimestamp")

_ITEMS = b',"items":['
_FIRST = b'{"metadata":{'
_SEP = b'},{"metadata":{'


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
    split = _split(body)
    if split is not None:
        return split
    doc = orjson.loads(body)
    if not isinstance(doc, dict):
        return "", []
    items = doc.get("items") or []
    return _rv(doc), [lean(i) for i in items] if isinstance(items, list) else []


def _rv(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata")
    return str((meta.get("resourceVersion") if isinstance(meta, dict) else None) or "")


def _split(body: bytes) -> tuple[str, list[dict[str, Any]]] | None:
    """The listing read item by item, or None when its shape is not kube-apiserver's (decode whole)."""
    at = body.find(_ITEMS)
    end = len(body.rstrip(b" \t\r\n")) - 2
    if at <= 0 or end < at or body[end:end + 2] != b"]}":
        return None
    view = memoryview(body)
    try:
        head = orjson.loads(bytes(view[:at]) + b"}")
        if not isinstance(head, dict):
            return None
        start = at + len(_ITEMS)
        items: list[dict[str, Any]] = []
        if start == end:
            return _rv(head), items
        if not body.startswith(_FIRST, start):
            return None
        while True:
            nxt = body.find(_SEP, start, end)
            stop = end if nxt < 0 else nxt + 1
            obj = orjson.loads(view[start:stop])
            if not isinstance(obj, dict):
                return None
            items.append(lean(obj))
            if nxt < 0:
                return _rv(head), items
            start = nxt + 2
    except orjson.JSONDecodeError:
        return None
