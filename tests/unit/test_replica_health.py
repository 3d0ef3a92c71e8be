"""guard.core.cache_health: missing pods and frozen watches, on a fake clock (every time is passed in)."""

from __future__ import annotations

import pytest

from guard.core.cache_health import (
    BEHIND, MISSING, NOT_PENDING, SHOWN, UNKNOWN, CacheTrack, RevisionSample, assess, confirm_missing,
    missing_suspects, round_etcd_revision,
)
from guard.core.verdict import QuorumRead

A, B, C = "10.0.0.1:6443", "10.0.0.2:6443", "10.0.0.3:6443"


# --- missing_suspects -----------------------------------------------------------------------------

@pytest.mark.parametrize("views, synced, first_seen, now, want", [
    pytest.param({A: {"u"}, B: {"u"}, C: set()}, [A, B, C], {"u": 0.0}, 30.0, [(C, "u")], id="missing-after-30s"),
    pytest.param({A: {"u"}, B: {"u"}, C: set()}, [A, B, C], {"u": 0.0}, 29.9, [], id="not-yet"),
    pytest.param({A: {"u"}, B: {"u"}, C: {"u"}}, [A, B, C], {"u": 0.0}, 99.0, [], id="everyone-shows-it"),
    pytest.param({A: {"u"}, B: set(), C: set()}, [A, B, C], {"u": 0.0}, 30.0, [(B, "u"), (C, "u")],
                 id="one-witness-is-enough"),
    pytest.param({A: {"u"}, B: {"u"}, C: set()}, [A, B], {"u": 0.0}, 99.0, [], id="unsynced-replica-is-no-suspect"),
    pytest.param({A: {"u"}, B: set()}, [B], {"u": 0.0}, 99.0, [], id="unsynced-witness-does-not-count"),
    pytest.param({A: {"u"}}, [A], {"u": 0.0}, 99.0, [], id="single-replica"),
    pytest.param({A: {"u"}, B: set()}, [A, B, C], {"u": 0.0}, 99.0, [(B, "u")], id="synced-but-unknown-view-ignored"),
    pytest.param({A: {"u"}, B: set()}, [A, B], {}, 99.0, [], id="never-seen-time-unknown"),
    pytest.param({A: {"u", "v"}, B: {"v"}}, [A, B], {"u": 0.0, "v": 0.0}, 30.0, [(B, "u")], id="per-uid"),
])
def test_missing_suspects(views, synced, first_seen, now, want):
    assert missing_suspects(views, synced, first_seen, now=now, missing_after=30.0) == want


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
