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
  ``missing_after`` seconds while this (synced) replica has not, another replica
  showed it later than this one is known to lack it (:func:`shown_later`: the
  views are listed at different times), and no view showed it leave the pending
  set (:func:`missing_suspects`); it is *missing* only when a quorum read shows
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


@dataclass(frozen=True)
class ViewState:
    """What one replica's view of pending pods says, and as of when (ticks of the guard's one logical
    clock, guard.engine.checker.VerdictCache.tick).

    ``uids``: the pending pods it shows; ``synced``: whether it holds a complete picture at all;
    ``current``: kept current by a watch (or, for a one-shot check, read now), so what it lacks it
    lacks from ``as_of`` on; else it is a listing, complete as of ``as_of``, the tick its LIST began."""

    uids: frozenset[str] | set[str]
    synced: bool = True
    current: bool = False
    as_of: int = 0


def shown_later(lacking: ViewState, showing: ViewState, *, known: int | None, left: int | None) -> bool:
    """Whether ``showing`` shows a pod pending at a later point than one at which ``lacking`` is known
    to lack it, or than the pod left another view: only then do the two replicas disagree about it.

    ``known``: the tick at which the guard first saw the pod (None: never); ``left``: the tick at which
    a view first showed it leave the pending set (deleted, bound, terminating: a cache misses events,
    it never invents them, so from then on etcd has it pending no longer), None if none did.

    Without these ticks, two listings taken at different times disagree about every pod created or
    bound in between: a listing from before a pod existed lacks it, one from before it was bound shows
    it. A view lacks a pod at ``left`` (etcd had it no longer pending by then); a watched view from its
    listing on, unless it dropped the pod (then ``left``); a listing at ``as_of`` only if the guard knew
    the pod before that listing began (it existed then)."""
    if lacking.current:
        lacked = left if left is not None else lacking.as_of
    else:
        points = [t for t in (left, lacking.as_of if known is not None and known < lacking.as_of else None)
                  if t is not None]
        if not points:
            return False
        lacked = min(points)
    return showing.current or showing.as_of > lacked


def lacking_replicas(views: Mapping[str, ViewState], uid: str, *, known: int | None = None,
                     left: int | None = None) -> list[str]:
    """The synced replicas that lack pod ``uid`` while another synced replica shows it later
    (:func:`shown_later`), sorted: the replicas that disagree with another about it."""
    synced = sorted(r for r, v in views.items() if v.synced)
    return [r for r in synced if uid not in views[r].uids and any(
        uid in views[w].uids and shown_later(views[r], views[w], known=known, left=left) for w in synced if w != r)]


def missing_suspects(views: Mapping[str, ViewState], first_seen: Mapping[str, float], *, now: float,
                     missing_after: float, known: Mapping[str, int] | None = None,
                     left: Mapping[str, int] | None = None) -> list[tuple[str, str]]:
    """(replica, uid) pairs worth a confirmation, sorted.

    ``views``: per replica, its :class:`ViewState` (only synced views count, both as witnesses and as
    suspects); ``first_seen``: per UID, when any replica first showed it (seconds); ``known`` and
    ``left``: per UID, the ticks of :func:`shown_later` (absent: the views are compared as taken at
    once). A pod is a suspect on a synced replica that does not show it while another synced replica
    shows it later (:func:`shown_later`), once it was first seen ``missing_after`` seconds ago or
    more. A pod some view showed leave the pending set is pending nowhere in etcd: it is no suspect
    (a listing from before it was bound may still show it; asking etcd would cost a GET to learn that).
    """
    known = known or {}
    left = left or {}
    shown = {u for v in views.values() if v.synced for u in v.uids}
    out = []
    for uid in shown:
        seen = first_seen.get(uid)
        if uid in left or seen is None or now - seen < missing_after:
            continue
        out += [(replica, uid) for replica in lacking_replicas(views, uid, known=known.get(uid))]
    return sorted(out)


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
