"""The audit record: what both audit stores keep of a blocked ghost, and the rules every field obeys.

Pure: no I/O and no clock. The one module to open to change what a record holds:

- the record types: :class:`AuditRecord` (one blocked ghost Pod), :class:`ReplicaState`
  (one apiserver replica's newest cache probe for it), :class:`HealAttempt` (one heal);
- the vocabularies and limits of their fields (verdicts, heal actions and outcomes,
  lengths, the evidence's 4 KiB) and the checks that enforce them (:func:`check_text`,
  :func:`check_time`, :func:`evidence_json`);
- the evidence of a block (:func:`block_evidence`: the verdict's reason and the quorum read);
- the errors a store raises (:class:`AuditError` and its kinds);
- :data:`NewRecordHook`, how a store tells its caller that a record is new.

The stores map these onto their own storage: the SQLite tables in ``guard.audit.sqlite`` (its
``SCHEMA_VERSION`` and migrations), the GhostPod objects in ``guard.audit.ghostpods`` (and the CRD in
``manifests/crd``). ``guard.core.rendering`` renders them; ``guard.audit.backend.AuditBackend`` is the
interface both stores offer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from guard.core.attribution import ReplicaObservation
from guard.core.names import hidden
from guard.core.verdict import Decision, QuorumRead, Verdict

VERDICTS: Final = tuple(v.value for v in Verdict)
"""Every verdict string (``guard.core.verdict.Verdict``); the stores accept only these."""

MAX_UID: Final = 128
MAX_NAMESPACE: Final = 63
MAX_NAME: Final = 253
MAX_REPLICA: Final = 512
MAX_RESOURCE_VERSION: Final = 64
MAX_ERROR: Final = 512
MAX_EVIDENCE_BYTES: Final = 4096

HEAL_ACTIONS: Final = ("placeholder", "annotate", "none")
HEAL_OUTCOMES: Final = ("healed", "frozen", "refused", "failed", "alive", "timeout")
MAX_HEALS_PER_GHOST: Final = 20  # the newest attempts kept per ghost
MAX_HEAL_DETAIL: Final = 1024


class AuditError(Exception):
    """The store cannot be opened, read or written. Chained to the cause (``sqlite3``, ``OSError``, the apiserver)."""


class UnknownGhostError(AuditError, LookupError):
    """A probe for a UID the store has no record of (``record_block`` first)."""


class IdentityConflictError(AuditError):
    """A block of a UID the store has recorded under another namespace/name. A verdict belongs to
    one pod identity: the record is never moved or merged (only a forged call names a UID under a
    name that is not its own)."""


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What the store knows about one replica for one ghost.

    ``serves``/``cache_resource_version``/``error``/``last_checked`` are the
    newest probe. ``first_seen_serving`` is when the replica was first seen
    serving the ghost (since its last heal); ``healed_at`` is when a later
    probe found it no longer serving it (``None`` while it still does).
    """

    replica: str
    serves: bool | None
    cache_resource_version: str | None
    error: str | None
    last_checked: float
    first_seen_serving: float | None
    healed_at: float | None

    @property
    def stale(self) -> bool:
        """Seen serving the ghost and not seen healed since (a failed probe changes neither)."""
        return self.first_seen_serving is not None and self.healed_at is None

    def observation(self) -> ReplicaObservation:
        """The newest probe as an :class:`~guard.core.attribution.ReplicaObservation`."""
        return ReplicaObservation(
            replica=self.replica,
            serves_ghost=self.serves,
            cache_resource_version=self.cache_resource_version,
            error=self.error,
            checked_at=self.last_checked,
        )


@dataclass(frozen=True, slots=True)
class HealAttempt:
    """One heal of a ghost (``ghost-guard serve --heal``): what was written and how it ended."""

    at: float
    action: str  # one of HEAL_ACTIONS
    outcome: str  # one of HEAL_OUTCOMES
    detail: str


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One blocked ghost Pod, deduplicated by UID."""

    uid: str
    namespace: str
    name: str
    verdict: str
    evidence: Mapping[str, Any]
    first_seen: float
    last_seen: float
    times_blocked: int
    replicas: tuple[ReplicaState, ...] = field(default=())
    retracted_at: float | None = None  # the verdict was withdrawn: etcd showed the pod pending after all
    heals: tuple[HealAttempt, ...] = field(default=())  # oldest first, at most MAX_HEALS_PER_GHOST

    @property
    def stale_replicas(self) -> list[str]:
        """Replicas seen serving this ghost and not healed since, sorted."""
        return sorted(r.replica for r in self.replicas if r.stale)


NewRecordHook = Callable[[AuditRecord], None]
"""Called by a store with a record new to it (its first block), once per pod identity across every
process sharing the store: the SQLite store after the commit that inserted the row, the GhostPod
store after the create that made the object. The caller that opened the store decides what to do
with it (``guard.engine.incident`` writes the new-ghost line to stdout); the store never renders it."""


def block_evidence(decision: Decision, read: QuorumRead | None) -> dict[str, Any]:
    """What a record keeps of one block (docs/OPERATIONS.md, ``evidence``): the verdict's reason and, for
    the block that made the verdict, what the quorum GET answered as ``quorum_get`` (``None`` for what etcd
    did not say). Later blocks (``read`` None) carry the reason only: the store merges keys, so the first
    read is kept."""
    if read is None:
        return {"reason": decision.reason}
    got: dict[str, Any] = {
        "outcome": read.status.value, "http_status": read.http_status,
        "uid": read.uid or None, "node_name": read.node_name or None,
        "deletion_timestamp": read.deletion_timestamp or None, "resource_version": read.resource_version or None}
    if read.placeholder:  # the pod found is ghost-guard's own heal placeholder: named as such, never a replacement
        got["heal_placeholder"] = True
    return {"reason": decision.reason, "quorum_get": got}


def check_text(label: str, value: object, max_len: int) -> None:
    """ValueError unless ``value`` is a string of 1 to ``max_len`` characters without control, bidirectional
    or other invisible characters (guard.core.names.hidden)."""
    if not isinstance(value, str):
        raise ValueError(f"{label} must be a string, not {type(value).__name__}")
    if not value or len(value) > max_len:
        raise ValueError(f"{label} must be 1 to {max_len} characters, got {len(value)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{label} must not contain control characters")
    if not value.isascii() and any(hidden(c) for c in value):  # U+202E and the like: what a reader sees is not what is there
        raise ValueError(f"{label} must not contain bidirectional, format or other invisible characters")


def check_time(label: str, value: object) -> float:
    """``value`` as seconds since the epoch; ValueError unless it is a finite, non-negative number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{label} must be a finite, non-negative number of seconds since the epoch, not {value!r}")
    return float(value)


def evidence_json(evidence: object, *, strict: bool = True) -> str | None:
    """Validated evidence as compact JSON; with ``strict=False``, None instead of an error for oversize."""
    if not isinstance(evidence, Mapping):
        raise ValueError(f"evidence must be a JSON object, not {type(evidence).__name__}")
    try:
        text = json.dumps(dict(evidence), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"evidence must be JSON-serialisable: {e}") from e
    size = len(text.encode())
    if size > MAX_EVIDENCE_BYTES:
        if not strict:
            return None
        raise ValueError(f"evidence must be at most {MAX_EVIDENCE_BYTES} bytes of JSON, got {size}")
    return text
