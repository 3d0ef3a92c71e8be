"""Where a ghost is decided, and where a copy of a pod is found stale. Pure: no I/O, no clock.

"Is this copy stale?" has two meanings, each answered here and nowhere else:

1. **Does etcd's copy make this identity a ghost?** ``decide(pod, read)`` compares the
   scheduler's copy of a Pod (``PodRef``, from the extender request or the binding) with
   what a quorum read (a GET with no resourceVersion, served by etcd) returned
   (``QuorumRead``); ``verdict_for(uid, read)`` is the same rule without the reason text,
   and ``pending_in_etcd(read, uid)`` its "no, etcd has it pending" answer.
2. **Does a replica's watch cache still show a pod as pending where etcd does not?**
   ``serves_ghost(items, read, uid)``: a cached copy a scheduler would try to place
   (``is_pending``) of an identity that rule 1 calls a ghost. The incident recorder asks
   the two halves apart (etcd first, then every cache): ``pending_in_etcd`` and
   ``shows_pending(items, uid)``.

Every verdict has one kebab-case string used in reasons, logs, the audit store and metric
labels.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class Verdict(str, enum.Enum):
    ALIVE = "alive"
    GHOST_DELETED = "ghost-deleted"
    GHOST_REPLACED = "ghost-replaced"
    ALREADY_BOUND = "already-bound"
    TERMINATING = "terminating"
    UNKNOWN = "unknown"

    @property
    def is_ghost(self) -> bool:
        """True when the scheduler must not place this pod on any node.

        All four are permanent for a UID (a deleted UID never returns, nodeName
        is never unset, a deletionTimestamp is never removed), so they may be
        cached by UID for a long time.
        """
        return self not in (Verdict.ALIVE, Verdict.UNKNOWN)

    def __str__(self) -> str:
        return self.value


GHOST_VERDICTS = tuple(v for v in Verdict if v.is_ghost)


@dataclass(frozen=True, slots=True)
class PodRef:
    """The scheduler's view of a pod: what its informer (maybe stale) holds."""

    namespace: str
    name: str
    uid: str = ""

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


class ReadStatus(str, enum.Enum):
    FOUND = "found"
    NOT_FOUND = "not-found"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class QuorumRead:
    """What a quorum GET of the pod returned.

    ``error`` is a short, already sanitized reason ("timeout after 1.0s",
    "HTTP 429 TooManyRequests", ...) when ``status`` is ERROR.
    """

    status: ReadStatus
    uid: str = ""
    node_name: str = ""
    deletion_timestamp: str = ""
    resource_version: str = ""
    http_status: int = 0
    error: str = ""
    # The pod found is a heal placeholder of ghost-guard's own (guard.core.heal_plan.placeholder_pod): it stands
    # for the ghost's deletion while heal runs, never for a replacement of it.
    placeholder: bool = False

    @classmethod
    def found(cls, uid: str, *, node_name: str = "", deletion_timestamp: str = "", resource_version: str = "",
              placeholder: bool = False) -> "QuorumRead":
        return cls(ReadStatus.FOUND, uid=uid, node_name=node_name or "", deletion_timestamp=deletion_timestamp or "",
                   resource_version=resource_version or "", http_status=200, placeholder=placeholder)

    @classmethod
    def not_found(cls) -> "QuorumRead":
        return cls(ReadStatus.NOT_FOUND, http_status=404)

    @classmethod
    def failed(cls, error: str, http_status: int = 0) -> "QuorumRead":
        return cls(ReadStatus.ERROR, http_status=http_status, error=error)


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: str

    @property
    def is_ghost(self) -> bool:
        return self.verdict.is_ghost


_STALE = "scheduler cache is stale"


# --- 1. etcd's copy: is this identity a ghost? ----------------------------------------------------


def verdict_for(uid: str, read: QuorumRead) -> Verdict:
    """What a quorum read of a pod's name makes of the pod identity with UID ``uid``.

    The quorum read is the truth. The rules, in order:

    - read failed                         -> unknown (the caller fails open)
    - not found                           -> ghost-deleted
    - found with another UID              -> ghost-replaced (deleted, recreated under the same name),
                                             or ghost-deleted when that pod is ghost-guard's own heal
                                             placeholder (a write of ours is never a replacement)
    - found with ``spec.nodeName`` set    -> already-bound
    - found with a ``deletionTimestamp``  -> terminating
    - otherwise                           -> alive

    Without a ``uid`` (or a read without one) a replacement cannot be told apart, so the UID
    comparison is skipped.
    """
    if read.status is ReadStatus.ERROR:
        return Verdict.UNKNOWN
    if read.status is ReadStatus.NOT_FOUND:
        return Verdict.GHOST_DELETED
    if uid and read.uid and read.uid != uid:
        return Verdict.GHOST_DELETED if read.placeholder else Verdict.GHOST_REPLACED
    if read.node_name:
        return Verdict.ALREADY_BOUND
    if read.deletion_timestamp:
        return Verdict.TERMINATING
    return Verdict.ALIVE


def decide(pod: PodRef, read: QuorumRead) -> Decision:
    """Decide whether ``pod`` (the scheduler's copy) still needs scheduling: :func:`verdict_for`
    its UID, with the reason the extender and the admission reply carry."""
    verdict = verdict_for(pod.uid, read)
    uid = pod.uid or "(none)"
    if verdict is Verdict.ALIVE:
        return Decision(verdict, f"pod {pod} uid {uid} confirmed pending by quorum read")
    if verdict is Verdict.UNKNOWN:
        return Decision(verdict, f"quorum read of pod {pod} uid {uid} failed: {read.error}")
    if verdict is Verdict.GHOST_DELETED and read.placeholder:
        return Decision(verdict, f"ghost pod: {pod} uid {uid} was deleted: etcd holds only ghost-guard's heal "
                                 f"placeholder under that name (quorum read); {_STALE}")
    if verdict is Verdict.GHOST_DELETED:
        return Decision(verdict, f"ghost pod: {pod} uid {uid} not found by quorum read (etcd); {_STALE}")
    if verdict is Verdict.GHOST_REPLACED:
        return Decision(verdict, f"ghost pod: {pod} uid {uid} was replaced by uid {read.uid} (quorum read, etcd); {_STALE}")
    if verdict is Verdict.ALREADY_BOUND:
        return Decision(verdict, f"ghost pod: {pod} uid {uid} is already bound to node {read.node_name} "
                                 f"(quorum read, etcd); {_STALE}")
    return Decision(verdict, f"ghost pod: {pod} uid {uid} is terminating since {read.deletion_timestamp} "
                             f"(quorum read, etcd); {_STALE}")


def pending_in_etcd(read: QuorumRead, uid: str) -> bool:
    """Whether a quorum read of a pod's name shows pod ``uid`` pending (found with that UID,
    :func:`verdict_for` alive): then it is no ghost, and a replica serving it serves the truth.
    A failed read says nothing (False); the caller must not blame on it either."""
    return bool(uid) and read.uid == uid and verdict_for(uid, read) is Verdict.ALIVE


# --- 2. a replica's cached copy: does it still show a ghost as pending? ---------------------------


def is_pending(obj: Mapping[str, Any]) -> bool:
    """Whether a pod object (the API's JSON) is one a scheduler would try to place: no
    ``spec.nodeName``, no ``metadata.deletionTimestamp``."""
    return not (obj.get("spec") or {}).get("nodeName") and not (obj.get("metadata") or {}).get("deletionTimestamp")


def shows_pending(items: Iterable[Mapping[str, Any]], uid: str) -> bool:
    """Whether a replica's cached copies of one pod name (a LIST's ``items``) would make a
    scheduler try to place pod ``uid``: a copy with that UID that :func:`is_pending`.

    The cache half of :func:`serves_ghost`, for a caller that asked etcd already (the incident
    recorder probes a ghost's replicas only after ``pending_in_etcd`` said no). A replica that
    lists the pod bound, or terminating, shows nothing to schedule. Without a ``uid`` any
    pending copy counts.
    """
    return any(is_pending(item) for item in items if not uid or _uid(item) == uid)


def serves_ghost(items: Iterable[Mapping[str, Any]], read: QuorumRead, uid: str = "") -> bool:
    """Whether a replica's cached copies of one pod name (a LIST's ``items``) still show a pod
    as pending that etcd's copy (``read``, a quorum read of the name) makes a ghost: a copy a
    scheduler would try to place (:func:`is_pending`) whose UID :func:`verdict_for` calls a
    ghost. With a ``uid`` only that identity's copies count.

    That covers every ghost verdict: deleted (etcd has no pod), replaced (the old UID is still
    listed), already bound (the copy is unbound), terminating (the copy has no
    deletionTimestamp). A failed read is no ghost (False). A copy listed bound or terminating,
    or no copy at all, serves nothing to a scheduler: False (a cache that misses a pod is
    :mod:`guard.core.cache_health`'s question; one that differs from etcd in any way, the heal's,
    :func:`guard.core.heal_plan.disagreement`).
    """
    return any(is_pending(item) and verdict_for(_uid(item), read).is_ghost
               for item in items if not uid or _uid(item) == uid)


def _uid(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")
