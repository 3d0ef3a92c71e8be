"""Work off the request path: a bounded, coalescing executor (:class:`FollowUps`, the checker's
follow-ups: audit record, replica probes, Events, re-probes of a looping ghost). Work due later runs on
the component's :meth:`guard.engine.background.Background.later` (one timer thread).

At most ``backlog`` tasks run or are queued on the threads. Beyond, they wait in an overflow keyed by
(kind, key): a second task of the same kind for the same key is coalesced into the waiting one
(counted; with ``newest`` it takes the waiting one's place), so a flood of distinct keys loses none and
a looping key takes one entry. Past ``overflow`` keys they are dropped (counted), so memory stays
bounded. Two priorities, when ``low`` tells them apart (``low(key)`` True: low, None: no priorities at
all): a low task never delays a high one, a full overflow drops its oldest low task for a high one
and refuses a low one (``shed`` is called), and a ``once`` kind runs at most one task per low key at a
time. Nothing here affects a verdict.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from guard import metrics

log = logging.getLogger("guard.check")

Task = tuple[Callable[..., None], tuple[object, ...]]
K = TypeVar("K", bound=Hashable)


class FollowUps(Generic[K]):
    def __init__(self, *, backlog: int, overflow: int, background: bool = True, workers: int = 2,
                 low: Callable[[K], bool | None] = lambda key: None, shed: Callable[[], None] = lambda: None,
                 name: str = "ghost-followup") -> None:
        # background=False runs each task inline, at once (deterministic tests).
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) if background else None
        self._low = low
        self._shed = shed
        self._overflow_max = overflow
        self._slots = threading.BoundedSemaphore(backlog)
        self._overflow: collections.OrderedDict[tuple[str, K], Task] = collections.OrderedDict()
        self._lock = threading.Lock()
        # Keys of ``once`` kinds queued or running (kind, key): one at a time for a low key.
        self._pending: set[tuple[str, K]] = set()
        self._lanes: tuple[collections.deque[tuple[str, K, Task]], ...] = (collections.deque(), collections.deque())
        self._lanes_lock = threading.Lock()

    def submit(self, kind: str, key: K, fn: Callable[..., None], *args: object, once: bool = False,
               newest: bool = False) -> None:
        """Run ``fn(*args)`` off the caller's path (never waits, never raises)."""
        if once:
            with self._lock:
                if (kind, key) in self._pending and self._low(key):
                    metrics.FOLLOWUPS_COALESCED.inc()
                    return
                self._pending.add((kind, key))
        if self._slots.acquire(blocking=False):
            self._start(kind, key, (fn, args))
            return
        with self._lock:
            if (kind, key) in self._overflow:
                metrics.FOLLOWUPS_COALESCED.inc()
                if newest:
                    self._overflow[(kind, key)] = (fn, args)
                return
            if len(self._overflow) >= self._overflow_max and not self._make_room(key):
                metrics.FOLLOWUPS_DROPPED.inc()
                self._pending.discard((kind, key))
                return
            self._overflow[(kind, key)] = (fn, args)
        self._drain()  # a slot may have been released since the acquire failed

    def waiting(self) -> int:
        """Tasks waiting in the overflow (beyond the running and queued ones)."""
        with self._lock:
            return len(self._overflow)

    def _make_room(self, key: K) -> bool:
        """The overflow is full (under ``_lock``): drop the oldest waiting low task to make room for
        ``key``'s, unless ``key`` is low too (or there are no priorities). True if room was made."""
        low = self._low(key)
        if low is None or low:
            if low is not None:
                self._shed()
            return False
        for waiting in self._overflow:
            if self._low(waiting[1]):
                del self._overflow[waiting]
                self._pending.discard(waiting)
                metrics.FOLLOWUPS_DROPPED.inc()
                self._shed()
                return True
        return False

    def _start(self, kind: str, key: K, task: Task) -> None:
        """Run a task on a slot already taken; the slot goes back (and the overflow moves) when done."""
        if self._pool is None:
            try:
                self._run(kind, key, task)
            finally:
                self._slots.release()
            self._drain()
            return
        with self._lanes_lock:
            self._lanes[1 if self._low(key) else 0].append((kind, key, task))
        future = self._pool.submit(self._run_next)
        future.add_done_callback(self._done)

    def _run_next(self) -> None:
        """One pool task: the oldest of the first lane, else of the second (one queued per task)."""
        with self._lanes_lock:
            kind, key, task = (self._lanes[0] or self._lanes[1]).popleft()
        self._run(kind, key, task)

    def _run(self, kind: str, key: K, task: Task) -> None:
        with self._lock:
            self._pending.discard((kind, key))
        fn, args = task
        try:
            fn(*args)
        except Exception:
            log.exception("follow-up %s failed for %s", getattr(fn, "__name__", fn), key)

    def _done(self, _future: object) -> None:
        self._slots.release()
        self._drain()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._overflow or not self._slots.acquire(blocking=False):
                    return
                (kind, key), task = self._overflow.popitem(last=False)
            self._start(kind, key, task)
