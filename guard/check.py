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
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import orjson

from guard import metrics
from guard.cache import VerdictCache
from guard.settings import Settings
from guard.verdict import Decision, PodRef, QuorumRead, ReadStatus, Verdict, decide

log = logging.getLogger(__name__)

# Called once per newly seen ghost UID, off the request path.
GhostListener = Callable[[PodRef, Decision, QuorumRead], None]


class Checker:
    def __init__(self, settings: Settings, quorum_get: Callable[[str, str], QuorumRead]) -> None:
        self.settings = settings
        self._quorum_get = quorum_get
        self.cache = VerdictCache(self._timed_get, ghost_ttl=settings.ghost_ttl, ghost_size=settings.ghost_cache_size,
                                  read_ttl=settings.alive_ttl, read_size=settings.read_cache_size)
        self.listeners: list[GhostListener] = [print_new_ghost]
        self._background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ghost-followup")

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
            return cached
        metrics.CACHE_LOOKUPS.labels("ghosts", "miss").inc()
        read, hit = self.cache.read(pod.namespace, pod.name)
        metrics.CACHE_LOOKUPS.labels("reads", "hit" if hit else "miss").inc()
        decision = decide(pod, read)
        if decision.is_ghost and self.cache.remember_ghost(pod.uid, decision):
            metrics.GHOSTS_BLOCKED.labels(decision.verdict.value).inc()
            log.warning("%s", decision.reason)
            self._background.submit(self._notify, pod, decision, read)
        return decision

    def _notify(self, pod: PodRef, decision: Decision, read: QuorumRead) -> None:
        for listener in self.listeners:
            try:
                listener(pod, decision, read)
            except Exception:
                log.exception("ghost follow-up %s failed for %s", getattr(listener, "__name__", listener), pod)

    def close(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=False)


def print_new_ghost(pod: PodRef, decision: Decision, read: QuorumRead) -> None:
    """One JSON line on stdout per newly blocked ghost, for log shippers."""
    line = {
        "event": "ghost-blocked", "namespace": pod.namespace, "name": pod.name, "uid": pod.uid,
        "verdict": decision.verdict.value, "reason": decision.reason,
        "quorum_read": {"status": read.status.value, "http_status": read.http_status,
                        "uid": read.uid or None, "resource_version": read.resource_version or None},
        "time": time.time(),
    }
    if read.status is not ReadStatus.FOUND:
        del line["quorum_read"]["uid"]
    sys.stdout.write(orjson.dumps(line).decode() + "\n")
    sys.stdout.flush()
