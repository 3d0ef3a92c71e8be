"""The scheduling queue: activeQ, backoffQ and the unschedulable pool.

As pkg/scheduler/backend/queue/scheduling_queue.go: error backoff starts at
``pod_initial_backoff`` and doubles to ``pod_max_backoff``
(``calculateBackoffDuration``); backoffQ is flushed every
``backoff_flush_period`` (``flushBackoffQCompleted``); any cluster event moves
the unschedulable pool to activeQ or backoffQ
(``moveAllToActiveOrBackoffQueue``); pods left in the pool longer than
``pod_max_in_unschedulable`` are flushed (``flushUnschedulablePodsLeftover``);
a pod whose cycle saw a cluster event goes to backoffQ instead of the pool
(``AddUnschedulableIfNotPresent``, ``moveRequestCycle``).

The queue shares the scheduler's condition variable: it guards the
scheduler's informer stores and the queue together. Methods ending in
``_locked`` expect the caller to hold it; the others take it. ``clock`` is
``time.monotonic`` unless a test passes another.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from guard.lab.scheduler.config import Timings


@dataclasses.dataclass
class Queued:
    """One pending pod in the queue."""

    key: str
    uid: str
    where: str  # "active" | "backoff" | "unschedulable" | "inflight"
    timestamp: float  # when it last entered the queue (backoff counts from here)
    attempts: int = 0
    cycle: int = 0
    last_failure_unschedulable: bool = False


class SchedulingQueue:
    """Pending pods by ``namespace/name`` and where each one waits."""

    def __init__(self, timings: Timings, cond: threading.Condition, stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._timings = timings
        self._cond = cond
        self._stop = stop
        self._clock = clock
        self._items: dict[str, Queued] = {}
        self._cycle = 0
        self._move_request_cycle = -1
        self._next_backoff_flush = 0.0
        self._next_unschedulable_flush = 0.0

    def where_locked(self) -> dict[str, str]:
        """Where each pending pod is: ``active``, ``backoff``, ``unschedulable`` or ``inflight``."""
        return {key: q.where for key, q in self._items.items()}

    def get_locked(self, key: str) -> Queued | None:
        return self._items.get(key)

    def add_locked(self, key: str, uid: str) -> None:
        """A new pending pod goes to activeQ."""
        self._items[key] = Queued(key=key, uid=uid, where="active", timestamp=self._clock())
        self._cond.notify_all()

    def discard_locked(self, key: str) -> None:
        """Forget a pod that is gone or bound, unless a cycle holds it (the cycle ends it)."""
        queued = self._items.get(key)
        if queued is not None and queued.where != "inflight":
            del self._items[key]

    def backoff_expired(self, queued: Queued, now: float) -> bool:
        return now >= queued.timestamp + self._timings.backoff(queued.attempts)

    def requeue_locked(self, queued: Queued) -> None:
        """Out of the pool: to activeQ if its backoff is over, else to backoffQ."""
        queued.where = "active" if self.backoff_expired(queued, self._clock()) else "backoff"
        self._cond.notify_all()

    def move_all_locked(self) -> None:
        """moveAllToActiveOrBackoffQueue: every cluster event requeues the unschedulable pool."""
        self._move_request_cycle = self._cycle
        for queued in self._items.values():
            if queued.where == "unschedulable":
                self.requeue_locked(queued)

    def flush_locked(self, now: float) -> None:
        """The two flush tickers, when due: backoffQ to activeQ, pool leftovers out of the pool."""
        if now >= self._next_backoff_flush:  # flushBackoffQCompleted
            for queued in self._items.values():
                if queued.where == "backoff" and self.backoff_expired(queued, now):
                    queued.where = "active"
            self._next_backoff_flush = now + self._timings.backoff_flush_period
        if now >= self._next_unschedulable_flush:  # flushUnschedulablePodsLeftover
            for queued in self._items.values():
                if (queued.where == "unschedulable"
                        and now - queued.timestamp >= self._timings.pod_max_in_unschedulable):
                    self.requeue_locked(queued)
            self._next_unschedulable_flush = now + self._timings.unschedulable_flush_period

    def take_locked(self, priority: Callable[[str], int]) -> Queued | None:
        """The next pod from activeQ (highest ``priority(key)``, then oldest), now in flight; None if empty."""
        active = [q for q in self._items.values() if q.where == "active"]
        if not active:
            return None
        best = min(active, key=lambda q: (-priority(q.key), q.timestamp))
        best.where = "inflight"
        best.attempts += 1
        self._cycle += 1
        best.cycle = self._cycle
        return best

    def pop(self, priority: Callable[[str], int]) -> Queued | None:
        """Wait for the next pod from activeQ, running the flush tickers; None once stopped."""
        with self._cond:
            while not self._stop.is_set():
                now = self._clock()
                self.flush_locked(now)
                best = self.take_locked(priority)
                if best is not None:
                    return best
                self._cond.wait(max(0.001, min(self._next_backoff_flush, self._next_unschedulable_flush) - now))
        return None

    def done_locked(self, queued: Queued) -> None:
        """The cycle of ``queued`` ended the pod's stay (bound, gone, or not ours)."""
        if self._items.get(queued.key) is queued:
            del self._items[queued.key]

    def done(self, queued: Queued) -> None:
        with self._cond:
            self.done_locked(queued)

    def add_unschedulable_if_not_present(self, queued: Queued, unschedulable: bool) -> None:
        """AddUnschedulableIfNotPresent: errors go to backoffQ; unschedulable pods to the pool,
        or to backoffQ when a cluster event arrived during their cycle."""
        with self._cond:
            if self._items.get(queued.key) is not queued:
                return
            queued.timestamp = self._clock()
            queued.last_failure_unschedulable = unschedulable
            if unschedulable and self._move_request_cycle < queued.cycle:
                queued.where = "unschedulable"
            else:
                queued.where = "backoff"
            self._cond.notify_all()
