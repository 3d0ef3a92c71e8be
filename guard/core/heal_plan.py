"""What healing a stale watch cache takes, decided from what etcd and each replica show. Pure.

A replica's watch cache whose etcd watch lost an event but still flows is corrected by the next
event for the same key: the cache replaces what it holds under that key (watch_cache.go
processEvent) and every watcher, kube-scheduler's informer included, sees the change. Measured on a
real v1.36.2 control plane: a replica whose etcd watch had lost a pod's DELETE, then kept flowing,
dropped the ghost within 0.55 s of a create and delete of a pod with the same namespace/name through
another replica, and the scheduler stopped looping; for a replaced ghost one annotation patch on the
live pod did the same. So, for one pod name:

- etcd has no pod under the name, some replica still serves one (a *deleted* ghost):
  **placeholder**: create a pod under the name that can never be scheduled or run (a scheduling
  gate of the guard's own), wait until every reachable replica shows it, delete it with a UID
  precondition, wait until no replica serves the name. Two writes.
- etcd has a pod under the name, some replica serves another UID (a *replaced* ghost), or the same
  UID unbound while etcd has it bound, or not terminating while etcd has it terminating, or nothing
  at all although its cache is past the pod's revision (a *missing* pod): **annotate**: one
  annotation patch on the live pod with a resourceVersion precondition; wait until every replica
  shows etcd's UID at the patch's resourceVersion or later. One write.
- every replica agrees with etcd: **none**. A pod etcd has pending that every replica serves as
  pending is *alive* and never touched.

A replica whose cache revision stays below the heal's own write while etcd moved past it has a
*frozen* watch: no write can reach it; only restarting that replica helps.

:mod:`guard.engine.healer` does the reads and writes (through :mod:`guard.kube.reads` and :mod:`guard.kube.writes`); this module plans,
builds the objects it writes, judges what it sees, and renders the results.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from guard.core.verdict import QuorumRead, ReadStatus, pending_in_etcd

# The project's API domain (the webhook is pods-binding.ghost-guard.kube-ghost-guard.io).
DOMAIN = "kube-ghost-guard.io"
PLACEHOLDER_GATE = f"{DOMAIN}/placeholder"  # a scheduling gate nothing ever removes: never scheduled, never runs
GHOST_UID_KEY = f"{DOMAIN}/ghost-uid"  # label and annotation on a placeholder: the ghost it replaces
HEAL_ANNOTATION = f"{DOMAIN}/cache-heal"  # the one annotation written on a live pod
MANAGED_BY = "ghost-guard"
PLACEHOLDER_IMAGE = "registry.k8s.io/pause:3.10"  # never pulled: a gated pod is never bound to a node
MAX_ATTEMPTS = 3  # re-verify and re-plan at most this often when the name changes under us


class Action(str, enum.Enum):
    PLACEHOLDER = "placeholder"
    ANNOTATE = "annotate"
    NONE = "none"

    def __str__(self) -> str:
        return self.value


class Outcome(str, enum.Enum):
    HEALED = "healed"  # every reachable replica agrees with etcd
    FROZEN = "frozen"  # a replica's watch delivers nothing: restart that replica
    REFUSED = "refused"  # the apiserver refused the write (admission, quota, policy)
    FAILED = "failed"  # anything else (etcd unreadable, a write failed, a replica moved on but still disagrees)
    ALIVE = "alive"  # etcd has the pod pending and every replica serves it: nothing touched
    TIMEOUT = "timeout"  # the replicas had not caught up when --timeout ran out (no frozen one among them)

    def __str__(self) -> str:
        return self.value


# --- what a replica shows -------------------------------------------------------------------------


@dataclass(frozen=True)
class Copy:
    """One cached copy of the pod name in a replica's watch cache."""

    uid: str
    resource_version: int
    node_name: str = ""
    deleting: bool = False

    @classmethod
    def of(cls, item: dict[str, Any]) -> Copy:
        meta, spec = item.get("metadata") or {}, item.get("spec") or {}
        try:
            rv = int(meta.get("resourceVersion") or 0)
        except (TypeError, ValueError):
            rv = 0
        return cls(str(meta.get("uid") or ""), rv, str(spec.get("nodeName") or ""), bool(meta.get("deletionTimestamp")))

    def describe(self) -> str:
        state = f"bound to {self.node_name}" if self.node_name else "pending"
        if self.deleting:
            state += ", terminating"
        return f"uid {self.uid} {state} (rv {self.resource_version})"


@dataclass(frozen=True)
class CacheView:
    """A replica's watch cache for one pod name (LIST resourceVersion=0): its copies and its revision."""

    replica: str
    copies: tuple[Copy, ...] = ()
    revision: int | None = None
    error: str | None = None

    @classmethod
    def of(cls, replica: str, items: Iterable[dict[str, Any]], revision: str | None, error: str | None) -> CacheView:
        if error:
            return cls(replica, (), None, error)
        try:
            rev = int(revision) if revision else None
        except ValueError:
            rev = None
        return cls(replica, tuple(Copy.of(i) for i in items), rev, None)

    @property
    def reachable(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        if self.error:
            return f"unreadable: {self.error}"
        rev = f" [cache rv {self.revision}]" if self.revision is not None else ""
        if not self.copies:
            return f"absent{rev}"
        return "; ".join(c.describe() for c in self.copies) + rev


def disagreement(view: CacheView, read: QuorumRead) -> str | None:
    """Why ``view`` contradicts the quorum read, or None when it agrees (or could not be read)."""
    if not view.reachable or read.status is ReadStatus.ERROR:
        return None
    if read.status is ReadStatus.NOT_FOUND:
        if view.copies:
            return "serves " + ", ".join(f"uid {c.uid}" for c in view.copies) + " that etcd no longer has"
        return None
    for c in view.copies:
        if c.uid != read.uid:
            return f"serves uid {c.uid}; etcd has uid {read.uid}"
        if read.node_name and not c.node_name:
            return f"serves uid {c.uid} unbound; etcd has it bound to {read.node_name}"
        if read.deletion_timestamp and not c.deleting:
            return f"serves uid {c.uid} not terminating; etcd has it terminating"
    if not view.copies:
        try:
            rv = int(read.resource_version or 0)
        except ValueError:
            rv = 0
        if view.revision is not None and rv and view.revision >= rv:
            return f"does not serve uid {read.uid} although its cache (rv {view.revision}) is past the pod's rv {rv}"
    return None


def ghost_uids(read: QuorumRead, views: Iterable[CacheView]) -> list[str]:
    """The UIDs some replica serves under the name that are not etcd's pod."""
    out: set[str] = set()
    for v in views:
        for c in v.copies:
            if read.status is ReadStatus.NOT_FOUND or (read.status is ReadStatus.FOUND and c.uid != read.uid):
                out.add(c.uid)
    return sorted(out)


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    action: Action
    outcome: Outcome | None  # decided already (nothing to write), else None
    reason: str
    stale: tuple[str, ...] = ()  # replicas that disagree with etcd
    ghosts: tuple[str, ...] = ()


def plan(read: QuorumRead, views: Sequence[CacheView]) -> Plan:
    """What to do for one pod name, given a quorum read that began after ``views`` were taken."""
    if read.status is ReadStatus.ERROR:
        return Plan(Action.NONE, Outcome.FAILED, f"quorum read failed: {read.error}; nothing written")
    stale = tuple(sorted(v.replica for v in views if disagreement(v, read)))
    ghosts = tuple(ghost_uids(read, views))
    if not stale:
        if pending_in_etcd(read, read.uid):
            return Plan(Action.NONE, Outcome.ALIVE, f"pod uid {read.uid} is pending in etcd and every reachable replica "
                                                    "agrees: alive, not touched")
        return Plan(Action.NONE, Outcome.HEALED, "every reachable replica already agrees with etcd")
    if read.status is ReadStatus.NOT_FOUND:
        return Plan(Action.PLACEHOLDER, None, "etcd has no pod under this name; a placeholder create and delete "
                                              "replaces the ghost in every cache whose watch flows", stale, ghosts)
    return Plan(Action.ANNOTATE, None, f"etcd has uid {read.uid} (rv {read.resource_version}); one annotation on it "
                                       "replaces the stale copies", stale, ghosts)


# --- the objects written ----------------------------------------------------------------------------


def is_placeholder(meta: Any) -> bool:
    """Whether an object's ``metadata`` is that of a heal placeholder of ours (:func:`placeholder_pod`):
    a write of the guard's own, never evidence against a replica or a pod."""
    labels = meta.get("labels") if isinstance(meta, dict) else None
    return (isinstance(labels, dict) and labels.get("app.kubernetes.io/managed-by") == MANAGED_BY
            and labels.get("app.kubernetes.io/component") == "placeholder")


def placeholder_pod(name: str, ghosts: Sequence[str], *, at: str) -> dict[str, Any]:
    """A pod under the ghost's name that can never be scheduled or run, acceptable under the ``restricted``
    Pod Security level, with tiny requests and limits so that quotas demanding them accept it."""
    first = ghosts[0] if ghosts else ""
    resources = {"cpu": "1m", "memory": "8Mi"}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/component": "placeholder",
                       GHOST_UID_KEY: first},
            "annotations": {GHOST_UID_KEY: ",".join(ghosts),
                            f"{DOMAIN}/purpose": "replaces a ghost in stale apiserver watch caches; deleted at once",
                            f"{DOMAIN}/created-at": at},
        },
        "spec": {
            "schedulingGates": [{"name": PLACEHOLDER_GATE}],
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65535, "runAsGroup": 65535,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "placeholder", "image": PLACEHOLDER_IMAGE,
                "resources": {"requests": dict(resources), "limits": dict(resources)},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
            }],
        },
    }


def annotation_patch(resource_version: str, ghosts: Sequence[str], *, at: str) -> dict[str, Any]:
    """A JSON merge patch: one annotation, applied only at ``resource_version`` (else 409 Conflict)."""
    value = f"{at} replaced stale cached uid(s) {','.join(ghosts)}" if ghosts else f"{at} refreshed stale caches"
    return {"metadata": {"resourceVersion": resource_version, "annotations": {HEAL_ANNOTATION: value[:256]}}}


# --- judging the wait ---------------------------------------------------------------------------------


def shows(view: CacheView, uid: str) -> bool:
    return view.reachable and any(c.uid == uid for c in view.copies)


def empty(view: CacheView) -> bool:
    return view.reachable and not view.copies


def shows_live(view: CacheView, read: QuorumRead, min_rv: int) -> bool:
    """The replica serves etcd's pod at ``min_rv`` or later and nothing else under the name."""
    return (view.reachable and bool(view.copies)
            and all(c.uid == read.uid and c.resource_version >= min_rv for c in view.copies)
            and disagreement(view, read) is None)


def behind(view: CacheView, write_rv: int) -> bool:
    """The replica's cache has not reached the heal's own write (frozen if it stays so while etcd moved on)."""
    return view.reachable and view.revision is not None and view.revision < write_rv


# --- results ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaResult:
    replica: str
    before: str
    after: str
    agrees: bool | None  # None: unreadable
    seconds: float | None = None  # from the first write until it agreed
    frozen: bool = False


@dataclass(frozen=True)
class HealResult:
    namespace: str
    name: str
    action: Action
    outcome: Outcome
    detail: str
    seconds: float
    writes: int = 0
    ghosts: tuple[str, ...] = ()
    etcd: str = ""
    replicas: tuple[ReplicaResult, ...] = field(default_factory=tuple)
    advice: str = ""
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        """Every replica agrees with etcd (and it was checked)."""
        return self.outcome in (Outcome.HEALED, Outcome.ALIVE) and (not self.dry_run or self.action is Action.NONE)

    def to_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "action": self.action.value,
                "outcome": "planned" if self.dry_run and self.action is not Action.NONE else self.outcome.value,
                "detail": self.detail, "seconds": round(self.seconds, 3), "writes": self.writes,
                "ghostUIDs": list(self.ghosts), "etcd": self.etcd, "advice": self.advice or None, "dryRun": self.dry_run,
                "replicas": [{"replica": r.replica, "before": r.before, "after": r.after, "agrees": r.agrees,
                              "seconds": None if r.seconds is None else round(r.seconds, 3), "frozen": r.frozen}
                             for r in self.replicas]}


def frozen_advice(replicas: Sequence[str], namespace: str, name: str) -> str:
    names = ", ".join(replicas)
    return (f"restart apiserver replica {names} only (its watch cache no longer follows etcd, so no write reaches it); "
            f"then run `ghost-guard heal {namespace}/{name}` again to verify. Restart kube-scheduler only if it still "
            "loops on the pod afterwards.")


def render(results: Sequence[HealResult], output: str = "table") -> str:
    if output == "json":
        return json.dumps({"results": [r.to_dict() for r in results],
                           "ok": all(r.ok for r in results)}, indent=2) + "\n"
    if output != "table":
        raise ValueError(f"unknown output format {output!r}")
    lines: list[str] = []
    for r in results:
        d = r.to_dict()
        lines.append(f"{r.namespace}/{r.name}: {d['outcome']} (action {r.action}, {r.writes} write(s), {r.seconds:.2f}s)")
        lines.append(f"  etcd: {r.etcd}")
        if r.ghosts:
            lines.append(f"  ghost uid(s): {', '.join(r.ghosts)}")
        lines.append(f"  {r.detail}")
        if r.replicas:
            width = max(len(x.replica) for x in r.replicas)
            lines.append(f"  {'REPLICA'.ljust(width)}  {'AGREES':6}  {'AFTER(s)':8}  BEFORE -> AFTER")
            for x in r.replicas:
                agrees = "frozen" if x.frozen else {True: "yes", False: "no", None: "?"}[x.agrees]
                secs = "-" if x.seconds is None else f"{x.seconds:.3f}"
                lines.append(f"  {x.replica.ljust(width)}  {agrees:6}  {secs:8}  {x.before} -> {x.after}")
        if r.advice:
            lines.append(f"  advice: {r.advice}")
    if not results:
        lines.append("nothing to heal: no replica serves a ghost")
    return "\n".join(lines) + "\n"
