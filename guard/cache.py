"""Verdict caches (cachetools), thread-safe, with per-key single flight.

Two rooms:

- **ghosts**, by pod UID, long TTL, bounded: a ghost verdict is permanent for
  its UID (a deleted UID never comes back), so a looping ghost costs no
  apiserver call.
- **reads**, quorum-read results by namespace/name, short TTL (default 0.5 s,
  below kube-scheduler's 1 s initial backoff): it absorbs bursts (50 concurrent
  calls for one pod make one GET) but a pod that comes back on a later
  scheduling attempt is read again, because coming back means its bind may have
  failed.
- **prepared**, ``alive`` verdicts made in the background before the scheduler
  asks (guard.prepare), by UID, bounded age. One serves the pod's *first*
  scheduling attempt, and calls within ``grace`` seconds of it; a later
  attempt means a bind may have failed, so it is verified again. A DELETED
  seen on any replica drops it at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import cachetools
from cachetools.keys import hashkey

from guard.verdict import Decision, QuorumRead


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


class VerdictCache:
    def __init__(self, fetch: Callable[[str, str], QuorumRead], *, ghost_ttl: float, ghost_size: int,
                 read_ttl: float, read_size: int, prepared_max_age: float = 300.0, prepared_size: int = 100_000,
                 prepared_grace: float = 0.5, timer: Callable[[], float] = time.monotonic) -> None:
        self._timer = timer
        self._prepared: cachetools.TTLCache = cachetools.TTLCache(prepared_size, prepared_max_age, timer=timer)
        self._prepared_lock = threading.Lock()
        self._asked: cachetools.TTLCache = cachetools.TTLCache(prepared_size, prepared_max_age, timer=timer)
        # UIDs a replica's watch showed deleted, bound or terminating: facts from etcd's event stream
        # (a stale cache misses events, it never invents them), so no verdict may call them alive.
        self._gone: cachetools.TTLCache = cachetools.TTLCache(prepared_size, prepared_max_age, timer=timer)
        self._grace = prepared_grace
        self._ghosts: cachetools.TTLCache = cachetools.TTLCache(ghost_size, ghost_ttl, timer=timer)
        self._ghost_lock = threading.Lock()
        self._reads: cachetools.TTLCache = cachetools.TTLCache(read_size, read_ttl, timer=timer)
        self._local = threading.local()
        cond = threading.Condition()

        def fetch_and_mark(namespace: str, name: str) -> QuorumRead:
            self._local.fetched = True
            return fetch(namespace, name)

        self._read = cachetools.cached(self._reads, key=hashkey, lock=cond, condition=cond)(fetch_and_mark)

    def ghost(self, uid: str) -> Decision | None:
        if not uid:
            return None
        with self._ghost_lock:
            entry = self._ghosts.get(uid)
            return entry.decision if entry is not None else None

    def remember_ghost(self, uid: str, decision: Decision, read: QuorumRead) -> None:
        """Store a ghost verdict (and the read that proved it), keeping an existing entry."""
        if not uid:
            return
        with self._ghost_lock:
            if uid not in self._ghosts:
                self._ghosts[uid] = _Ghost(decision, read)

    def announce(self, uid: str) -> tuple[Decision, QuorumRead, bool] | None:
        """The ghost's verdict and read, and whether this is the first announcement of it
        (a ghost found in the background is only announced once something shows it matters)."""
        with self._ghost_lock:
            entry = self._ghosts.get(uid)
            if entry is None:
                return None
            first = not entry.announced
            entry.announced = True
            return entry.decision, entry.read, first

    def prepare(self, uid: str, decision: Decision) -> bool:
        """Keep a background-verified ``alive`` verdict for the pod's first scheduling attempt.

        Refused (False) for a UID already seen gone: its GET may have been answered just before
        the delete, and the DELETED event may have arrived before this call.
        """
        with self._prepared_lock:
            if uid in self._gone:
                return False
            self._prepared[uid] = _Prepared(decision)
            return True

    def invalidate(self, uid: str, namespace: str, name: str) -> bool:
        """A replica's watch showed the pod deleted, bound or terminating: remember that, drop its
        prepared verdict and any quorum read of its name in the burst cache. True if there was a
        prepared verdict."""
        with self._read.cache_lock:
            self._reads.pop(hashkey(namespace, name), None)
        with self._prepared_lock:
            self._gone[uid] = True
            return self._prepared.pop(uid, None) is not None

    def seen_gone(self, uid: str) -> bool:
        with self._prepared_lock:
            return uid in self._gone

    def mark_asked(self, uid: str) -> None:
        """A scheduler has asked about this UID: background verification of it is moot."""
        if uid:
            with self._prepared_lock:
                self._asked[uid] = True

    def was_asked(self, uid: str) -> bool:
        with self._prepared_lock:
            return uid in self._asked

    def take_prepared(self, uid: str) -> Decision | None:
        """The prepared verdict if this call is the first attempt (or within the grace of it), else None.

        A call after the grace is a later attempt: the entry is dropped so the
        caller verifies again.
        """
        if not uid:
            return None
        now = self._timer()
        with self._prepared_lock:
            entry = self._prepared.get(uid)
            if entry is None:
                return None
            if entry.first_used is None:
                entry.first_used = now
                return entry.decision
            if now - entry.first_used <= self._grace:
                return entry.decision
            del self._prepared[uid]
            return None

    def read(self, namespace: str, name: str) -> tuple[QuorumRead, bool]:
        """The quorum read of namespace/name and whether it came from the cache.

        Concurrent misses for one key wait for a single fetch (single flight).
        """
        self._local.fetched = False
        result = self._read(namespace, name)
        return result, not self._local.fetched
