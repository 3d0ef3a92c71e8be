"""guard.core.cache_health: missing pods and frozen watches, on a fake clock (every time is passed in)."""

from __future__ import annotations

import pytest

from guard.core.cache_health import (
    BEHIND, MISSING, NOT_PENDING, SHOWN, UNKNOWN, CacheTrack, RevisionSample, assess, confirm_missing,
    ViewState, missing_suspects, round_etcd_revision, shown_later,
)
from guard.core.verdict import QuorumRead

A, B, C = "10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"


# --- missing_suspects -----------------------------------------------------------------------------

def now_(*uids: str) -> ViewState:
    """A view read now (a watch, or a one-shot listing): what it lacks, it lacks now."""
    return ViewState(frozenset(uids), current=True)


def listed(as_of: int, *uids: str) -> ViewState:
    """A listing begun at tick ``as_of``."""
    return ViewState(frozenset(uids), as_of=as_of)


UNSYNCED = ViewState(frozenset(), synced=False)


@pytest.mark.parametrize("views, first_seen, now, want", [
    pytest.param({A: now_("u"), B: now_("u"), C: now_()}, {"u": 0.0}, 30.0, [(C, "u")], id="missing-after-30s"),
    pytest.param({A: now_("u"), B: now_("u"), C: now_()}, {"u": 0.0}, 29.9, [], id="not-yet"),
    pytest.param({A: now_("u"), B: now_("u"), C: now_("u")}, {"u": 0.0}, 99.0, [], id="everyone-shows-it"),
    pytest.param({A: now_("u"), B: now_(), C: now_()}, {"u": 0.0}, 30.0, [(B, "u"), (C, "u")],
                 id="one-witness-is-enough"),
    pytest.param({A: now_("u"), B: now_("u"), C: UNSYNCED}, {"u": 0.0}, 99.0, [], id="unsynced-replica-is-no-suspect"),
    pytest.param({A: ViewState(frozenset({"u"}), synced=False), B: now_()}, {"u": 0.0}, 99.0, [],
                 id="unsynced-witness-does-not-count"),
    pytest.param({A: now_("u")}, {"u": 0.0}, 99.0, [], id="single-replica"),
    pytest.param({A: now_("u"), B: now_()}, {}, 99.0, [], id="never-seen-time-unknown"),
    pytest.param({A: now_("u", "v"), B: now_("v")}, {"u": 0.0, "v": 0.0}, 30.0, [(B, "u")], id="per-uid"),
])
def test_missing_suspects(views, first_seen, now, want):
    assert missing_suspects(views, first_seen, now=now, missing_after=30.0) == want


# Ticks: the guard first saw "u" at tick 10 (known); listings of A and B begin at the ticks given.
@pytest.mark.parametrize("views, left, want", [
    pytest.param({A: listed(30, "u"), B: listed(20)}, {}, [(B, "u")],
                 id="lacked-after-the-pod-was-known-and-shown-later"),
    pytest.param({A: listed(20, "u"), B: listed(5)}, {}, [],
                 id="listed-before-the-pod-existed"),
    pytest.param({A: listed(20, "u"), B: listed(25)}, {}, [],
                 id="witness-listed-before-the-lacking-listing-began"),
    pytest.param({A: now_("u"), B: listed(25)}, {}, [(B, "u")], id="a-watch-is-a-witness-now"),
    pytest.param({A: listed(30, "u"), B: ViewState(frozenset(), current=True, as_of=20)}, {}, [(B, "u")],
                 id="watched-since-before-the-witness-listing"),
    pytest.param({A: listed(15, "u"), B: ViewState(frozenset(), current=True, as_of=20)}, {}, [],
                 id="witness-listing-older-than-the-watch"),
    # The backlog: the watched replica saw "u" bound at tick 40 and dropped it; A's listing from
    # before still shows it. Bound: pending nowhere, nothing to confirm (a GET apiece, 20 a second).
    pytest.param({A: listed(30, "u"), B: ViewState(frozenset(), current=True, as_of=1)}, {"u": 40}, [],
                 id="bound-since-the-witness-listing"),
    pytest.param({A: listed(50, "u"), B: ViewState(frozenset(), current=True, as_of=1)}, {"u": 40}, [],
                 id="left-a-view-is-pending-nowhere"),
])
def test_missing_suspects_compare_views_by_when_they_were_taken(views, left, want):
    assert missing_suspects(views, {"u": 0.0}, now=99.0, missing_after=30.0, known={"u": 10}, left=left) == want


@pytest.mark.parametrize("lacking, showing, known, left, want", [
    pytest.param(listed(20), listed(30, "u"), 10, None, True, id="lacked-then-shown"),
    pytest.param(listed(30), listed(20, "u"), 10, None, False, id="shown-then-lacked-bound-between"),
    pytest.param(listed(20), listed(30, "u"), 25, None, False, id="lacking-listing-before-the-pod-was-known"),
    pytest.param(listed(20), listed(30, "u"), None, None, False, id="never-known"),
    pytest.param(listed(5), listed(30, "u"), 10, 25, True, id="shown-after-it-left-a-view-a-stale-cache"),
    pytest.param(listed(5), listed(20, "u"), 10, 25, False, id="shown-before-it-left-a-view"),
    pytest.param(now_(), listed(30, "u"), 10, 25, True, id="watched-dropped-it-then-shown-stale"),
    pytest.param(now_(), listed(20, "u"), 10, 25, False, id="watched-dropped-it-after-the-listing"),
    pytest.param(ViewState(frozenset(), current=True, as_of=15), listed(20, "u"), 10, None, True,
                 id="watched-never-showed-it-lost-the-creation"),
    pytest.param(listed(30), now_("u"), 10, None, True, id="a-watch-shows-it-now"),
])
def test_shown_later(lacking, showing, known, left, want):
    assert shown_later(lacking, showing, known=known, left=left) is want


# --- confirm_missing ---------------------------------------------------------------------------------

PENDING = QuorumRead.found("u", resource_version="100")


@pytest.mark.parametrize("read, shows, cache_rv, want", [
    pytest.param(PENDING, False, 100, MISSING, id="cache-at-pod-revision-lacks-it"),
    pytest.param(PENDING, False, 250, MISSING, id="cache-past-pod-revision-lacks-it"),
    pytest.param(PENDING, False, 99, BEHIND, id="cache-not-there-yet-lagging-or-frozen"),
    pytest.param(PENDING, True, 250, SHOWN, id="cache-holds-it-lag-only"),
    pytest.param(PENDING, None, None, UNKNOWN, id="cache-read-failed"),
    pytest.param(PENDING, False, None, UNKNOWN, id="no-cache-revision"),
    pytest.param(QuorumRead.found("u", resource_version=""), False, 250, UNKNOWN, id="no-pod-revision"),
    pytest.param(QuorumRead.found("u", node_name="n1", resource_version="100"), False, 250, NOT_PENDING,
                 id="bound-meanwhile"),
    pytest.param(QuorumRead.found("u", deletion_timestamp="2026-01-01T00:00:00Z", resource_version="100"), False,
                 250, NOT_PENDING, id="terminating"),
    pytest.param(QuorumRead.not_found(), False, 250, NOT_PENDING, id="deleted-meanwhile"),
    pytest.param(QuorumRead.found("other", resource_version="100"), False, 250, NOT_PENDING, id="recreated-new-uid"),
    pytest.param(QuorumRead.failed("timeout"), False, 250, UNKNOWN, id="quorum-read-failed"),
])
def test_confirm_missing(read, shows, cache_rv, want):
    assert confirm_missing(read, "u", cache_shows=shows, cache_rv=cache_rv) == want


# --- frozen: assess over rounds on a fake clock ---------------------------------------------------------------

def run(rounds, frozen_after=30.0):
    """rounds: [(at, {replica: (etcd_rv, cache_rv)})] -> the tracks after each round."""
    tracks: dict = {}
    out = []
    for at, samples in rounds:
        tracks = assess(tracks, [RevisionSample(r, at, e, c) for r, (e, c) in samples.items()], frozen_after=frozen_after)
        out.append(tracks)
    return out


def frozen_after_rounds(rounds, replica, frozen_after=30.0):
    return [t.get(replica, CacheTrack()).frozen for t in run(rounds, frozen_after)]


def test_a_cache_standing_still_behind_etcd_is_frozen_after_frozen_after():
    rounds = [(t, {A: (100 + t, 100 + t), C: (100 + t, 50)}) for t in (0, 10, 20, 30, 40)]
    assert frozen_after_rounds(rounds, C) == [False, False, False, True, True]
    assert run(rounds)[-1][C].seconds_behind(40.0) == 40.0
    assert not any(frozen_after_rounds(rounds, A))


def test_a_lagging_cache_that_moves_is_never_frozen():
    rounds = [(t, {A: (100 + t, 100 + t), C: (100 + t, 95 + t)}) for t in range(0, 200, 10)]
    assert not any(frozen_after_rounds(rounds, C))
    assert run(rounds)[-1][C].seconds_behind(190.0) == 190.0  # but it says how long it has been behind


def test_an_idle_cluster_is_no_frozen_cache():
    rounds = [(t, {A: (100, 100), C: (100, 100)}) for t in range(0, 200, 10)]
    assert not any(frozen_after_rounds(rounds, C))
    assert run(rounds)[-1][C].seconds_behind(190.0) == 0.0


def test_catching_up_clears_frozen_and_behind():
    rounds = [(t, {A: (100 + t, 100 + t), C: (100 + t, 50)}) for t in (0, 10, 20, 30)]
    rounds.append((40, {A: (140, 140), C: (140, 140)}))
    assert frozen_after_rounds(rounds, C) == [False, False, False, True, False]
    assert run(rounds)[-1][C].seconds_behind(45.0) == 0.0


def test_a_short_freeze_below_frozen_after_is_not_named():
    rounds = [(0, {A: (100, 100), C: (100, 100)}), (10, {A: (110, 110), C: (110, 100)}),
              (20, {A: (120, 120), C: (120, 100)}), (30, {A: (130, 130), C: (130, 130)})]
    assert not any(frozen_after_rounds(rounds, C))


def test_nobody_is_named_when_no_other_cache_is_caught_up():
    # consistent reads not served from the cache (every cache behind etcd): no claim
    rounds = [(t, {A: (100 + t, 50), C: (100 + t, 50)}) for t in (0, 10, 20, 30, 40)]
    assert not any(frozen_after_rounds(rounds, C)) and not any(frozen_after_rounds(rounds, A))


def test_a_single_replica_is_never_named_frozen():
    rounds = [(t, {C: (100 + t, 50)}) for t in (0, 10, 20, 30, 40)]
    assert not any(frozen_after_rounds(rounds, C))


def test_a_sample_without_an_answer_changes_nothing():
    rounds = [(t, {A: (100 + t, 100 + t), C: (100 + t, 50)}) for t in (0, 10, 20)]
    rounds.append((30, {A: (130, 130), C: (130, None)}))
    tracks = run(rounds)
    assert tracks[-1][C] == tracks[-2][C]


def test_a_cache_that_lagged_then_stopped_is_frozen_once_it_stood_still_frozen_after():
    rounds = [(0, {A: (100, 100), C: (100, 50)}), (10, {A: (110, 110), C: (110, 50)}),
              (20, {A: (120, 120), C: (120, 60)}), (30, {A: (130, 130), C: (130, 60)}),
              (40, {A: (140, 140), C: (140, 60)}), (50, {A: (150, 150), C: (150, 60)})]
    assert frozen_after_rounds(rounds, C) == [False, False, False, False, False, True]


def test_etcd_revision_of_a_replica_whose_consistent_read_failed_is_the_rounds_newest():
    assert round_etcd_revision({A: 120, B: None, C: 118}) == {A: 120, B: 120, C: 118}
    assert round_etcd_revision({A: None, B: None}) == {A: None, B: None}
