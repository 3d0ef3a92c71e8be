"""What a flood of forged ghosts may cost: budgets for the ghosts no replica ever showed, and the
order in which retention drops records. Pure: the caller passes the clock.

Anyone holding the scheduler's certificate can ask about a pod that does not exist. The answer
is right (etcd has no such pod: ``ghost-deleted``, the scheduler keeps it off every node), but
what a *first sighting* costs besides the answer (an audit record, a ``GhostPodBlocked`` Event
in the pod's namespace, a follow-up that asks etcd and probes every replica) must not be paid
for every name a caller invents. A ghost is sorted into one of three tiers:

- ``confirmed``: a replica probe saw a replica's watch cache serve this very identity;
- ``sighted``: some replica's cache listed this identity as pending (the pre-verifier's watch
  and listings, guard.engine.prepare): a real pod that existed, which a stale cache may still serve.
  Its number is bounded by the pods the cluster really had, not by what a caller sends;
- ``unsighted``: no replica ever showed it to this guard. Forged names land here, and so do
  real ghosts the guard had no view of (``--no-prepare``, or a pod created and deleted before
  the first listing).

Confirmed and sighted ghosts are never budgeted. An unsighted ghost's first sighting takes a
token from its namespace's bucket and one from the bucket all namespaces share
(:class:`FloodBudget`); without both it is *shed*: blocked all the same (the verdict is never
touched), but not recorded, no Event, no follow-up, counted. A later call for the same ghost
asks again, so a real ghost a scheduler keeps retrying is recorded once tokens are back.

Retention (``--audit-max-records``) drops unconfirmed records before confirmed ones, the least
recently seen first within each (:func:`prune_key`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable

from guard.core.token_bucket import TokenBucket
from guard.core.records import AuditRecord, ReplicaState

CONFIRMED, SIGHTED, UNSIGHTED = "confirmed", "sighted", "unsighted"
TIERS = (CONFIRMED, SIGHTED, UNSIGHTED)

# Why a first sighting was shed (the ``reason`` label of ghost_guard_flood_shed_total).
NAMESPACE_BUDGET, GLOBAL_BUDGET = "namespace-budget", "global-budget"
# A follow-up of an unsighted ghost dropped because the follow-up queue was full of them.
QUEUE_FULL = "queue-full"
SHED_REASONS = (NAMESPACE_BUDGET, GLOBAL_BUDGET, QUEUE_FULL)

# All namespaces together get this many times one namespace's budget.
GLOBAL_FACTOR = 10
# Namespaces whose buckets are remembered at most; the least recently used are forgotten (a
# forgotten namespace starts again with a full bucket, so the shared bucket is what bounds a
# flood spread over many namespaces).
MAX_NAMESPACES = 10_000


class FloodBudget:
    """Token buckets for the first sightings of unsighted ghosts: one per namespace (``rate`` per
    second, bursts of ``burst``) and one all namespaces share (``GLOBAL_FACTOR`` times both).

    Thread-safe. ``clock`` is monotonic seconds (time.monotonic; a fake clock in tests)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float], *,
                 max_namespaces: int = MAX_NAMESPACES) -> None:
        self.rate, self.burst = rate, burst
        self._clock = clock
        self._max = max_namespaces
        self._lock = threading.Lock()
        self._shared = TokenBucket(rate * GLOBAL_FACTOR, burst * GLOBAL_FACTOR, clock)
        self._namespaces: collections.OrderedDict[str, TokenBucket] = collections.OrderedDict()

    def admit(self, namespace: str) -> str | None:
        """None, with a token taken from the namespace's bucket and the shared one, or why not
        (``namespace-budget``, ``global-budget``; nothing taken)."""
        with self._lock:
            bucket = self._namespaces.get(namespace)
            if bucket is None:
                bucket = TokenBucket(self.rate, self.burst, self._clock)
                self._namespaces[namespace] = bucket
                if len(self._namespaces) > self._max:
                    self._namespaces.popitem(last=False)
            else:
                self._namespaces.move_to_end(namespace)
            if bucket.take() > 0:
                return NAMESPACE_BUDGET
            if self._shared.take() > 0:
                bucket.give_back()
                return GLOBAL_BUDGET
            return None


def confirmed(replicas: Iterable[ReplicaState]) -> bool:
    """Whether a probe ever saw a replica serve the ghost (the record names a replica)."""
    return any(r.first_seen_serving is not None for r in replicas)


def prune_key(record: AuditRecord) -> tuple[bool, float]:
    """Sort key of retention by count, most worth keeping first: confirmed records before
    unconfirmed ones, then the most recently seen. Records past ``--audit-max-records`` in this
    order are dropped."""
    return (not confirmed(record.replicas), -record.last_seen)
