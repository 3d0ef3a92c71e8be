"""Where a ghost is decided.

``decide(pod, read)`` compares the scheduler's copy of a Pod (``PodRef``, from
the extender request or the binding) with what a quorum read (a GET with no
resourceVersion, served by etcd) returned (``QuorumRead``). Pure: no I/O, no
clock. Every verdict has one kebab-case string used in reasons, logs, the
audit store and metric labels.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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

    @classmethod
    def found(cls, uid: str, *, node_name: str = "", deletion_timestamp: str = "", resource_version: str = "") -> "QuorumRead":
        return cls(ReadStatus.FOUND, uid=uid, node_name=node_name or "", deletion_timestamp=deletion_timestamp or "",
                   resource_version=resource_version or "", http_status=200)

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


def decide(pod: PodRef, read: QuorumRead) -> Decision:
    """Decide whether ``pod`` (the scheduler's copy) still needs scheduling.

    The quorum read is the truth. The rules, in order:

    - read failed                         -> unknown (the caller fails open)
    - not found                           -> ghost-deleted
    - found with another UID              -> ghost-replaced (deleted, recreated under the same name)
    - found with ``spec.nodeName`` set    -> already-bound
    - found with a ``deletionTimestamp``  -> terminating
    - otherwise                           -> alive

    A scheduler copy without a UID cannot be told apart from a replacement, so
    the UID comparison is skipped for it.
    """
    uid = pod.uid or "(none)"
    if read.status is ReadStatus.ERROR:
        return Decision(Verdict.UNKNOWN, f"quorum read of pod {pod} uid {uid} failed: {read.error}")
    if read.status is ReadStatus.NOT_FOUND:
        return Decision(
            Verdict.GHOST_DELETED,
            f"ghost pod: {pod} uid {uid} not found by quorum read (etcd); {_STALE}",
        )
    if pod.uid and read.uid and read.uid != pod.uid:
        return Decision(
            Verdict.GHOST_REPLACED,
            f"ghost pod: {pod} uid {uid} was replaced by uid {read.uid} (quorum read, etcd); {_STALE}",
        )
    if read.node_name:
        return Decision(
            Verdict.ALREADY_BOUND,
            f"ghost pod: {pod} uid {uid} is already bound to node {read.node_name} (quorum read, etcd); {_STALE}",
        )
    if read.deletion_timestamp:
        return Decision(
            Verdict.TERMINATING,
            f"ghost pod: {pod} uid {uid} is terminating since {read.deletion_timestamp} (quorum read, etcd); {_STALE}",
        )
    return Decision(Verdict.ALIVE, f"pod {pod} uid {uid} confirmed pending by quorum read")
