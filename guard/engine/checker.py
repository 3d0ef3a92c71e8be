"""One check of one pod: cache -> quorum GET -> verdict -> metrics and follow-ups.

``/filter``, ``/preempt`` and ``/validate/binding`` all go through
:meth:`Checker.answer`, the one entry: it answers now, joins the pod's quorum
GET in flight (the worker's event loop, which never waits), or says that the
answer needs a thread; a call is counted in one place (:meth:`Checker._count`)
whichever way it was answered. It never raises: apiserver trouble and the
guard's own bugs both come back as an ``unknown`` decision, which the routes
turn into a pass (fail open, counted) unless ``--fail-closed``. Work that is
not needed for the answer (recording a new ghost) runs on a background thread,
after the answer.

The checker and its verdict state (:class:`VerdictCache`, below) are one module: a call that
misses goes from the checker into the state and to the quorum GET, with no module between them.

**The verdict state** (:class:`VerdictCache`), thread-safe: every verdict belongs to one pod identity.

A pod identity is (namespace, name, UID): a :class:`~guard.core.verdict.PodRef`.
Every piece of verdict state here (ghost verdicts, prepared verdicts, asked
marks, the watch's gone marks) is keyed by all three, so a call that names a
UID under another name (a recreated StatefulSet pod, a hostile caller) never
reuses it.

The rooms:

- **ghosts**, by identity, long TTL, bounded: a ghost verdict is permanent
  for its identity (a deleted UID never comes back, ``nodeName`` is never
  unset, a ``deletionTimestamp`` never removed), so a looping ghost costs no
  apiserver call.
- **reads**, quorum-read results by namespace/name, short TTL (default 0.5 s,
  below kube-scheduler's 1 s initial backoff), with single flight: 50
  concurrent calls for one pod make one GET. A read is *of a name*, not a
  verdict. The watch drops a name's reads when it shows that name ADDED or
  DELETED; a read that was in flight then is handed to those already waiting
  for it but never stored.
- **prepared**, ``alive`` verdicts made in the background before the
  scheduler asks (guard.engine.prepare), by identity, bounded age. One serves the
  pod's *first* scheduling attempt, and calls within ``grace`` seconds of it;
  a later attempt means a bind may have failed, so it is verified again. A
  DELETED seen on any replica drops it at once.

**The invariant** (docs/ARCHITECTURE.md): a ghost is condemned only by a read
that *began after the guard knew that UID* (the call's arrival, or the watch
event that showed the UID). Reads carry the tick at which they began
(:meth:`VerdictCache.tick`, a logical clock: strictly increasing, so "after"
is exact and needs no wall clock); a read from before may pass a pod, never
condemn it, and :meth:`VerdictCache.remember_ghost` refuses one.
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, overload

import cachetools
from prometheus_client import Counter

from guard import metrics
from guard.core import flood
from guard.engine.followups import FollowUps
from guard.core.settings import Settings
from guard.core.verdict import Decision, PodRef, QuorumRead, ReadStatus, Verdict, decide

log = logging.getLogger("guard.check")

FOLLOWUP_BACKLOG = 1000
FOLLOWUP_OVERFLOW = 100_000
# Shed first sightings remembered (so that the ghost's next call asks the budget again) at most.
MAX_SHED = 100_000

class CheckerEvents(Protocol):
    """What the checker tells the rest of the running guard, and the one thing it asks: one object,
    given to the Checker at construction (:class:`Events`; the running guard's is built by
    guard.engine.wiring). A method that fails is logged, never the call's answer."""

    def called(self) -> None:
        """A scheduler call arrived, before its verdict (the pre-verifier learns that this guard
        replica is the one being asked, --prepare-idle-after). On the request path: microseconds."""

    def record_block(self, pod: PodRef, decision: Decision, read: QuorumRead | None) -> None:
        """Every block of a ghost, on the request path (the first one with its read, later ones with
        None): only work that takes microseconds and never waits (queueing an audit record in memory)."""

    def new_ghost(self, pod: PodRef, decision: Decision, read: QuorumRead) -> None:
        """Once per newly seen ghost UID, off the request path."""

    def sighting(self, pod: PodRef, decision: Decision) -> None:
        """A known ghost blocked again (for bounded-rate re-probes), off the request path."""

    def tier(self, pod: PodRef) -> str | None:
        """The ghost's tier (guard/core/flood.py); None: no tiers, every ghost treated as sighted."""


def _nothing(*args: object) -> None:
    return None


def _no_tier(pod: PodRef) -> str | None:
    return None


@dataclass(frozen=True, slots=True)
class Events:
    """A :class:`CheckerEvents` made of functions, each nothing unless given (``Events()`` hears
    nothing: a checker on its own). The running guard's is built by guard.engine.wiring from the
    pre-verifier's and the incident recorder's methods, called directly: no module between."""

    called: Callable[[], None] = _nothing
    record_block: Callable[[PodRef, Decision, QuorumRead | None], None] = _nothing
    new_ghost: Callable[[PodRef, Decision, QuorumRead], None] = _nothing
    sighting: Callable[[PodRef, Decision], None] = _nothing
    tier: Callable[[PodRef], str | None] = _no_tier


class Pending(enum.Enum):
    """What :meth:`Checker.answer` says when it cannot answer in the event loop (``now=True``)."""

    # The call joined its pod's quorum GET in flight: ``wake`` is called, on the GET's thread, when
    # it lands; then the same call is asked again (``now=True``).
    JOINED = "joined"
    # The answer may wait on the apiserver (a miss), or records a ghost: ask again from a thread.
    THREAD = "thread"


@dataclass(slots=True)
class Call:
    """One call's pod on its way through :meth:`Checker.answer`: the pod, the end of its budget (on
    the checker's timer), whether a ghost's block is recorded (False for a dry-run review), and the
    quorum GET in flight it joined, if it did (set by :meth:`Checker.answer`)."""

    pod: PodRef
    deadline: float
    record: bool = True
    flight: Flight | None = None


class Checker:
    """``events``: who hears the checker (a :class:`CheckerEvents`), or a function that makes it from
    the checker, called once at the end of construction (the pre-verifier and the incident recorder
    are built on the checker they hear)."""

    def __init__(self, settings: Settings, quorum_get: Callable[[str, str, float], QuorumRead], *,
                 events: CheckerEvents | Callable[[Checker], CheckerEvents] | None = None,
                 timer: Callable[[], float] = time.monotonic, background: bool = True) -> None:
        self.settings = settings
        self._quorum_get = quorum_get
        self._timer = timer
        self.cache = VerdictCache(self._timed_get, ghost_ttl=settings.ghost_ttl, ghost_size=settings.ghost_cache_size,
                                  read_ttl=settings.alive_ttl, read_size=settings.read_cache_size,
                                  prepared_max_age=settings.prepared_max_age, prepared_grace=settings.prepared_grace,
                                  timer=timer)
        # The counters of a call (_count, the one place a call is counted), bound once: the hot path
        # looks no label up.
        self._ghost_hit = metrics.labelled(metrics.CACHE_LOOKUPS, "ghosts", "hit")
        self._ghost_miss = metrics.labelled(metrics.CACHE_LOOKUPS, "ghosts", "miss")
        self._read_hit = metrics.labelled(metrics.CACHE_LOOKUPS, "reads", "hit")
        self._read_miss = metrics.labelled(metrics.CACHE_LOOKUPS, "reads", "miss")
        self._verdicts = {v: metrics.labelled(metrics.VERDICTS, v.value) for v in Verdict}
        undecided = metrics.FAIL_CLOSED if settings.fail_closed else metrics.FAIL_OPEN
        self._undecided = {r: metrics.labelled(undecided, r) for r in ("budget", "apiserver", "internal-error")}
        # Follow-ups (audit, probes, Events) off the request path, bounded and coalesced by pod identity
        # (guard/engine/followups.py); a ghost some replica listed or served goes ahead of every ghost
        # none ever showed. background=False runs them inline (deterministic tests).
        self.followups: FollowUps[PodRef] = FollowUps(
            backlog=FOLLOWUP_BACKLOG, overflow=FOLLOWUP_OVERFLOW, background=background, low=self._unsighted,
            shed=lambda: metrics.labelled(metrics.FLOOD_SHED, flood.QUEUE_FULL).inc())
        # What a first sighting costs besides the verdict (record, Event, follow-up), for ghosts no
        # replica ever listed (guard/core/flood.py). ``events.tier`` says which tier a ghost is in; None:
        # every ghost is treated as sighted (nothing budgeted).
        self.budget = flood.FloodBudget(settings.unsighted_ghost_rate, settings.unsighted_ghost_burst, timer)
        self._shed: collections.OrderedDict[PodRef, None] = collections.OrderedDict()
        self._shed_lock = threading.Lock()
        # Last: a function that makes the events from this checker gets it whole.
        self.events: CheckerEvents = (Events() if events is None else
                                      events(self) if callable(events) else events)

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

    def call(self, pod: PodRef, arrived: float | None = None, *, record: bool = True) -> Call:
        """A :class:`Call` for ``pod`` whose budget began at ``arrived`` (on this checker's timer; default now)."""
        return Call(pod, (self._timer() if arrived is None else arrived) + self.settings.request_budget, record)

    @overload
    def answer(self, call: Call) -> Decision: ...

    @overload
    def answer(self, call: Call, *, now: Literal[True],
               wake: Callable[[], None] | None = None) -> Decision | Pending: ...

    def answer(self, call: Call, *, now: bool = False, wake: Callable[[], None] | None = None) -> Decision | Pending:
        """The one way through the checker: the verdict for ``call.pod``, ready before ``call.deadline``.

        From a thread (``now`` False): always a Decision; it may wait for a quorum GET. From the
        worker's event loop (``now`` True), which must never wait: the Decision when it needs no
        waiting (an ``alive`` verdict verified ahead; a joined GET that has landed and can answer
        alone), else :attr:`Pending.JOINED` (``wake`` given and the pod's GET in flight: joined,
        ``wake`` is called when it lands, then ask again with ``now``) or :attr:`Pending.THREAD`
        (ask again from a thread with the same Call, its deadline unchanged: the worker hands the
        decoded call on, never decoding it again). Nothing is counted until a Decision is handed
        out (:meth:`_count`).

        Never raises: apiserver trouble and the guard's own bugs come back ``unknown`` (fail open,
        counted, unless ``--fail-closed``). ``call.record`` False (a dry-run review) has no side
        effects beyond the guard's own caches: no audit record, no Event, no incident.
        """
        pod = call.pod
        try:
            if call.flight is not None and not now:
                # A joined call a pool thread took over (its GET could not answer it, or had not landed
                # with the budget nearly out): the whole way from here, as any thread's call.
                call.flight = None
            if call.flight is not None:  # joined a GET in flight (the event loop), woken when it landed
                read = call.flight.landed()
                if read is None:
                    return Pending.THREAD
                decision, again = self._judge(pod, read, known_at=read.started)
                # A ghost is condemned only by a read begun after the call (and its first sighting is
                # recorded): a thread does both. So does a read that a watch contradicts.
                if again or decision.is_ghost:
                    return Pending.THREAD
                return self._count(decision, call.deadline, self._ghost_miss, self._read_hit, metrics.VERDICTS_SHARED)
            known_at = 0 if now else self.cache.tick()  # the guard knows this identity from here on
            self.events.called()
            cached = self.cache.ghost(pod)
            if cached is not None:
                if now:
                    return Pending.THREAD
                if call.record:
                    self._scheduled_ghost(pod, cached)
                return self._count(cached, call.deadline, self._ghost_hit)
            prepared = self.cache.take_prepared(pod)
            if prepared is not None:
                return self._count(prepared, call.deadline, self._ghost_miss, metrics.VERDICTS_PREPARED)
            if now:
                flight = self.cache.join(pod.namespace, pod.name, wake) if wake is not None else None
                if flight is None:
                    return Pending.THREAD
                self.cache.mark_asked(pod)
                call.flight = flight
                return Pending.JOINED
            self.cache.mark_asked(pod)
            decision, first, read = self._verify(pod, known_at, call.deadline)
            if decision.is_ghost and call.record:
                self._scheduled_ghost(pod, decision, read.read)
            return self._count(decision, call.deadline, self._ghost_miss, self._read_miss if first else self._read_hit,
                               metrics.VERDICTS_INLINE if read.own else metrics.VERDICTS_SHARED)
        except Exception:  # a bug of ours must never block a real pod
            log.exception("internal error while checking pod %s; failing open", pod)
            self._verdicts[Verdict.UNKNOWN].inc()
            self._undecided["internal-error"].inc()
            return Decision(Verdict.UNKNOWN, f"internal error while checking pod {pod}")

    def _count(self, decision: Decision, deadline: float, *counters: Counter) -> Decision:
        """The one place a call is counted: how it was answered (``counters``), its verdict, and for
        ``unknown`` why (fail open, or closed) and a log line. Returns ``decision``."""
        for counter in counters:
            counter.inc()
        self._verdicts[decision.verdict].inc()
        if decision.verdict is Verdict.UNKNOWN:
            self._undecided["budget" if self._timer() >= deadline else "apiserver"].inc()
            log.warning("%s; %s", decision.reason, "failing closed" if self.settings.fail_closed else "failing open")
        return decision

    def blocks(self, decision: Decision) -> bool:
        """Whether the scheduler must keep this pod off every node (a ghost, or unknown with --fail-closed)."""
        verdict = decision.verdict
        return verdict is not Verdict.ALIVE and (verdict is not Verdict.UNKNOWN or self.settings.fail_closed)

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
        decision, first, _ = self._verify(pod, known_at, self._timer() + self.settings.get_timeout)
        (self._read_miss if first else self._read_hit).inc()
        metrics.labelled(metrics.PREPARE_VERIFIED, decision.verdict.value).inc()
        if prepare and decision.verdict is Verdict.ALIVE and pod.uid:
            self.cache.prepare(pod, decision)
        return decision

    def _judge(self, pod: PodRef, read: Read, known_at: int) -> tuple[Decision, int]:
        """decide() on ``read``, and 0 when the read may stand, else the tick a new read must begin
        after: a pod a watch showed gone since before the read began may not be passed by it, and a
        ghost may be condemned only by a read begun after ``known_at`` (the guard knew the UID)."""
        decision = decide(pod, read.read)
        if decision.verdict is Verdict.ALIVE:
            gone_at = self.cache.gone_since(pod)
            if gone_at and read.started <= gone_at:
                return decision, gone_at
        elif decision.is_ghost and read.started <= known_at:
            return decision, known_at
        return decision, 0

    def _verify(self, pod: PodRef, known_at: int, deadline: float) -> tuple[Decision, bool, Read]:
        """The verdict, whether its first read was this caller's own GET, and the read behind it.

        A read cached or in flight from before ``known_at`` (a 404 of the pod that had this name
        before, a generation of another UID) may pass the pod, never condemn it; and a read from
        before a watch showed the pod gone contradicts what etcd's event stream already said. In
        both cases etcd is asked again with a read that began after that tick (ghosts are rare:
        one more GET)."""
        read = self.cache.read(pod.namespace, pod.name, timeout=self._left(deadline))
        first = read.own
        decision, again = self._judge(pod, read, known_at)
        if again:
            read = self.cache.read(pod.namespace, pod.name, timeout=self._left(deadline), not_before=again)
            decision = decide(pod, read.read)
        if decision.is_ghost and not self.cache.remember_ghost(pod, decision, read, known_at):
            if pod.uid:  # cannot happen by construction; if it did, pass the pod rather than condemn it
                log.error("ghost verdict for %s uid %s from a read older than the UID refused", pod, pod.uid)
                decision = Decision(Verdict.UNKNOWN, f"internal error: stale read for pod {pod}")
        return decision, first, read

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
            self._followup(True, self.events.sighting, pod, entry.decision)

    def _admitted(self, pod: PodRef) -> bool:
        """Whether this first sighting gets its record, Event and follow-up: always for a ghost some
        replica listed or served; for one no replica ever showed, if the flood budget has a token for
        its namespace (guard/core/flood.py). A shed one is remembered, so its next call asks again."""
        tier = self.events.tier(pod) or flood.SIGHTED
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
        self._followup(False, self.events.new_ghost, pod, decision, read)

    def _record_block(self, pod: PodRef, decision: Decision, read: QuorumRead | None) -> None:
        """The block recorded inline (events.record_block): a record queued here survives a full
        follow-up queue and an exit."""
        recorder = self.events.record_block
        try:
            recorder(pod, decision, read)
        except Exception:
            log.exception("block recorder %s failed for %s", getattr(recorder, "__name__", recorder), pod)

    def _followup(self, sighting: bool, event: Callable[..., None], pod: PodRef, *args: object) -> None:
        """Call ``event`` (events.new_ghost, or with ``sighting`` events.sighting) with ``pod, *args``, off
        the request path. A ghost no replica ever listed has one sighting follow-up at a time, the rest
        coalesced (counted), so a caller repeating a forged identity cannot fill the queue."""
        self.followups.submit("sighting" if sighting else "new", pod, self._notify, event, pod, *args,
                              once=sighting, newest=sighting)

    def _unsighted(self, pod: PodRef) -> bool | None:
        """Whether no replica ever showed this ghost (None: no tiers, every ghost treated alike)."""
        tier = self.events.tier(pod)
        return None if tier is None else tier == flood.UNSIGHTED

    def followups_waiting(self) -> int:
        """Follow-ups waiting in the overflow (beyond the running and queued ones)."""
        return self.followups.waiting()

    @staticmethod
    def _notify(event: Callable[..., None], pod: PodRef, *args: object) -> None:
        try:
            event(pod, *args)
        except Exception:
            log.exception("ghost follow-up %s failed for %s", getattr(event, "__name__", event), pod)


# --- the verdict state -------------------------------------------------------------------------

# fetch(namespace, name, timeout_seconds) -> QuorumRead
Fetch = Callable[[str, str, float], QuorumRead]


class Read(NamedTuple):
    """A quorum read of a name, when it began (a tick), and whether this caller made the GET itself."""

    read: QuorumRead
    started: int
    own: bool


@dataclass(frozen=True, slots=True)
class Announcement:
    """A cached ghost: its verdict, the read that proved it, and whether this is its first announcement.
    A record, not a tuple: read by field name only."""

    decision: Decision
    read: QuorumRead
    first: bool


class _Ghost:
    __slots__ = ("decision", "read", "announced")

    def __init__(self, decision: Decision, read: QuorumRead) -> None:
        self.decision = decision
        self.read = read
        self.announced = False


class _Prepared:
    __slots__ = ("decision", "first_used")

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self.first_used: float | None = None


class _Stored:
    __slots__ = ("read", "started")

    def __init__(self, read: QuorumRead, started: int) -> None:
        self.read = read
        self.started = started


class Flight:
    """One quorum GET in flight for a name; ``valid`` goes False when the watch invalidates the name.

    A caller that must not wait (the worker's event loop) joins it with :meth:`VerdictCache.join`
    and is woken when it lands; :meth:`landed` then gives the read."""

    __slots__ = ("done", "result", "started", "valid", "wakes")

    def __init__(self, started: int) -> None:
        self.done = threading.Event()
        self.result: QuorumRead | None = None
        self.started = started
        self.valid = True
        self.wakes: list[Callable[[], None]] = []

    def landed(self) -> Read | None:
        """The read, shared (``own`` False), once the GET has landed; None before."""
        result = self.result
        return None if result is None else Read(result, self.started, False)


def budget_exhausted(budget: float) -> QuorumRead:
    """The read of a call whose request budget ran out before etcd answered."""
    return QuorumRead.failed(f"request budget exhausted (no quorum read answered within {budget:g}s)")


class VerdictCache:
    def __init__(self, fetch: Fetch, *, ghost_ttl: float, ghost_size: int, read_ttl: float, read_size: int,
                 prepared_max_age: float = 300.0, prepared_size: int = 100_000, prepared_grace: float = 0.5,
                 timer: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._timer = timer
        self._ticks = itertools.count(1)
        self._tick_lock = threading.Lock()
        self._prepared: cachetools.TTLCache = cachetools.TTLCache(prepared_size, prepared_max_age, timer=timer)
        self._prepared_lock = threading.Lock()
        self._asked: cachetools.TTLCache = cachetools.TTLCache(prepared_size, prepared_max_age, timer=timer)
        # Identities a replica's watch showed deleted, bound or terminating: facts from etcd's event stream
        # (a stale cache misses events, it never invents them), so no verdict may call them alive.
        self._gone: cachetools.TTLCache = cachetools.TTLCache(prepared_size, prepared_max_age, timer=timer)
        self._grace = prepared_grace
        self._ghosts: cachetools.TTLCache = cachetools.TTLCache(ghost_size, ghost_ttl, timer=timer)
        self._ghost_lock = threading.Lock()
        self._reads: cachetools.TTLCache = cachetools.TTLCache(read_size, read_ttl, timer=timer)
        self._flights: dict[tuple[str, str], Flight] = {}
        self._read_lock = threading.Lock()

    # -- the logical clock --------------------------------------------------------------------

    def tick(self) -> int:
        """A point in the guard's order of events: taken when a UID becomes known and when a read begins."""
        with self._tick_lock:
            return next(self._ticks)

    # -- ghosts ----------------------------------------------------------------------------

    def ghost(self, pod: PodRef) -> Decision | None:
        if not pod.uid or not self._ghosts:  # no ghost cached at all (nearly always): no lookup
            return None
        with self._ghost_lock:
            entry = self._ghosts.get(pod)
            return entry.decision if entry is not None else None

    def remember_ghost(self, pod: PodRef, decision: Decision, read: Read, known_at: int) -> bool:
        """Store a ghost verdict and the read that proved it (an existing entry is kept).

        Refused (False) unless the read began after ``known_at``, the tick at which the guard knew
        the UID: a read from before (cached, or in flight) may have answered for a pod that had
        that name before this one.
        """
        if not pod.uid or read.started <= known_at:
            return False
        with self._ghost_lock:
            if pod not in self._ghosts:
                self._ghosts[pod] = _Ghost(decision, read.read)
        return True

    def forget_ghost(self, pod: PodRef) -> bool:
        """Withdraw a ghost verdict (etcd showed the identity pending after all). True if there was one."""
        with self._ghost_lock:
            return self._ghosts.pop(pod, None) is not None

    def announce(self, pod: PodRef) -> Announcement | None:
        """The ghost's verdict and read, and whether this is the first announcement of it
        (a ghost found in the background is only announced once something shows it matters)."""
        with self._ghost_lock:
            entry = self._ghosts.get(pod)
            if entry is None:
                return None
            first = not entry.announced
            entry.announced = True
            return Announcement(entry.decision, entry.read, first)

    # -- prepared verdicts, asked and gone marks ---------------------------------------------

    def prepare(self, pod: PodRef, decision: Decision) -> bool:
        """Keep a background-verified ``alive`` verdict for the pod's first scheduling attempt.

        Refused (False) for an identity already seen gone: its GET may have been answered just
        before the delete, and the DELETED event may have arrived before this call. Refused as well
        for one a scheduler has asked about already: that first attempt shared this GET, and a
        later attempt must read etcd again (a failed bind may be what sends it back).
        """
        with self._prepared_lock:
            if pod in self._gone or pod in self._asked:
                return False
            self._prepared[pod] = _Prepared(decision)
            return True

    def gone(self, pod: PodRef) -> bool:
        """A replica's watch showed this pod deleted, bound or terminating: remember that, drop its
        prepared verdict and the name's quorum reads. True if there was a prepared verdict."""
        seen = self.tick()
        with self._prepared_lock:
            seen = self._gone.setdefault(pod, seen)  # the first replica to show it gone sets the tick
            had = self._prepared.pop(pod, None) is not None
        self.invalidate_name(pod.namespace, pod.name, before=seen)
        return had

    def gone_since(self, pod: PodRef) -> int:
        """The tick at which a watch first showed this pod gone, or 0."""
        with self._prepared_lock:
            return self._gone.get(pod, 0)

    def mark_asked(self, pod: PodRef) -> None:
        """A scheduler has asked about this pod: background verification of it is moot."""
        if pod.uid:
            with self._prepared_lock:
                self._asked[pod] = True

    def was_asked(self, pod: PodRef) -> bool:
        with self._prepared_lock:
            return pod in self._asked

    def take_prepared(self, pod: PodRef) -> Decision | None:
        """The prepared verdict if this call is the first attempt (or within the grace of it), else None.

        A call after the grace is a later attempt: the entry is dropped so the caller verifies again.
        """
        if not pod.uid:
            return None
        now = self._timer()
        with self._prepared_lock:
            entry = self._prepared.get(pod)
            if entry is None:
                return None
            if entry.first_used is None:
                entry.first_used = now
                return entry.decision
            if now - entry.first_used <= self._grace:
                return entry.decision
            del self._prepared[pod]
            return None

    # -- quorum reads by name ------------------------------------------------------------------

    def invalidate_name(self, namespace: str, name: str, *, before: int | None = None) -> None:
        """The watch showed this name ADDED or DELETED: drop its cached read, and let a read in flight
        finish for those waiting on it without being stored. With ``before`` (the tick at which the
        guard first learned of that change), reads that began after it are kept: they already saw it."""
        key = (namespace, name)
        with self._read_lock:
            stored = self._reads.get(key)
            if stored is not None and (before is None or stored.started <= before):
                del self._reads[key]
            flight = self._flights.get(key)
            if flight is not None and (before is None or flight.started <= before):
                del self._flights[key]
                flight.valid = False

    def join(self, namespace: str, name: str, wake: Callable[[], None]) -> Flight | None:
        """Join the quorum GET in flight for namespace/name without waiting for it: ``wake`` is called
        once, on the GET's own thread, right after it lands (it must be quick and must not raise).
        None, with nothing joined, when no GET of the name is in flight (or the watch has invalidated
        the one that is: a read begun before a change the guard saw is not worth joining)."""
        with self._read_lock:
            flight = self._flights.get((namespace, name))
            if flight is None:
                return None
            flight.wakes.append(wake)
            return flight

    def read(self, namespace: str, name: str, *, timeout: float, not_before: int = 0) -> Read:
        """The quorum read of namespace/name: a cached one, one in flight (waited for, at most
        ``timeout`` seconds), or a GET of this caller's own (single flight per name).

        Only a read that began after tick ``not_before`` is reused; pass the tick at which the UID
        became known to get a read that may condemn it.
        """
        key = (namespace, name)
        with self._read_lock:
            stored = self._reads.get(key)
            if stored is not None and stored.started > not_before:
                return Read(stored.read, stored.started, False)
            flight = self._flights.get(key)
            own = flight is None or flight.started <= not_before
            if own:
                flight = Flight(self.tick())
                self._flights[key] = flight
        assert flight is not None
        if not own:
            if not flight.done.wait(max(timeout, 0.0)) or flight.result is None:
                return Read(budget_exhausted(timeout), flight.started, False)
            return Read(flight.result, flight.started, False)
        try:
            result = self._fetch(namespace, name, timeout) if timeout > 0 else budget_exhausted(timeout)
        except Exception as e:  # the fetch translates client errors; anything else must not strand waiters
            result = QuorumRead.failed(f"internal error: {type(e).__name__}")
        with self._read_lock:
            flight.result = result
            if self._flights.get(key) is flight:
                del self._flights[key]
            if flight.valid and result.status is not ReadStatus.ERROR:
                stored = self._reads.get(key)
                if stored is None or stored.started < flight.started:
                    self._reads[key] = _Stored(result, flight.started)
            wakes, flight.wakes = flight.wakes, []
        flight.done.set()
        for wake in wakes:
            try:
                wake()
            except Exception:  # a closed event loop: its parked call is gone with it
                pass
        return Read(result, flight.started, True)
