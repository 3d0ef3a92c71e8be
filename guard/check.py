"""One check of one pod: cache -> quorum GET -> verdict -> metrics and follow-ups.

``/filter``, ``/preempt`` and ``/validate/binding`` all call
:meth:`Checker.check`. It never raises: apiserver trouble and the guard's own
bugs both come back as an ``unknown`` decision, which the routes turn into a
pass (fail open, counted) unless ``--fail-closed``. Work that is not needed
for the answer (recording a new ghost) runs on a background thread, after the
answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from guard import metrics
from guard.cache import VerdictCache
from guard.settings import Settings
from guard.verdict import Decision, PodRef, QuorumRead, Verdict, decide

log = logging.getLogger(__name__)

FOLLOWUP_BACKLOG = 1000

# Called once per newly seen ghost UID, off the request path.
GhostListener = Callable[[PodRef, Decision, QuorumRead], None]
# Called when a known ghost is blocked again (for bounded-rate re-probes), off the request path.
SightingListener = Callable[[PodRef, Decision], None]


class Checker:
    def __init__(self, settings: Settings, quorum_get: Callable[[str, str], QuorumRead]) -> None:
        self.settings = settings
        self._quorum_get = quorum_get
        self.cache = VerdictCache(self._timed_get, ghost_ttl=settings.ghost_ttl, ghost_size=settings.ghost_cache_size,
                                  read_ttl=settings.alive_ttl, read_size=settings.read_cache_size,
                                  prepared_max_age=settings.prepared_max_age, prepared_grace=settings.prepared_grace)
        self.listeners: list[GhostListener] = []
        self.sighting_listeners: list[SightingListener] = []
        self._background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ghost-followup")
        # Follow-ups (audit, probes, Events) waiting at most; beyond, they are dropped and counted, so a
        # flood of distinct ghosts can never grow memory without bound. Verdicts are never affected.
        self._followup_slots = threading.BoundedSemaphore(FOLLOWUP_BACKLOG)

    def _timed_get(self, namespace: str, name: str) -> QuorumRead:
        start = time.perf_counter()
        read = self._quorum_get(namespace, name)
        metrics.QUORUM_GET_DURATION.labels(read.status.value).observe(time.perf_counter() - start)
        return read

    def check(self, pod: PodRef) -> Decision:
        try:
            decision = self._check(pod)
        except Exception:  # a bug of ours must never block a real pod
            log.exception("internal error while checking pod %s; failing open", pod)
            decision = Decision(Verdict.UNKNOWN, f"internal error while checking pod {pod}")
            metrics.VERDICTS.labels(decision.verdict.value).inc()
            self._count_undecided("internal-error")
            return decision
        metrics.VERDICTS.labels(decision.verdict.value).inc()
        if decision.verdict is Verdict.UNKNOWN:
            self._count_undecided("apiserver")
            log.warning("%s; %s", decision.reason, "failing closed" if self.settings.fail_closed else "failing open")
        return decision

    def blocks(self, decision: Decision) -> bool:
        """Whether the scheduler must keep this pod off every node."""
        return decision.is_ghost or (decision.verdict is Verdict.UNKNOWN and self.settings.fail_closed)

    def _count_undecided(self, reason: str) -> None:
        (metrics.FAIL_CLOSED if self.settings.fail_closed else metrics.FAIL_OPEN).labels(reason).inc()

    def _check(self, pod: PodRef) -> Decision:
        cached = self.cache.ghost(pod.uid)
        if cached is not None:
            metrics.CACHE_LOOKUPS.labels("ghosts", "hit").inc()
            self._scheduled_ghost(pod, cached)
            return cached
        metrics.CACHE_LOOKUPS.labels("ghosts", "miss").inc()
        prepared = self.cache.take_prepared(pod.uid)
        if prepared is not None:
            metrics.VERDICTS_PREPARED.inc()
            return prepared
        self.cache.mark_asked(pod.uid)
        decision, read, shared = self._verify(pod)
        (metrics.VERDICTS_SHARED if shared else metrics.VERDICTS_INLINE).inc()
        if decision.is_ghost:
            self._scheduled_ghost(pod, decision, read)
        return decision

    def verify(self, pod: PodRef, *, prepare: bool = True) -> Decision | None:
        """Background verification (guard.prepare). With ``prepare``, an ``alive`` verdict is kept
        for the pod's first scheduling attempt; sweeps of already-known pods pass ``prepare=False``.

        A ghost found here is cached but not announced: most are pods deleted normally
        before their verification ran. The caller announces it (:meth:`announce`) when a
        replica still lists it. Goes through the same single-flight read cache, so a
        /filter call that arrives while this GET is in flight waits for it. Returns None,
        without a GET, for a new pod the scheduler already asked about (verified inline).
        """
        known = self.cache.ghost(pod.uid)
        if known is not None:
            return known
        if prepare and self.cache.was_asked(pod.uid):
            return None
        decision, _, _ = self._verify(pod)
        metrics.PREVERIFIED.labels(decision.verdict.value).inc()
        if prepare and decision.verdict is Verdict.ALIVE and pod.uid:
            self.cache.prepare(pod.uid, decision)
        return decision

    def _verify(self, pod: PodRef) -> tuple[Decision, QuorumRead, bool]:
        """The verdict, the read behind it, and whether that read was shared (no GET of this call's own)."""
        read, hit = self.cache.read(pod.namespace, pod.name)
        metrics.CACHE_LOOKUPS.labels("reads", "hit" if hit else "miss").inc()
        decision = decide(pod, read)
        if decision.verdict is Verdict.ALIVE and self.cache.seen_gone(pod.uid):
            # A read from before the delete (shared in flight or cached) contradicts what a watch
            # already showed: ask etcd again, past the cache.
            read, hit = self._timed_get(pod.namespace, pod.name), False
            decision = decide(pod, read)
        if decision.is_ghost:
            self.cache.remember_ghost(pod.uid, decision, read)
        return decision, read, hit

    def announce(self, pod: PodRef) -> bool:
        """A cached ghost matters (a replica still serves it): record it once. True the first time."""
        entry = self.cache.announce(pod.uid)
        if entry is None or not entry[2]:
            return False
        self._first_sighting(pod, entry[0], entry[1])
        return True

    def _scheduled_ghost(self, pod: PodRef, decision: Decision, read: QuorumRead | None = None) -> None:
        """A scheduler (or a binding) tried to place this ghost: announce it once, then count sightings."""
        entry = self.cache.announce(pod.uid)
        if entry is None:  # no UID to remember it by: announce every time
            self._first_sighting(pod, decision, read or QuorumRead.not_found())
        elif entry[2]:
            self._first_sighting(pod, entry[0], entry[1])
        elif self.sighting_listeners:
            self._followup(self.sighting_listeners, pod, entry[0])

    def _first_sighting(self, pod: PodRef, decision: Decision, read: QuorumRead) -> None:
        metrics.GHOSTS_BLOCKED.labels(decision.verdict.value).inc()
        log.warning("%s", decision.reason)
        self._followup(self.listeners, pod, decision, read)

    def _followup(self, listeners: list, pod: PodRef, *args) -> None:
        if not self._followup_slots.acquire(blocking=False):
            metrics.FOLLOWUPS_DROPPED.inc()
            return
        future = self._background.submit(self._notify, listeners, pod, *args)
        future.add_done_callback(lambda _: self._followup_slots.release())

    def _notify(self, listeners: list, pod: PodRef, *args) -> None:
        for listener in listeners:
            try:
                listener(pod, *args)
            except Exception:
                log.exception("ghost follow-up %s failed for %s", getattr(listener, "__name__", listener), pod)
