"""The one token bucket: ``rate`` takes per second on average, at most ``burst`` at once.

Pure and clock-driven: the clock is passed in (``time.monotonic`` in the guard, a fake clock in
tests) and nothing here sleeps. A caller that must wait waits on its own stop event for the
seconds :meth:`TokenBucket.take` returns, so a shutdown never waits for a token. Used by the
background verification (guard.engine.prepare, ``--verify-qps``), the automatic heals
(guard.engine.autoheal, ``--heal-rate``/``--heal-burst``), the budget for first sightings of
unsighted ghosts (guard.core.flood) and the GhostPod writes (guard.audit.ghostpods,
``--audit-write-qps``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class TokenBucket:
    """``rate`` takes per second on average, bursts of at most ``burst``; full at the start.

    Thread-safe. A clock that goes back refills nothing (and takes nothing back)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        if not rate > 0 or not burst >= 1:
            raise ValueError("rate must be positive and burst at least 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """0 and one token used if one is there, else the seconds until one will be (nothing used)."""
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._at) * self.rate)
            self._at = max(self._at, now)
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return 0.0
            return (1.0 - self._tokens) / self.rate

    def give_back(self) -> None:
        """Return a token :meth:`take` took (the caller did not use it after all)."""
        with self._lock:
            self._tokens = min(float(self.burst), self._tokens + 1.0)
