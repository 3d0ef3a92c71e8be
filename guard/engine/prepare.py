"""Pre-verification: verdicts ready before kube-scheduler asks.

kube-scheduler calls the extender inside its serial scheduling cycle, so a
quorum GET there costs the whole cluster throughput. The guard therefore
watches unscheduled pods (``fieldSelector=spec.nodeName=``) itself, like an
informer, and quorum-verifies each newly seen pod UID in the background
(bounded concurrency, rate limited). The ``alive`` verdict then waits in the
cache for the pod's first ``/filter`` or ``/preempt`` call (guard.engine.checker.VerdictCache).

What it costs the control plane is one watch stream for the whole cluster,
whatever the number of apiserver and guard replicas:

- **One watch, only while called.** Only the guard replica being asked
  verifies ahead (``--prepare-idle-after``, 60 s): the Deployment runs two
  guards and the sidecar mode one per control-plane node, but only the one the
  leading scheduler's connection reaches is called. That guard watches *one*
  apiserver replica (the first, by address, whose cache answers; it moves when
  that replica stops answering and another answers). A guard with no
  scheduler call (``/filter``, ``/preempt``, ``/validate/binding``:
  ``Checker.check``) within that time is *idle*: no watch, no quorum GET for
  new pods.
- **Every replica listed.** The per-replica views (guard.engine.replica_views,
  which the missing-pod and frozen-replica checks of guard.engine.cache_health
  read too, with ``--no-prepare`` as well) list each other replica's cache
  (``resourceVersion=0``, served from its watch cache) every few seconds, idle
  or not, less often as the backlog grows: a cost per second, not per pod. The
  pre-verifier is their listener: it hears each pod a view shows or drops,
  and says whether one replica is watched.
- A ``DELETED`` (or a ``deletionTimestamp``) seen by the watch, or a pod that
  left a replica's listing, drops the prepared verdict at once.
- The first call after idle (a *takeover*, also the first call after start) is
  answered inline, as any call without a prepared verdict, and queues the
  pending pods the idle listings showed (oldest first, the scheduler's own
  order) for background verification; the watch then starts with a listing of
  its replica, which queues whatever is newer. A backlog finds its verdicts
  ready again after the first few calls.
- The views are also the sweeper: every ``--sweep-interval`` they are
  compared; a UID that one replica still shows while another, complete view
  does not is verified again (rate limited). A ghost found that way is
  recorded and attributed before any scheduler is stuck on it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import cachetools

from guard import metrics
from guard.core.settings import Settings
from guard.core.token_bucket import TokenBucket
from guard.core.verdict import PodRef
from guard.engine.background import Background
from guard.engine.checker import Checker
from guard.engine.replica_views import ReplicaViews
from guard.engine.replicas import ReplicaPool

log = logging.getLogger("guard.prepare")

# Pods waiting for background verification at most (a re-list of a huge backlog is rate limited).
MAX_QUEUE = 100_000
_WAKE = None  # in the verify queue: wakes a verifier for a takeover or the end


class Preparer:
    """Verifies new pods ahead (one per :meth:`verify_next`), the listener of its own replica views
    (``self.views``, guard.engine.replica_views): whether one replica is watched, each pod a view shows
    or drops, and the sweep after their rounds."""

    def __init__(self, settings: Settings, pool: ReplicaPool, checker: Checker,
                 sweep_hooks: list[Callable[[], None]] | None = None,
                 timer: Callable[[], float] | None = None) -> None:
        self.settings = settings
        self._timer = timer or checker.timer
        self.sweep_hooks = sweep_hooks or []
        self.pool = pool
        self.checker = checker
        self.views = ReplicaViews(settings, pool, checker.cache.tick, listener=self)
        # --verify-qps: the background quorum GETs per second, in bursts of as many (at least one).
        self._limiter = TokenBucket(settings.verify_qps, max(1.0, settings.verify_qps), time.monotonic)
        # (pod, from a sweep, the tick at which the guard knew it), or _WAKE. A SimpleQueue: the
        # hand-off from the watch to a waiting verifier is done in C (a Condition's was ~10 us more).
        self._queue: queue.SimpleQueue[tuple[PodRef, bool, int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._suspects: set[PodRef] = set()
        self._bg = Background(log)
        self._stop = self._bg.stop
        self._last_sweep = time.monotonic()
        # Idle or active (--prepare-idle-after): when a scheduler call last arrived (None: never),
        # whether a takeover waits for a verification thread, and the pods seen while idle
        # (pod -> the tick at which the guard knew it), in the order they were seen.
        self._last_call: float | None = None
        self._takeover = False
        self._backlog: dict[PodRef, int] = {}
        self._queued: cachetools.TTLCache = cachetools.TTLCache(500_000, settings.prepared_max_age)
        self.takeovers = 0

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        metrics.PREPARE_ACTIVE.set(1 if self.active() else 0)
        for i in range(self.settings.verify_concurrency):
            self._bg.thread(f"ghost-verify-{i}", self._verify_loop)
        self._last_sweep = time.monotonic()
        # The replicas' views made before the worker serves (discovery, on this thread), so that /readyz
        # shows them from its first answer; then the views' own thread.
        self.views.replicas_changed(self.pool.clients(), [])
        self.views.start()

    def close(self) -> None:
        self._bg.close()
        for _ in range(self.settings.verify_concurrency):
            self._queue.put(_WAKE)
        self.views.close()

    # -- the views' listener (guard.engine.replica_views.ViewListener) ---------------------------

    def round(self) -> None:
        """After each round of the views: the gauges; the sweep (and its hooks) every --sweep-interval."""
        metrics.PREPARE_ACTIVE.set(1 if self.active() else 0)
        metrics.PREPARE_BACKLOG.set(len(self._backlog))
        if time.monotonic() - self._last_sweep >= self.settings.sweep_interval:
            self._last_sweep = time.monotonic()
            self.sweep()
            for hook in self.sweep_hooks:
                hook()

    def seen(self, pod: PodRef, known_at: int, *, added: bool) -> None:
        """A view shows ``pod`` pending: while active, a pod not yet queued is queued for verification;
        while idle it is kept for the next takeover. ``added`` (new to that view): the name's reads that
        began before the guard knew this UID are dropped (later replicas' ADDED for the same UID leave
        newer reads alone)."""
        self._seen_pod(pod, known_at)
        if added:
            self.checker.cache.invalidate_name(pod.namespace, pod.name, before=known_at)

    def gone(self, pod: PodRef) -> None:
        """``pod`` left a view: no verdict may call this identity alive, and the name's cached reads are dropped."""
        self.checker.cache.gone(pod)
        if self._backlog:
            with self._lock:
                self._backlog.pop(pod, None)

    # -- verification -------------------------------------------------------------------

    def _seen_pod(self, pod: PodRef, known_at: int) -> None:
        with self._lock:
            if pod in self._queued:
                return
            if not self.active():
                if pod not in self._backlog:
                    if len(self._backlog) >= MAX_QUEUE:  # its first call verifies inline
                        metrics.PREPARE_DROPPED.inc()
                    else:
                        self._backlog[pod] = known_at
                        metrics.PREPARE_DEFERRED.inc()
                return
            self._backlog.pop(pod, None)
            self._queued[pod] = True
        self._enqueue(pod, swept=False, known_at=known_at)

    # -- idle or active (--prepare-idle-after) ----------------------------------------------

    def active(self) -> bool:
        """Whether this guard verifies new pods ahead: a scheduler call arrived within
        ``--prepare-idle-after`` (always, when that is 0)."""
        idle_after = self.settings.prepare_idle_after
        if idle_after <= 0:
            return True
        last = self._last_call
        return last is not None and self._timer() - last < idle_after

    def called(self) -> None:
        """A scheduler call reached this guard (the Checker's ``called`` event, before its verdict). The first one
        after idle is a takeover: a verification thread queues the backlog (:meth:`verify_next`),
        off the call's path; the call itself is answered inline if no verdict is prepared."""
        now = self._timer()
        last, self._last_call = self._last_call, now
        idle_after = self.settings.prepare_idle_after
        if idle_after > 0 and (last is None or now - last >= idle_after):
            self._takeover = True
            self._queue.put(_WAKE)
            metrics.PREPARE_ACTIVE.set(1)

    def _take_backlog(self) -> int:
        """Queue the pods seen while idle, oldest first (kube-scheduler's queue order for equal
        priorities). Pods that are gone were dropped from the backlog by the listings."""
        with self._lock:
            backlog = sorted(self._backlog.items(), key=lambda item: item[1])
            self._backlog.clear()
            for pod, _ in backlog:
                self._queued[pod] = True
            self.takeovers += 1
        metrics.PREPARE_TAKEOVERS.inc()
        for pod, known_at in backlog:
            self._enqueue(pod, swept=False, known_at=known_at)
        log.info("scheduler calls arrived after an idle spell: verifying ahead again, %d pending pod(s) the "
                 "listings hold queued for background verification", len(backlog))
        return len(backlog)

    def idle_status(self) -> dict:
        """For /readyz: whether verifying ahead, since when the last call came, the backlog."""
        last = self._last_call
        return {"active": self.active(), "idle_after": self.settings.prepare_idle_after,
                "last_call_seconds_ago": None if last is None else round(self._timer() - last, 3),
                "backlog": len(self._backlog), "queued": self._queue.qsize(), "takeovers": self.takeovers}

    def _enqueue(self, pod: PodRef, *, swept: bool, known_at: int | None = None) -> None:
        if known_at is None:
            known_at = self.checker.cache.tick()
        if self._queue.qsize() >= MAX_QUEUE:  # the scheduler's call still verifies inline
            metrics.PREPARE_DROPPED.inc()
            return
        self._queue.put((pod, swept, known_at))

    def _claim_takeover(self) -> bool:
        """Whether a takeover is due, claimed for this thread (one thread queues the backlog)."""
        if not self._takeover:
            return False
        with self._lock:
            takeover, self._takeover = self._takeover, False
        return takeover

    def _verify_loop(self) -> None:
        while not self._stop.is_set():
            self.verify_next(wait=1.0)

    def verify_next(self, *, wait: float = 0.0) -> bool:
        """Verify the next queued pod (waiting up to ``wait`` seconds for one), after queueing the
        backlog when a takeover is due. False if there was none."""
        if self._claim_takeover():
            self._take_backlog()
        try:
            item = self._queue.get(timeout=wait) if wait > 0 and not self._stop.is_set() else self._queue.get_nowait()
            if item is _WAKE:  # a takeover to do, or the end
                if self._claim_takeover():
                    self._take_backlog()
                item = self._queue.get_nowait()
        except queue.Empty:
            return False
        if item is _WAKE or self._stop.is_set():
            return False
        pod, swept, known_at = item
        while (wait := self._limiter.take()) > 0:
            if self._stop.wait(wait):  # stopping: no token needed any more
                return False
        try:
            # A new pod gets a prepared verdict for its first attempt. A ghost found then is
            # usually a pod deleted before its turn came: cached, not announced. One found by
            # the sweep (a replica has kept listing it) is a stale cache: announced.
            decision = self.checker.verify(pod, known_at, prepare=not swept)
            if decision is not None and decision.is_ghost and swept:
                self.checker.announce(pod)
        except Exception:
            log.exception("background verification of %s failed", pod)
        return True

    # -- the sweep --------------------------------------------------------------------------

    def sweep(self) -> list[PodRef]:
        """Verify the pods on which replicas disagreed in this sweep *and* the previous one.

        Requiring two sweeps in a row keeps mere watch lag (milliseconds) from
        looking like a stale cache.
        """
        current = set(self.views.disagreements())
        persistent = [pod for pod in current if pod in self._suspects]
        self._suspects = current
        queued = []
        for pod in persistent:
            if self.checker.cache.ghost(pod) is None:
                self._enqueue(pod, swept=True)
                queued.append(pod)
            else:
                self.checker.announce(pod)  # verified as gone before, and a replica still lists it
        return queued
