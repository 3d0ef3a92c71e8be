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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import cachetools
from cachetools.keys import hashkey

from guard.verdict import Decision, QuorumRead


class VerdictCache:
    def __init__(self, fetch: Callable[[str, str], QuorumRead], *, ghost_ttl: float, ghost_size: int,
                 read_ttl: float, read_size: int, timer: Callable[[], float] = time.monotonic) -> None:
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
            return self._ghosts.get(uid)

    def remember_ghost(self, uid: str, decision: Decision) -> bool:
        """Store a ghost verdict; True when this UID was not known yet."""
        if not uid:
            return True
        with self._ghost_lock:
            new = uid not in self._ghosts
            self._ghosts[uid] = decision
            return new

    def read(self, namespace: str, name: str) -> tuple[QuorumRead, bool]:
        """The quorum read of namespace/name and whether it came from the cache.

        Concurrent misses for one key wait for a single fetch (single flight).
        """
        self._local.fetched = False
        result = self._read(namespace, name)
        return result, not self._local.fetched

    def sizes(self) -> dict[str, int]:
        with self._ghost_lock:
            ghosts = len(self._ghosts)
        with self._read.cache_lock:
            reads = len(self._reads)
        return {"ghosts": ghosts, "reads": reads}
