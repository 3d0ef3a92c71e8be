"""The GhostPod and GhostNode objects of the Kubernetes audit store, as pure mapping: no I/O, no clock.

``guard.audit.ghostpods`` (the background writer) keeps the audit records (:mod:`guard.core.records`) as
objects of the group ``kube-ghost-guard.io/v1alpha1`` (manifests/crd): a namespaced GhostPod per blocked
ghost Pod identity (namespace, name, UID) and a cluster-scoped GhostNode per ghost Node identity (name,
UID). This module is everything about those objects that needs no apiserver:

- their names (:func:`object_name`, :func:`node_object_name`) and times (:func:`to_time`, :func:`from_time`);
- the operations a writer queues for one identity (:class:`Pending`) and how they apply to a status
  (:func:`apply_ops`: the SQLite store's rules), the merge patch that writes it (:func:`status_patch`);
- an object read back as a record (:func:`to_record`, :func:`node_to_record`), a record as a status
  (:func:`record_status`, ``audit export``) and a status brought up to another (:func:`widen`).
"""

from __future__ import annotations

import datetime
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from guard.core.records import MAX_HEALS_PER_GHOST, NODE_VERDICT, AuditRecord, HealAttempt, NodeRecord, ReplicaState

GROUP: Final = "kube-ghost-guard.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "GhostPod"
NODE_KIND: Final = "GhostNode"
PLURAL: Final = "ghostpods"
NODE_PLURAL: Final = "ghostnodes"
MAX_OPS_PER_RECORD: Final = 256
MAX_HEALS: Final = MAX_HEALS_PER_GHOST  # status.heals: the newest attempts (the CRD's maxItems), as in SQLite
MAX_REPLICAS: Final = 64  # status.replicas (the CRD's maxItems)
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
NODE_NAMESPACE: Final = ""
"""The namespace of a ghost Node's :data:`Key`: none (a pod's namespace is never empty)."""

Key = tuple[str, str, str]
"""One identity: (namespace, name, uid) of a ghost Pod, or ("", name, uid) of a ghost Node."""


def is_node(key: Key) -> bool:
    """Whether ``key`` names a ghost Node (a GhostNode object) rather than a ghost Pod."""
    return key[0] == NODE_NAMESPACE


# --- names and times (pure) ------------------------------------------------------------


def object_name(namespace: str, name: str, uid: str) -> str:
    """The GhostPod's name: ``<pod name, at most 40 characters>-<10 hex digits of sha256(ns, name, uid)>``.

    A valid DNS subdomain for any input (characters outside [a-z0-9.-] become ``-``), the same
    in every guard replica, and different for every pod identity."""
    digest = hashlib.sha256(f"{namespace}\x00{name}\x00{uid}".encode()).hexdigest()[:10]
    stem = re.sub(r"[^a-z0-9.-]", "-", name.lower())[:40]
    stem = re.sub(r"^[^a-z0-9]+|[^a-z0-9]+$", "", stem)
    stem = re.sub(r"\.(?=[^a-z0-9])|(?<=[^a-z0-9])\.", "-", stem)  # no empty DNS labels ("a..b", "a.-b")
    return f"{stem}-{digest}" if stem else f"ghost-{digest}"


def node_object_name(name: str, uid: str) -> str:
    """The GhostNode's name: as :func:`object_name`, from the Node's identity (name, UID)."""
    return object_name(NODE_NAMESPACE, name, uid)


def to_time(at: float) -> str:
    """Seconds since the epoch -> RFC 3339 UTC with microseconds (``2026-12-01T10:38:24.123456Z``)."""
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def from_time(text: object) -> float | None:
    """RFC 3339 (with or without a fraction) -> seconds since the epoch; None if absent or unreadable."""
    if not isinstance(text, str) or not text:
        return None
    try:
        value = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=datetime.timezone.utc)
    return value.timestamp()


# --- operations on a status (pure) ----------------------------------------------------------


@dataclass
class Pending:
    """What one guard process has to write for one identity: the spec (for a create) and operations."""

    key: Key
    spec: dict[str, Any] | None = None
    ops: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 0
    since: float = 0.0  # monotonic: when the oldest pending operation arrived

    def add(self, op: dict[str, Any]) -> None:
        last = self.ops[-1] if self.ops else None
        if op["op"] == "block" and last is not None and last["op"] == "block":  # a looping ghost: one counter
            last["count"] += op["count"]
            last["first"] = min(last["first"], op["first"])
            last["last"] = max(last["last"], op["last"])
            return
        self.ops.append(op)
        if len(self.ops) > MAX_OPS_PER_RECORD:  # bounded: drop the oldest probe (a newer one of it follows)
            for i, o in enumerate(self.ops):
                if o["op"] == "probe":
                    del self.ops[i]
                    break
            else:
                del self.ops[0]

    def absorb(self, newer: Pending) -> None:
        """Put ``newer``'s operations after ours (a failed write goes back in front)."""
        if self.spec is None:
            self.spec = newer.spec
        for op in newer.ops:
            self.add(op)
        self.since = min(self.since, newer.since) if self.since else newer.since


def apply_ops(status: Mapping[str, Any] | None, ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The status after ``ops``, with the audit store's rules (guard/audit/sqlite.py's AuditStore):

    - block: ``timesBlocked`` (a GhostNode's ``timesDetected``: the op's ``counter``) + count, ``firstSeen`` the oldest, ``lastSeen`` the newest; clears
      ``retractedAt`` (a new, proven verdict);
    - retract: sets ``retractedAt``, forgets the replica probes (no report names a replica);
    - probe: ignored while retracted or older than the replica's newest; ``firstSeenServing``
      when first seen serving (again, after a heal), ``healedAt`` when an answered probe finds it
      no longer serving; a failed probe (``serves`` None) changes neither;
    - heal: appended (the newest ``MAX_HEALS`` kept, a repeat of the same attempt once).
    """
    out: dict[str, Any] = {k: v for k, v in (status or {}).items()}
    replicas = {r["replica"]: dict(r) for r in out.get("replicas") or [] if isinstance(r, dict) and r.get("replica")}
    heals = [dict(h) for h in out.get("heals") or [] if isinstance(h, dict)]
    for op in ops:
        kind = op["op"]
        if kind == "block":
            counter = op.get("counter", "timesBlocked")  # a GhostNode counts detections: timesDetected
            out[counter] = int(out.get(counter) or 0) + op["count"]
            first, last = from_time(out.get("firstSeen")), from_time(out.get("lastSeen"))
            out["firstSeen"] = to_time(op["first"] if first is None else min(first, op["first"]))
            out["lastSeen"] = to_time(op["last"] if last is None else max(last, op["last"]))
            out.pop("retractedAt", None)
        elif kind == "retract":
            out["retractedAt"] = to_time(op["at"])
            replicas.clear()
        elif kind == "probe":
            if out.get("retractedAt"):
                continue
            _merge_probe(replicas, op)
        elif kind == "heal":
            entry = {"at": to_time(op["at"]), "action": op["action"][:64], "outcome": op["outcome"][:64],
                     "detail": op["detail"][:512]}
            if entry not in heals:
                heals.append(entry)
    ordered = sorted(replicas.values(), key=lambda r: r["replica"])[:MAX_REPLICAS]
    out["replicas"] = ordered
    out["staleReplicas"] = ",".join(r["replica"] for r in ordered if r.get("firstSeenServing") and not r.get("healedAt"))
    heals.sort(key=lambda h: from_time(h["at"]) or 0.0)
    out["heals"] = heals[-MAX_HEALS:]
    return out


def _merge_probe(replicas: dict[str, dict[str, Any]], op: dict[str, Any]) -> None:
    at, serves = op["at"], op["serves"]
    cur = replicas.get(op["replica"])
    if cur is not None and (from_time(cur.get("lastChecked")) or 0.0) > at:
        return  # an older probe than the one written
    new = dict(cur or {"replica": op["replica"]})
    new["serves"] = serves
    for key, value in (("cacheResourceVersion", op["rv"]), ("error", op["error"])):
        if value is None:
            new.pop(key, None)
        else:
            new[key] = value
    new["lastChecked"] = to_time(at)
    if serves is True:
        if cur is None or not cur.get("firstSeenServing") or cur.get("healedAt"):
            new["firstSeenServing"] = to_time(at)
        new.pop("healedAt", None)
    elif serves is False and new.get("firstSeenServing") and not new.get("healedAt"):
        new["healedAt"] = to_time(at)
    replicas[op["replica"]] = new


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any], resource_version: str) -> dict[str, Any]:
    """A JSON merge patch turning status ``old`` into ``new`` on exactly that resourceVersion."""
    status: dict[str, Any] = dict(new)
    for key in (old or {}):
        if key not in new:
            status[key] = None  # merge patch: null deletes
    return {"metadata": {"resourceVersion": resource_version}, "status": status}


def to_record(obj: Mapping[str, Any]) -> AuditRecord | None:
    """A GhostPod object -> :class:`~guard.core.records.AuditRecord` (None if it is not one of ours)."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    if not isinstance(spec, dict) or not isinstance(status, dict) or not spec.get("podUID"):
        return None
    created = from_time(meta.get("creationTimestamp")) or 0.0
    first = from_time(status.get("firstSeen"))
    last = from_time(status.get("lastSeen"))
    replicas = []
    for r in status.get("replicas") or []:
        if not isinstance(r, dict) or not r.get("replica"):
            continue
        serves = r.get("serves")
        replicas.append(ReplicaState(
            replica=str(r["replica"]), serves=serves if isinstance(serves, bool) else None,
            cache_resource_version=r.get("cacheResourceVersion"), error=r.get("error"),
            last_checked=from_time(r.get("lastChecked")) or 0.0, first_seen_serving=from_time(r.get("firstSeenServing")),
            healed_at=from_time(r.get("healedAt"))))
    heals = tuple(HealAttempt(at=from_time(h.get("at")) or 0.0, action=str(h.get("action", "")),
                              outcome=str(h.get("outcome", "")), detail=str(h.get("detail", "")))
                  for h in status.get("heals") or [] if isinstance(h, dict))
    raw_evidence = spec.get("evidence")
    evidence: dict[str, Any] = raw_evidence if isinstance(raw_evidence, dict) else {}
    return AuditRecord(
        uid=str(spec["podUID"]), namespace=str(meta.get("namespace", "")), name=str(spec.get("podName", "")),
        verdict=str(spec.get("verdict", "")), evidence=evidence,
        first_seen=first if first is not None else created, last_seen=last if last is not None else created,
        times_blocked=int(status.get("timesBlocked") or 0), replicas=tuple(sorted(replicas, key=lambda r: r.replica)),
        retracted_at=from_time(status.get("retractedAt")), heals=heals)


def record_status(record: AuditRecord) -> dict[str, Any]:
    """The GhostPod status that says what ``record`` says (``audit export``)."""
    ops: list[dict[str, Any]] = [{"op": "block", "count": record.times_blocked, "first": record.first_seen,
                        "last": record.last_seen}]
    status = apply_ops({}, ops)
    status["replicas"] = [
        {k: v for k, v in {"replica": r.replica, "serves": r.serves, "cacheResourceVersion": r.cache_resource_version,
                           "error": r.error, "lastChecked": to_time(r.last_checked),
                           "firstSeenServing": to_time(r.first_seen_serving) if r.first_seen_serving is not None else None,
                           "healedAt": to_time(r.healed_at) if r.healed_at is not None else None}.items()
         if v is not None or k == "serves"}
        for r in record.replicas][:MAX_REPLICAS]
    status["staleReplicas"] = ",".join(record.stale_replicas)
    if record.retracted_at is not None:
        status["retractedAt"] = to_time(record.retracted_at)
    status["heals"] = [{"at": to_time(h.at), "action": h.action[:64], "outcome": h.outcome[:64], "detail": h.detail[:512]}
                       for h in getattr(record, "heals", ())][-MAX_HEALS:]
    return status


def widen(old: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, Any]:
    """``old`` brought up to ``want`` without counting twice: the larger count, the wider time span, the
    newer probe per replica, every heal once."""
    out = dict(old)
    out["timesBlocked"] = max(int(old.get("timesBlocked") or 0), int(want.get("timesBlocked") or 0))
    for key, pick in (("firstSeen", min), ("lastSeen", max)):
        times = [t for t in (from_time(old.get(key)), from_time(want.get(key))) if t is not None]
        if times:
            out[key] = to_time(pick(times))
    if want.get("retractedAt") and not old.get("retractedAt"):
        out["retractedAt"] = want["retractedAt"]
    replicas = {r["replica"]: r for r in old.get("replicas") or [] if isinstance(r, dict) and r.get("replica")}
    for r in want.get("replicas") or []:
        cur = replicas.get(r["replica"])
        if cur is None or (from_time(cur.get("lastChecked")) or 0.0) < (from_time(r.get("lastChecked")) or 0.0):
            replicas[r["replica"]] = r
    out["replicas"] = sorted(replicas.values(), key=lambda r: r["replica"])[:MAX_REPLICAS]
    out["staleReplicas"] = ",".join(r["replica"] for r in out["replicas"] if r.get("firstSeenServing") and not r.get("healedAt"))
    heals = [h for h in old.get("heals") or [] if isinstance(h, dict)]
    for h in want.get("heals") or []:
        if h not in heals:
            heals.append(h)
    heals.sort(key=lambda h: from_time(h.get("at")) or 0.0)
    out["heals"] = heals[-MAX_HEALS:]
    return out


def node_record_status(record: NodeRecord) -> dict[str, Any]:
    """The GhostNode status that says what ``record`` says (``audit export``): a GhostPod's, counting
    detections (``timesDetected``) instead of blocks."""
    status = record_status(AuditRecord(uid=record.uid, namespace=NODE_NAMESPACE, name=record.name, verdict=NODE_VERDICT,
                                       evidence=record.evidence, first_seen=record.first_seen,
                                       last_seen=record.last_seen, times_blocked=record.times_detected,
                                       replicas=record.replicas, heals=record.heals))
    status["timesDetected"] = status.pop("timesBlocked")
    return status


def widen_node(old: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`widen` for a GhostNode's status (its counter is ``timesDetected``)."""
    def as_pod(status: Mapping[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in status.items() if k != "timesDetected"}
        out["timesBlocked"] = status.get("timesDetected")
        return out

    out = widen(as_pod(old), as_pod(want))
    out["timesDetected"] = out.pop("timesBlocked")
    return out


def node_spec(name: str, uid: str, evidence: Mapping[str, Any]) -> dict[str, Any]:
    """A GhostNode's spec: the Node's identity and what the quorum read said."""
    return {"nodeName": name, "nodeUID": uid, "evidence": dict(evidence)}


def node_to_record(obj: Mapping[str, Any]) -> NodeRecord | None:
    """A GhostNode object -> :class:`~guard.core.records.NodeRecord` (None if it is not one of ours)."""
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    if not isinstance(spec, dict) or not isinstance(status, dict) or not spec.get("nodeName"):
        return None
    pod_like = to_record({"metadata": meta, "spec": {"podUID": spec.get("nodeUID") or "-", "podName": spec["nodeName"],
                                                     "evidence": spec.get("evidence")},
                          "status": {**status, "timesBlocked": status.get("timesDetected")}})
    assert pod_like is not None
    return NodeRecord(name=str(spec["nodeName"]), uid=str(spec.get("nodeUID") or ""), evidence=pod_like.evidence,
                      first_seen=pod_like.first_seen, last_seen=pod_like.last_seen,
                      times_detected=pod_like.times_blocked, replicas=pod_like.replicas, heals=pod_like.heals)
