"""The background threads of the running guard, one way: named daemon threads that share a stop event.

A component (the replica views, the pre-verifier, the cache check, Ghost Nodes, the incident
recorder, the automatic heals, the healer) makes one :class:`Background` and asks it for what it
runs beside the requests:

- :meth:`Background.thread`: a named daemon thread;
- :meth:`Background.loop`: a named daemon thread that runs one round every ``interval`` seconds
  (or sooner, when woken) until the stop; a round that fails is logged, and one cut short by the
  stop is logged at debug only (a SIGTERM mid-round is no error: no traceback on shutdown);
- :meth:`Background.pool`: a named thread pool, its queued work cancelled at the stop;
- :meth:`Background.later`: ``fn(*args)`` after a delay: one timer thread for the component hands
  each due call to a small pool (not a ``threading.Timer`` per call).

:meth:`Background.close` sets the stop event, wakes every loop, cancels what the pools and the
timer have not started, and gives the threads that asked for it (``join=True``) a bounded time to
end: a round running at the interpreter's exit would otherwise find its pool shut under it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("guard.background")


class Background:
    """The named daemon threads, loops, pools and delayed calls of one component."""

    def __init__(self, log: logging.Logger = log) -> None:
        self.stop = threading.Event()
        self._log = log
        self._lock = threading.RLock()  # later() makes the timer (a pool, a thread) under it
        self._joined: list[threading.Thread] = []
        self._pools: list[ThreadPoolExecutor] = []
        self._wakes: list[threading.Event] = []
        self._timer: _Timer | None = None

    @property
    def stopping(self) -> bool:
        return self.stop.is_set()

    def thread(self, name: str, target: Callable[..., object], *args: object, join: bool = False) -> threading.Thread:
        """Start ``target(*args)`` on a daemon thread called ``name``; with ``join``, :meth:`close` waits for it."""
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        if join:
            with self._lock:
                self._joined = [j for j in self._joined if j.is_alive()] + [t]
        t.start()
        return t

    def loop(self, name: str, step: Callable[[], object], interval: float, *, what: str,
             wake: threading.Event | None = None, join: bool = False) -> threading.Thread:
        """Run ``step()`` every ``interval`` seconds, or as soon as ``wake`` is set, until the stop.
        ``what`` names a failed round in the log ("<what> failed")."""
        woken = wake or threading.Event()
        with self._lock:
            self._wakes.append(woken)

        def run() -> None:
            while not self.stop.is_set():
                woken.wait(interval)
                woken.clear()
                if self.stop.is_set():
                    return
                try:
                    step()
                except Exception:
                    if self.stop.is_set():  # stopping: a pool may be shut under the round; nothing is wrong
                        self._log.debug("%s: round ended by the stop", what, exc_info=True)
                    else:
                        self._log.exception("%s failed", what)

        return self.thread(name, run, join=join)

    def pool(self, name: str, workers: int) -> ThreadPoolExecutor:
        """A thread pool whose threads are called ``name-N``; :meth:`close` cancels its queued work."""
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        with self._lock:
            self._pools.append(pool)
        return pool

    def later(self, delay: float, fn: Callable[..., object], *args: object) -> None:
        """``fn(*args)`` after ``delay`` seconds, never after :meth:`close`: this component's one timer thread
        (started at the first call) hands it to a pool of ``LATER_WORKERS`` threads when due."""
        with self._lock:
            if self.stop.is_set():
                return
            if self._timer is None:
                self._timer = _Timer(self, self._log)
            timer = self._timer
        timer.add(delay, fn, args)

    def close(self, timeout: float = 0.0) -> None:
        """Stop: the stop event set, every loop woken, the pools' and the timer's waiting work dropped, then
        the ``join=True`` threads given ``timeout`` seconds in all to end (never the calling thread)."""
        self.stop.set()
        with self._lock:
            wakes, pools, joined, timer = list(self._wakes), list(self._pools), list(self._joined), self._timer
        for w in wakes:
            w.set()
        if timer is not None:
            timer.close()
        deadline = time.monotonic() + timeout
        for t in joined:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


# Delayed calls of one component running at once at most (each may wait on the network).
LATER_WORKERS = 8


# At most this many delayed calls wait per component; past that a new one is refused (logged).
LATER_LIMIT = 10_000


class _Timer:
    """One thread taking delayed calls in due order (a heap) and handing each to a pool, for one
    :class:`Background`."""

    def __init__(self, owner: Background, log: logging.Logger) -> None:
        self._log = log
        self._pool = owner.pool("ghost-later", LATER_WORKERS)
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[..., object], tuple[object, ...]]] = []
        self._seq = itertools.count()
        self._closed = False
        owner.thread("ghost-later", self._run)

    def add(self, delay: float, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        with self._cond:
            if self._closed:
                return
            if len(self._heap) >= LATER_LIMIT:
                self._log.warning("%d delayed calls wait already: %s not scheduled", len(self._heap),
                                  getattr(fn, "__name__", fn))
                return
            heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay), next(self._seq), fn, args))
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, fn, args = heapq.heappop(self._heap)
            try:
                self._pool.submit(self._call, fn, args)
            except RuntimeError:  # the pool is shut: stopping
                return

    def _call(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        try:
            fn(*args)
        except Exception:
            self._log.exception("delayed call %s failed", getattr(fn, "__name__", fn))
