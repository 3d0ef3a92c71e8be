"""Verdict state, thread-safe: every verdict belongs to one pod identity.

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

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import cachetools

from guard.core.verdict import Decision, PodRef, QuorumRead, ReadStatus

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
