"""One check of one pod: cache -> quorum GET -> verdict -> metrics and follow-ups.

``/filter``, ``/preempt`` and ``/validate/binding`` all call
:meth:`Checker.check`. It never raises: apiserver trouble and the guard's own
bugs both come back as an ``unknown`` decision, which the routes turn into a
pass (fail open, counted) unless ``--fail-closed``. Work that is not needed
for the answer (recording a new ghost) runs on a background thread, after the
answer.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from guard import metrics
from guard.core import flood
from guard.engine.cache import Flight, Read, VerdictCache
from guard.core.settings import Settings
from guard.core.verdict import Decision, PodRef, QuorumRead, Verdict, decide

log = logging.getLogger("guard.check")

FOLLOWUP_BACKLOG = 1000
FOLLOWUP_OVERFLOW = 100_000
# Shed first sightings remembered (so that the ghost's next call asks the budget again) at most.
MAX_SHED = 100_000

# Called once per newly seen ghost UID, off the request path.
GhostListener = Callable[[PodRef, Decision, QuorumRead], None]
# Called when a known ghost is blocked again (for bounded-rate re-probes), off the request path.
SightingListener = Callable[[PodRef, Decision], None]
# Called on the request path for every block of a ghost (the first one with its read, later ones with
# None): only for work that takes microseconds and never waits (queueing an audit record in memory).
BlockRecorder = Callable[[PodRef, Decision, "QuorumRead | None"], None]


@dataclass(frozen=True, slots=True)
class Joined:
    """A call that joined its pod's quorum GET in flight instead of waiting for it (Checker.join_flight)."""

    pod: PodRef
    flight: Flight


class Checker:
    def __init__(self, settings: Settings, quorum_get: Callable[[str, str, float], QuorumRead], *,
                 timer: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        self.settings = settings
        self._quorum_get = quorum_get
        self._timer = timer
        self.cache = VerdictCache(self._timed_get, ghost_ttl=settings.ghost_ttl, ghost_size=settings.ghost_cache_size,
                                  read_ttl=settings.alive_ttl, read_size=settings.read_cache_size,
                                  prepared_max_age=settings.prepared_max_age, prepared_grace=settings.prepared_grace,
                                  timer=timer)
        self.listeners: list[GhostListener] = []
        # Called at the start of every scheduler call (check), before its verdict: the pre-verifier
        # learns that this guard replica is the one being asked (guard.engine.prepare, --prepare-idle-after).
        self.call_hooks: list[Callable[[], None]] = []
        self.sighting_listeners: list[SightingListener] = []
        self.block_recorders: list[BlockRecorder] = []
        # Follow-ups run on two background threads; background=False runs them inline (deterministic tests).
        self._background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ghost-followup") if background else None
        # Follow-ups (audit, probes, Events) running or queued on the threads at most. Beyond, they wait
        # in an overflow keyed by pod identity: a second follow-up of the same kind for the same pod is
        # coalesced into the waiting one (counted), so a flood of distinct ghosts loses none and a looping
        # ghost takes one entry. Past FOLLOWUP_OVERFLOW identities they are dropped (counted), so memory
        # stays bounded. Verdicts are never affected.
        self._followup_slots = threading.BoundedSemaphore(FOLLOWUP_BACKLOG)
        self._overflow: collections.OrderedDict[tuple[str, PodRef], tuple[Sequence[Callable[..., None]], tuple[object, ...]]] = (
            collections.OrderedDict())
        self._overflow_lock = threading.Lock()
        # Sighting follow-ups queued or running, by pod: for a ghost no replica ever listed, one at a time,
        # the rest coalesced (counted), so a caller repeating a forged identity cannot fill the queue.
        self._sightings_pending: set[PodRef] = set()
        self._lanes: tuple[collections.deque[tuple[Sequence[Callable[..., None]], PodRef, tuple[object, ...]]], ...] = (
            collections.deque(), collections.deque())
        self._lanes_lock = threading.Lock()
        # What a first sighting costs besides the verdict (record, Event, follow-up), for ghosts no
        # replica ever listed (guard/core/flood.py). ``tier`` (set by guard.engine.wiring) says which tier a
        # ghost is in; None: every ghost is treated as sighted (nothing budgeted).
        self.tier: Callable[[PodRef], str] | None = None
        self.budget = flood.FloodBudget(settings.unsighted_ghost_rate, settings.unsighted_ghost_burst, timer)
        self._shed: collections.OrderedDict[PodRef, None] = collections.OrderedDict()
        self._shed_lock = threading.Lock()

    def _timed_get(self, namespace: str, name: str, timeout: float) -> QuorumRead:
        start = time.perf_counter()
        read = self._quorum_get(namespace, name, timeout)
        metrics.labelled(metrics.QUORUM_GET_DURATION, read.status.value).observe(time.perf_counter() - start)
        return read

    @property
    def timer(self) -> Callable[[], float]:
        """The clock of deadlines and caches (time.monotonic; a fake clock in tests)."""
        return self._timer

    def deadline(self, arrived: float | None = None) -> float:
        """The time (on this checker's timer) by which a request that arrived at ``arrived`` must be answered."""
        return (self._timer() if arrived is None else arrived) + self.settings.request_budget

    def check(self, pod: PodRef, *, deadline: float | None = None, record: bool = True) -> Decision:
        """The verdict for ``pod``, ready before ``deadline`` (default: the request budget from now).

        ``record=False`` (a dry-run admission review) has no side effects beyond the guard's own
        caches: no audit record, no Event, no incident.
        """
        if deadline is None:
            deadline = self.deadline()
        try:
            for hook in self.call_hooks:
                hook()
            decision = self._check(pod, deadline, record)
        except Exception:  # a bug of ours must never block a real pod
            log.exception("internal error while checking pod %s; failing open", pod)
            decision = Decision(Verdict.UNKNOWN, f"internal error while checking pod {pod}")
            metrics.labelled(metrics.VERDICTS, decision.verdict.value).inc()
            self._count_undecided("internal-error")
            return decision
        return self._handed_out(decision, deadline)

    def _handed_out(self, decision: Decision, deadline: float) -> Decision:
        """Count (and for ``unknown``, log) a verdict handed to a caller whose budget ends at ``deadline``."""
        metrics.labelled(metrics.VERDICTS, decision.verdict.value).inc()
        if decision.verdict is Verdict.UNKNOWN:
            self._count_undecided("budget" if self._timer() >= deadline else "apiserver")
            log.warning("%s; %s", decision.reason, "failing closed" if self.settings.fail_closed else "failing open")
        return decision

    def answer_prepared(self, pod: PodRef) -> Decision | None:
        """The verdict of a call that needs no waiting, or None with nothing done (the caller then
        goes through :meth:`check`): the ``alive`` verdict verified ahead for this identity's first
        attempt, as :meth:`check` would return it, counted the same way. For the worker's event loop,
        which must never wait (guard.serving.worker: a ghost, a miss, anything else goes to a pool thread)."""
        if self.cache.ghost(pod) is not None:
            return None
        prepared = self.cache.take_prepared(pod)
        if prepared is None:
            return None
        for hook in self.call_hooks:
            hook()
        metrics.labelled(metrics.CACHE_LOOKUPS, "ghosts", "miss").inc()
        metrics.VERDICTS_PREPARED.inc()
        metrics.labelled(metrics.VERDICTS, prepared.verdict.value).inc()
        return prepared

    def join_flight(self, pod: PodRef, wake: Callable[[], None]) -> Joined | None:
        """For the worker's event loop, after :meth:`answer_prepared` found nothing: when this pod's
        quorum GET is already in flight (a background verification's, or another call's), join it
        without waiting. ``wake`` is called, on the GET's thread, when it lands; then
        :meth:`answer_joined` gives the verdict. This is the start of :meth:`check` for a call that
        would wait for that GET (the call hooks run, the pod is marked asked); nothing is counted
        until the answer. None, with nothing done, when there is no such GET or a ghost is cached:
        the caller goes through :meth:`check`."""
        if self.cache.ghost(pod) is not None:
            return None
        flight = self.cache.join(pod.namespace, pod.name, wake)
        if flight is None:
            return None
        for hook in self.call_hooks:
            hook()
        self.cache.mark_asked(pod)
        return Joined(pod, flight)

    def answer_joined(self, joined: Joined, deadline: float) -> Decision | None:
        """The verdict of a call that joined a GET (:meth:`join_flight`), once it has landed, exactly
        as :meth:`check` gives it to a call that waited for the same GET, counted the same way:
        ``alive``, or ``unknown`` when the GET failed (fail open, or closed, as the settings say).
        None, with nothing counted, when the read alone cannot answer: a ghost (only a read begun after
        the call may condemn, and the first sighting is recorded; :meth:`check` does both), a pod a
        watch showed gone since before the read began, or a GET that has not landed. The caller then
        goes through :meth:`check`, within the same ``deadline``."""
        read = joined.flight.landed()
        if read is None:
            return None
        decision = decide(joined.pod, read.read)
        if decision.verdict is Verdict.ALIVE:
            gone_at = self.cache.gone_since(joined.pod)
            if gone_at and read.started <= gone_at:
                return None
        elif decision.verdict is not Verdict.UNKNOWN:
            return None
        metrics.labelled(metrics.CACHE_LOOKUPS, "ghosts", "miss").inc()
        metrics.labelled(metrics.CACHE_LOOKUPS, "reads", "hit").inc()
        metrics.VERDICTS_SHARED.inc()
        return self._handed_out(decision, deadline)

    def blocks(self, decision: Decision) -> bool:
        """Whether the scheduler must keep this pod off every node."""
        return decision.is_ghost or (decision.verdict is Verdict.UNKNOWN and self.settings.fail_closed)

    def _count_undecided(self, reason: str) -> None:
        metrics.labelled(metrics.FAIL_CLOSED if self.settings.fail_closed else metrics.FAIL_OPEN, reason).inc()

    def _check(self, pod: PodRef, deadline: float, record: bool) -> Decision:
        known_at = self.cache.tick()  # the guard knows this identity from here on
        cached = self.cache.ghost(pod)
        if cached is not None:
            metrics.labelled(metrics.CACHE_LOOKUPS, "ghosts", "hit").inc()
            if record:
                self._scheduled_ghost(pod, cached)
            return cached
        metrics.labelled(metrics.CACHE_LOOKUPS, "ghosts", "miss").inc()
        prepared = self.cache.take_prepared(pod)
        if prepared is not None:
            metrics.VERDICTS_PREPARED.inc()
            return prepared
        self.cache.mark_asked(pod)
        decision, read = self._verify(pod, known_at, deadline)
        (metrics.VERDICTS_INLINE if read.own else metrics.VERDICTS_SHARED).inc()
        if decision.is_ghost and record:
            self._scheduled_ghost(pod, decision, read.read)
        return decision

    def verify(self, pod: PodRef, known_at: int, *, prepare: bool = True) -> Decision | None:
        """Background verification (guard.engine.prepare) of a pod the guard has known since tick ``known_at``
        (the watch event that showed it). With ``prepare``, an ``alive`` verdict is kept for the pod's
        first scheduling attempt; sweeps of already-known pods pass ``prepare=False``.

        A ghost found here is cached but not announced: most are pods deleted normally
        before their verification ran. The caller announces it (:meth:`announce`) when a
        replica still lists it. Goes through the same single-flight read cache, so a
        /filter call that arrives while this GET is in flight waits for it. Returns None,
        without a GET, for a new pod the scheduler already asked about (verified inline).
        """
        known = self.cache.ghost(pod)
        if known is not None:
            return known
        if prepare and self.cache.was_asked(pod):
            return None
        decision, _ = self._verify(pod, known_at, self._timer() + self.settings.get_timeout)
        metrics.labelled(metrics.PREPARE_VERIFIED, decision.verdict.value).inc()
        if prepare and decision.verdict is Verdict.ALIVE and pod.uid:
            self.cache.prepare(pod, decision)
        return decision

    def _verify(self, pod: PodRef, known_at: int, deadline: float) -> tuple[Decision, Read]:
        """The verdict and the read behind it. A ghost is only decided by a read that began after
        ``known_at`` (the tick at which the guard knew this UID): a read cached or in flight from
        before may pass the pod, never condemn it, so the name is read again past every cache."""
        read = self.cache.read(pod.namespace, pod.name, timeout=self._left(deadline))
        metrics.labelled(metrics.CACHE_LOOKUPS, "reads", "miss" if read.own else "hit").inc()
        decision = decide(pod, read.read)
        gone_at = self.cache.gone_since(pod) if decision.verdict is Verdict.ALIVE else 0
        if gone_at and read.started <= gone_at:
            # A read from before the delete (shared in flight or cached) contradicts what a watch
            # already showed: ask etcd again with a read that began after the watch showed it.
            read = self.cache.read(pod.namespace, pod.name, timeout=self._left(deadline), not_before=gone_at)
            decision = decide(pod, read.read)
        elif decision.is_ghost and read.started <= known_at:
            # The read began before the guard knew this UID (a 404 of the pod that had this name
            # before, a generation of another UID): it may not condemn. Ghosts are rare; one more GET.
            read = self.cache.read(pod.namespace, pod.name, timeout=self._left(deadline), not_before=known_at)
            decision = decide(pod, read.read)
        if decision.is_ghost and not self.cache.remember_ghost(pod, decision, read, known_at):
            if pod.uid:  # cannot happen by construction; if it did, pass the pod rather than condemn it
                log.error("ghost verdict for %s uid %s from a read older than the UID refused", pod, pod.uid)
                decision = Decision(Verdict.UNKNOWN, f"internal error: stale read for pod {pod}")
        return decision, read

    def _left(self, deadline: float) -> float:
        return deadline - self._timer()

    def retract(self, pod: PodRef) -> bool:
        """Etcd shows this identity pending after all: withdraw its ghost verdict at once. True if there was one."""
        withdrawn = self.cache.forget_ghost(pod)
        if withdrawn:
            metrics.VERDICTS_RETRACTED.inc()
            log.error("ghost verdict for %s uid %s withdrawn: etcd has it pending", pod, pod.uid)
        return withdrawn

    def announce(self, pod: PodRef) -> bool:
        """A cached ghost matters (a replica still serves it): record it once. True the first time."""
        entry = self.cache.announce(pod)
        if entry is None or not entry.first:
            return False
        self._first_sighting(pod, entry.decision, entry.read)
        return True

    def _scheduled_ghost(self, pod: PodRef, decision: Decision, read: QuorumRead | None = None) -> None:
        """A scheduler (or a binding) tried to place this ghost: announce it once, then count sightings."""
        entry = self.cache.announce(pod)
        if entry is None:  # no UID to remember it by: announce every time
            self._first_sighting(pod, decision, read or QuorumRead.not_found())
        elif entry.first:
            self._first_sighting(pod, entry.decision, entry.read)
        elif self._shed and pod in self._shed:  # shed at its first sighting: ask the budget again
            self._first_sighting(pod, entry.decision, entry.read)
        else:
            self._record_block(pod, entry.decision, None)
            if self.sighting_listeners:
                self._followup(self.sighting_listeners, pod, entry.decision)

    def _admitted(self, pod: PodRef) -> bool:
        """Whether this first sighting gets its record, Event and follow-up: always for a ghost some
        replica listed or served; for one no replica ever showed, if the flood budget has a token for
        its namespace (guard/core/flood.py). A shed one is remembered, so its next call asks again."""
        tier = self.tier(pod) if self.tier is not None else flood.SIGHTED
        reason = self.budget.admit(pod.namespace) if tier == flood.UNSIGHTED else None
        with self._shed_lock:
            if reason is None:
                self._shed.pop(pod, None)
                return True
            self._shed[pod] = None
            if len(self._shed) > MAX_SHED:
                self._shed.popitem(last=False)
        metrics.labelled(metrics.FLOOD_SHED, reason).inc()
        log.debug("ghost %s uid %s shed (%s): no replica ever listed it; blocked, not recorded", pod, pod.uid, reason)
        return False

    def _first_sighting(self, pod: PodRef, decision: Decision, read: QuorumRead) -> None:
        if not self._admitted(pod):
            return
        metrics.labelled(metrics.GHOSTS_BLOCKED, decision.verdict.value).inc()
        log.warning("%s", decision.reason)
        self._record_block(pod, decision, read)
        self._followup(self.listeners, pod, decision, read)

    def _record_block(self, pod: PodRef, decision: Decision, read: QuorumRead | None) -> None:
        """The block recorders, inline: a record queued here survives a full follow-up queue and an exit."""
        for recorder in self.block_recorders:
            try:
                recorder(pod, decision, read)
            except Exception:
                log.exception("block recorder %s failed for %s", getattr(recorder, "__name__", recorder), pod)

    def _followup(self, listeners: Sequence[Callable[..., None]], pod: PodRef, *args: object) -> None:
        """Call each of ``listeners`` (GhostListener or SightingListener) with ``pod, *args``, off the request path."""
        sighting = listeners is not self.listeners
        if sighting:
            with self._overflow_lock:
                if pod in self._sightings_pending and self.tier is not None and self.tier(pod) == flood.UNSIGHTED:
                    metrics.FOLLOWUPS_COALESCED.inc()
                    return
                self._sightings_pending.add(pod)
        if self._followup_slots.acquire(blocking=False):
            self._submit(listeners, pod, args)
            return
        key = ("sighting" if sighting else "new", pod)
        with self._overflow_lock:
            if key in self._overflow:
                metrics.FOLLOWUPS_COALESCED.inc()
                if key[0] == "sighting":  # the newest sighting's decision; a first sighting keeps its read
                    self._overflow[key] = (listeners, args)
                return
            if len(self._overflow) >= FOLLOWUP_OVERFLOW and not self._make_room(pod):
                metrics.FOLLOWUPS_DROPPED.inc()
                if sighting:
                    self._sightings_pending.discard(pod)
                return
            self._overflow[key] = (listeners, args)
        self._drain()  # a slot may have been released since the acquire failed

    def _make_room(self, pod: PodRef) -> bool:
        """The overflow is full (under ``_overflow_lock``): drop the oldest waiting follow-up of a ghost
        no replica ever listed to make room for ``pod``'s, unless ``pod`` is one too. True if room was made."""
        if self.tier is None or self.tier(pod) == flood.UNSIGHTED:
            if self.tier is not None:
                metrics.labelled(metrics.FLOOD_SHED, flood.QUEUE_FULL).inc()
            return False
        for key in self._overflow:
            if self.tier(key[1]) == flood.UNSIGHTED:
                del self._overflow[key]
                if key[0] == "sighting":
                    self._sightings_pending.discard(key[1])
                metrics.FOLLOWUPS_DROPPED.inc()
                metrics.labelled(metrics.FLOOD_SHED, flood.QUEUE_FULL).inc()
                return True
        return False

    def _submit(self, listeners: Sequence[Callable[..., None]], pod: PodRef, args: tuple[object, ...]) -> None:
        """Run the follow-up on a slot already taken; the slot goes back (and the overflow moves) when done."""
        if self._background is None:
            try:
                self._notify(listeners, pod, *args)
            finally:
                self._followup_slots.release()
            self._drain()
            return
        # Two lanes: a ghost some replica listed or served goes ahead of every ghost none ever showed, so
        # the follow-ups a flood of forged names was admitted for never delay a real ghost's.
        lane = 1 if self.tier is not None and self.tier(pod) == flood.UNSIGHTED else 0
        with self._lanes_lock:
            self._lanes[lane].append((listeners, pod, args))
        future = self._background.submit(self._run_next)
        future.add_done_callback(self._followup_done)

    def _run_next(self) -> None:
        """One follow-up task: the oldest of the first lane, else of the second (one queued per task)."""
        with self._lanes_lock:
            listeners, pod, args = (self._lanes[0] or self._lanes[1]).popleft()
        self._notify(listeners, pod, *args)

    def _followup_done(self, _future: object) -> None:
        self._followup_slots.release()
        self._drain()

    def _drain(self) -> None:
        while True:
            with self._overflow_lock:
                if not self._overflow or not self._followup_slots.acquire(blocking=False):
                    return
                (_, pod), (listeners, args) = self._overflow.popitem(last=False)
            self._submit(listeners, pod, args)

    def followups_waiting(self) -> int:
        """Follow-ups waiting in the overflow (beyond the running and queued ones)."""
        with self._overflow_lock:
            return len(self._overflow)

    def _notify(self, listeners: Sequence[Callable[..., None]], pod: PodRef, *args: object) -> None:
        if listeners is not self.listeners:
            with self._overflow_lock:
                self._sightings_pending.discard(pod)
        for listener in listeners:
            try:
                listener(pod, *args)
            except Exception:
                log.exception("ghost follow-up %s failed for %s", getattr(listener, "__name__", listener), pod)
