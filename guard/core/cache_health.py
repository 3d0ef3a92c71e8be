"""Which apiserver replicas miss pods, and which ones have a frozen watch.

Pure: no I/O and no clock. Every time is passed in (seconds of one monotonic
clock); the I/O is :mod:`guard.engine.cache_health`'s.

A stale watch cache has two faces besides serving ghosts:

- **a missing pod**: a pod pending in etcd that one replica's cache never
  showed, because that replica's etcd watch lost the pod's creation and flowed
  on. Schedulers and controllers reading that replica never see the pod.
- **a frozen replica**: its cache revision stops while etcd's moves on; it
  shows nothing new at all.

Neither may be said of a healthy replica that merely lags (first law). So:

- a pod is only a *suspect* on a replica once other replicas have shown it for
  ``missing_after`` seconds while this (synced) replica has not
  (:func:`missing_suspects`); it is *missing* only when a quorum read shows
  the pod still pending with that UID **and** the replica's cache, read
  directly (``resourceVersion=0``) right after a consistent read made a
  flowing cache catch up with etcd, lacks it although its revision is already
  at or past the pod's resourceVersion (:func:`confirm_missing`). A cache
  whose revision has not reached the pod's is behind, not missing anything
  (yet): that is the frozen rule's business.
- a replica is *frozen* when, for ``frozen_after`` seconds, every sample
  found its cache revision behind a revision etcd had **and** the revision did
  not move, while another replica's cache was caught up in the same round
  (:func:`assess`). A lagging cache moves; an idle cluster gives etcd nothing
  newer to be behind.

How the samples are taken (facts checked against k8s.io/apiserver
pkg/storage/cacher): a LIST with ``resourceVersion=0`` is answered from the
watch cache and its ``metadata.resourceVersion`` is the cache's own revision
(watch_cache.go ``waitAndGetLatestSnapshot`` returns ``w.resourceVersion``);
a LIST without resourceVersion is a consistent read: the cacher asks etcd for
its current revision (``getCurrentRV``), waits until its cache reaches it
(``waitUntilFreshLocked``), and when it cannot within the timeout falls back
to etcd (delegator.go, ``IsTooLargeResourceVersion`` -> ``storage.GetList``;
with ``ConsistentListFromCacheSkipTimeoutFallback`` it answers 429 instead).
Either way its list revision is one etcd had, and a flowing cache is at least
there right after it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from guard.core.verdict import QuorumRead, ReadStatus, pending_in_etcd

# Outcomes of confirm_missing().
MISSING: Final = "missing"
"""etcd has the pod pending, and the replica's cache, past the pod's revision, lacks it."""
SHOWN: Final = "shown"
"""The replica's cache holds the pod (its watch merely lagged)."""
NOT_PENDING: Final = "not-pending"
"""etcd no longer has this pod pending (bound, terminating, deleted, or another UID): nothing is missing."""
BEHIND: Final = "behind"
"""The replica's cache has not reached the pod's revision: lagging or frozen, not (yet) missing it."""
UNKNOWN: Final = "unknown"
"""A read failed: no claim either way; ask again later."""


def missing_suspects(views: Mapping[str, frozenset[str] | set[str]], synced: Iterable[str],
                     first_seen: Mapping[str, float], *, now: float, missing_after: float) -> list[tuple[str, str]]:
    """(replica, uid) pairs worth a confirmation, sorted.

    ``views``: per replica, the UIDs of the pending pods its watch shows;
    ``synced``: the replicas whose watch is synced (only their views count, both as witnesses and
    as suspects); ``first_seen``: per UID, when any replica first showed it. A pod is a suspect on
    a synced replica that does not show it while another synced replica does, once it was first
    seen ``missing_after`` seconds ago or more.
    """
    synced = [r for r in sorted(set(synced)) if r in views]
    out = []
    for replica in synced:
        shown = views[replica]
        witnesses = [views[r] for r in synced if r != replica]
        for uid in sorted({u for w in witnesses for u in w} - set(shown)):
            seen = first_seen.get(uid)
            if seen is not None and now - seen >= missing_after:
                out.append((replica, uid))
    return out


def confirm_missing(read: QuorumRead, uid: str, *, cache_shows: bool | None, cache_rv: int | None) -> str:
    """Is pod ``uid`` missing from one replica's cache? One of MISSING, SHOWN, NOT_PENDING, BEHIND, UNKNOWN.

    ``read``: a quorum GET of the pod's name made *before* the cache read; ``cache_shows``: whether
    the replica's cache (LIST resourceVersion=0 of the name) holds any copy with this UID, None
    if that read failed; ``cache_rv``: that list's resourceVersion (the cache's revision).
    """
    if read.status is ReadStatus.ERROR:
        return UNKNOWN
    if not pending_in_etcd(read, uid):
        return NOT_PENDING
    if cache_shows is None:
        return UNKNOWN
    if cache_shows:
        return SHOWN
    pod_rv = _int(read.resource_version)
    if pod_rv is None or cache_rv is None:
        return UNKNOWN
    # The cache has applied every event up to cache_rv, the pod's newest write (pod_rv) among them:
    # a cache that still lacks the pod lost its creation (and every write since).
    return MISSING if cache_rv >= pod_rv else BEHIND


# --- frozen watches -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RevisionSample:
    """One look at one replica: a revision etcd had (``etcd_rv``: the replica's own consistent read,
    else the newest another replica's consistent read returned in the same round; None if none
    answered) and then the replica's cache revision (``cache_rv``: LIST resourceVersion=0; None
    when it did not answer)."""

    replica: str
    at: float
    etcd_rv: int | None
    cache_rv: int | None


@dataclass(frozen=True, slots=True)
class CacheTrack:
    """What the samples so far say about one replica's cache."""

    cache_rv: int | None = None
    moved_at: float | None = None  # when cache_rv was first seen at its current value
    behind_since: float | None = None  # first of the unbroken run of samples that found it behind etcd
    frozen: bool = False
    sampled_at: float | None = None

    def seconds_behind(self, now: float) -> float:
        """How long the cache has been behind a revision etcd had (0 when it was last seen caught up)."""
        return max(0.0, now - self.behind_since) if self.behind_since is not None else 0.0


def assess(tracks: Mapping[str, CacheTrack], samples: Iterable[RevisionSample], *,
           frozen_after: float) -> dict[str, CacheTrack]:
    """The tracks after one round of samples (replicas without a sample keep theirs).

    A sample that got no cache revision changes nothing (no claim either way). A replica is
    frozen when its cache has been behind etcd for ``frozen_after`` seconds and has not moved
    for as long (a cache that lagged, then stopped, is named once it stood still that long),
    and some other replica's cache was caught up in this round: if every cache is behind
    (consistent reads not served from the cache, an etcd that cannot be asked), nobody is named.
    """
    samples = [s for s in samples if s.cache_rv is not None]
    caught_up = {s.replica for s in samples if s.etcd_rv is not None and s.cache_rv is not None and s.cache_rv >= s.etcd_rv}
    out = dict(tracks)
    for s in samples:
        assert s.cache_rv is not None  # filtered above
        t = tracks.get(s.replica, CacheTrack())
        moved_at = s.at if t.cache_rv != s.cache_rv or t.moved_at is None else t.moved_at
        behind = s.etcd_rv is not None and s.cache_rv < s.etcd_rv
        if not behind:
            out[s.replica] = CacheTrack(s.cache_rv, moved_at, None, False, s.at)
            continue
        since = t.behind_since if t.behind_since is not None else s.at
        frozen = (s.at - since >= frozen_after and s.at - moved_at >= frozen_after
                  and any(r != s.replica for r in caught_up))
        out[s.replica] = replace(t, cache_rv=s.cache_rv, moved_at=moved_at, behind_since=since, frozen=frozen,
                                 sampled_at=s.at)
    return out


def round_etcd_revision(own: Mapping[str, int | None]) -> dict[str, int | None]:
    """Per replica, the etcd revision its sample is compared with: its own consistent read's, else
    the newest any replica's consistent read returned in the round (a revision etcd had)."""
    known = [rv for rv in own.values() if rv is not None]
    newest = max(known) if known else None
    return {r: (rv if rv is not None else newest) for r, rv in own.items()}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None
