"""Which apiserver replicas are stale, given what each one's watch cache served.

Pure: no I/O and no clock. Every time is passed in (seconds since the epoch).

A *probe* reads one replica's watch cache for one ghost
(``GET /api/v1/namespaces/NS/pods?resourceVersion=0&fieldSelector=metadata.name=NAME``)
and becomes a :class:`ReplicaObservation` (whether a cached copy serves the ghost is
:func:`guard.core.verdict.shows_pending`, asked after etcd said it has no such pod pending). The rules here turn observations
into answers: which replicas serve the ghost, which ones healed, whether a
cache *missed the delete* rather than lagging behind, and when to probe again.

Probe errors are short strings in a fixed form, so they can be classified
later (from the audit store) without keeping status codes apart:
``"HTTP 429: <reason>"`` (built by :func:`http_error`), ``"timeout: <detail>"``
and ``"unreachable: <detail>"`` (built by :func:`transport_error`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

STALE: Final = "stale"
"""The replica's cache serves the ghost."""
CONSISTENT: Final = "consistent"
"""The replica's cache does not serve the ghost."""
NOT_READY: Final = "not-ready"
"""The replica answered 429: a kube-apiserver whose watch cache is not ready yet answers reads it would serve from the cache with 429 (apiserver/pkg/storage/cacher)."""
UNREACHABLE: Final = "unreachable"
"""No answer: timeout, refused connection, TLS failure."""
ERROR: Final = "error"
"""Any other failure (an unexpected status, an undecodable body)."""

CLASSES: Final = (STALE, CONSISTENT, NOT_READY, UNREACHABLE, ERROR)

_ERROR_DETAIL_MAX: Final = 200


@dataclass(frozen=True, slots=True)
class ReplicaObservation:
    """One probe of one replica's watch cache for one ghost.

    ``serves_ghost`` is ``True`` when the cache returned the ghost (same UID),
    ``False`` when it did not, ``None`` when the probe failed (then ``error``
    says why). ``cache_resource_version`` is the list's
    ``metadata.resourceVersion``: the cache's revision at the time.
    """

    replica: str
    serves_ghost: bool | None
    cache_resource_version: str | None
    error: str | None
    checked_at: float


def http_error(status: int, reason: str = "") -> str:
    """The error string for a probe answered with a non-200 ``status``."""
    detail = _clip(reason)
    return f"HTTP {status}: {detail}" if detail else f"HTTP {status}"


def transport_error(kind: str, detail: str = "") -> str:
    """The error string for a probe that got no answer; ``kind`` is ``"timeout"`` or ``"unreachable"``."""
    if kind not in ("timeout", "unreachable"):
        raise ValueError(f"kind must be 'timeout' or 'unreachable', not {kind!r}")
    detail = _clip(detail)
    return f"{kind}: {detail}" if detail else kind


def classify(observation: ReplicaObservation) -> str:
    """One of :data:`CLASSES` for one observation.

    A known answer wins over an error text: ``serves_ghost=True`` is
    ``"stale"`` and ``False`` is ``"consistent"``. Without an answer, a 429 is
    ``"not-ready"``, a timeout or a failed connection ``"unreachable"``, and
    anything else (including no error text at all) ``"error"``.
    """
    if observation.serves_ghost is True:
        return STALE
    if observation.serves_ghost is False:
        return CONSISTENT
    error = (observation.error or "").strip()
    if error == "HTTP 429" or error.startswith("HTTP 429:"):
        return NOT_READY
    if error.startswith(("timeout", "unreachable")):
        return UNREACHABLE
    return ERROR


def latest(observations: Iterable[ReplicaObservation]) -> dict[str, ReplicaObservation]:
    """The newest observation of each replica (by ``checked_at``; on a tie, the later one in order)."""
    newest: dict[str, ReplicaObservation] = {}
    for obs in observations:
        seen = newest.get(obs.replica)
        if seen is None or obs.checked_at >= seen.checked_at:
            newest[obs.replica] = obs
    return newest


def stale_replicas(observations: Iterable[ReplicaObservation]) -> list[str]:
    """The replicas whose newest observation serves the ghost, sorted by name."""
    return sorted(r for r, obs in latest(observations).items() if obs.serves_ghost is True)


def healed(previous: Iterable[ReplicaObservation], current: Iterable[ReplicaObservation]) -> list[str]:
    """Replicas that served the ghost in ``previous`` and no longer do in ``current``, sorted.

    Only a probe that answered counts as healed: a replica that served the
    ghost and now times out or answers 429 is *not* healed (nothing says its
    cache changed).
    """
    was_stale = set(stale_replicas(previous))
    now = latest(current)
    return sorted(r for r in was_stale if r in now and now[r].serves_ghost is False)


def missed_delete(before_rv: str | None, after_rv: str | None, still_serves: bool | None) -> bool:
    """True when a cache still serving the ghost has moved past the revision it had before.

    A lagging cache has not seen the delete *yet*; a cache whose list
    resourceVersion advanced (it applied later events) but still serves the
    ghost missed the delete for good: a cache LIST's ``metadata.resourceVersion``
    is the cache's current revision (apiserver/pkg/storage/cacher, cacher.go
    1.31-1.32, delegator.go 1.33+). Resource versions that are not
    decimal integers (they are opaque in the API) give ``False``: no claim.
    """
    if still_serves is not True:
        return False
    before, after = _revision(before_rv), _revision(after_rv)
    if before is None or after is None:
        return False
    return after > before


def should_reprobe(last_checked: float, now: float, min_interval: float) -> bool:
    """True when a replica last probed at ``last_checked`` may be probed again at ``now``.

    Bounds the re-probe rate to one per ``min_interval`` seconds. A
    ``last_checked`` in the future (the clock stepped back) allows a probe, so
    a clock step never silences attribution; the probe then resets
    ``last_checked``.
    """
    for label, value in (("last_checked", last_checked), ("now", now), ("min_interval", min_interval)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{label} must be a finite number, not {value!r}")
    if min_interval < 0:
        raise ValueError(f"min_interval must be >= 0, not {min_interval!r}")
    if last_checked > now:
        return True
    return now - last_checked >= min_interval


def summarize(observations: Sequence[ReplicaObservation]) -> dict[str, list[str]]:
    """Replica names grouped by :func:`classify` of their newest observation (every class present, sorted)."""
    groups: dict[str, list[str]] = {c: [] for c in CLASSES}
    for replica, obs in sorted(latest(observations).items()):
        groups[classify(obs)].append(replica)
    return groups


def _revision(rv: str | None) -> int | None:
    if not isinstance(rv, str) or not rv.isascii() or not rv.isdigit() or len(rv) > 20:
        return None
    return int(rv)


def _clip(text: str) -> str:
    text = " ".join(str(text).split())
    if len(text) > _ERROR_DETAIL_MAX:
        return text[: _ERROR_DETAIL_MAX - 3] + "..."
    return text
