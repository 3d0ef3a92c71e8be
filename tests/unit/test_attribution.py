"""guard/core/attribution.py: which replicas are stale, table-driven."""

from __future__ import annotations

import math

import pytest

from guard.core.attribution import (
    CLASSES,
    ReplicaObservation,
    classify,
    healed,
    http_error,
    latest,
    missed_delete,
    should_reprobe,
    stale_replicas,
    summarize,
    transport_error,
)

A, B, C = "https://127.0.0.1:6443", "https://127.0.0.2:6443", "https://127.0.0.3:6443"


def obs(replica: str, serves: bool | None, *, rv: str | None = "100", error: str | None = None, at: float = 1000.0) -> ReplicaObservation:
    return ReplicaObservation(replica=replica, serves_ghost=serves, cache_resource_version=rv, error=error, checked_at=at)


@pytest.mark.parametrize(
    ("observation", "expected"),
    [
        pytest.param(obs(A, True), "stale", id="serves-ghost"),
        pytest.param(obs(A, False), "consistent", id="does-not-serve"),
        pytest.param(obs(A, True, error="HTTP 429"), "stale", id="answer-beats-error-text"),
        pytest.param(obs(A, None, rv=None, error="HTTP 429"), "not-ready", id="429-bare"),
        pytest.param(obs(A, None, rv=None, error=http_error(429, "Too Many Requests")), "not-ready", id="429-with-reason"),
        pytest.param(obs(A, None, rv=None, error="HTTP 4290"), "error", id="4290-is-not-429"),
        pytest.param(obs(A, None, rv=None, error=http_error(503, "ServiceUnavailable")), "error", id="503"),
        pytest.param(obs(A, None, rv=None, error=http_error(403)), "error", id="403-bare"),
        pytest.param(obs(A, None, rv=None, error=transport_error("timeout", "after 0.5s")), "unreachable", id="timeout"),
        pytest.param(obs(A, None, rv=None, error=transport_error("unreachable", "connection refused")), "unreachable", id="refused"),
        pytest.param(obs(A, None, rv=None, error="undecodable JSON body"), "error", id="garbage-error"),
        pytest.param(obs(A, None, rv=None, error=None), "error", id="no-answer-no-error"),
        pytest.param(obs(A, None, rv=None, error=""), "error", id="empty-error"),
    ],
)
def test_classify(observation: ReplicaObservation, expected: str) -> None:
    assert classify(observation) == expected
    assert expected in CLASSES


@pytest.mark.parametrize(
    ("observations", "expected"),
    [
        pytest.param([], [], id="no-observations"),
        pytest.param([obs(A, False), obs(B, False), obs(C, False)], [], id="all-consistent"),
        pytest.param([obs(A, False), obs(B, True), obs(C, False)], [B], id="one-stale"),
        pytest.param([obs(C, True), obs(A, True), obs(B, False)], [A, C], id="two-stale-sorted"),
        pytest.param([obs(B, True), obs(A, None, error="HTTP 429")], [B], id="not-ready-is-not-stale"),
        pytest.param([obs(B, True, at=1), obs(B, False, at=2)], [], id="newest-wins-healed"),
        pytest.param([obs(B, False, at=2), obs(B, True, at=1)], [], id="newest-wins-out-of-order"),
        pytest.param([obs(B, False, at=1), obs(B, True, at=2)], [B], id="newest-wins-relapsed"),
        pytest.param([obs(B, False, at=5), obs(B, True, at=5)], [B], id="tie-later-in-order-wins"),
    ],
)
def test_stale_replicas(observations: list[ReplicaObservation], expected: list[str]) -> None:
    assert stale_replicas(observations) == expected


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [
        pytest.param([obs(B, True)], [obs(B, False, at=2000)], [B], id="restarted-replica-healed"),
        pytest.param([obs(B, True)], [obs(B, True, at=2000)], [], id="still-stale"),
        pytest.param([obs(B, True)], [obs(B, None, error="HTTP 429", at=2000)], [], id="not-ready-is-not-healed"),
        pytest.param([obs(B, True)], [obs(B, None, error="timeout", at=2000)], [], id="timeout-is-not-healed"),
        pytest.param([obs(B, True)], [], [], id="not-probed-again"),
        pytest.param([obs(A, False)], [obs(A, False, at=2000)], [], id="never-stale"),
        pytest.param([obs(A, True), obs(C, True)], [obs(C, False), obs(A, False)], [A, C], id="two-healed-sorted"),
        pytest.param([obs(A, True), obs(C, True)], [obs(C, False), obs(A, True)], [C], id="one-of-two-healed"),
    ],
)
def test_healed(previous: list[ReplicaObservation], current: list[ReplicaObservation], expected: list[str]) -> None:
    assert healed(previous, current) == expected


@pytest.mark.parametrize(
    ("before", "after", "serves", "expected"),
    [
        pytest.param("100", "150", True, True, id="rv-advanced-ghost-stays"),
        pytest.param("100", "100", True, False, id="rv-same-mere-lag"),
        pytest.param("150", "100", True, False, id="rv-went-back"),
        pytest.param("100", "150", False, False, id="ghost-gone"),
        pytest.param("100", "150", None, False, id="probe-failed"),
        pytest.param(None, "150", True, False, id="no-before"),
        pytest.param("100", None, True, False, id="no-after"),
        pytest.param("abc", "150", True, False, id="opaque-before"),
        pytest.param("100", "1e3", True, False, id="opaque-after"),
        pytest.param("-1", "5", True, False, id="negative"),
        pytest.param("9", "10", True, True, id="numeric-not-lexical"),
        pytest.param("٣", "٤", True, False, id="non-ascii-digits"),
        pytest.param("1" * 30, "2" * 30, True, False, id="absurdly-long"),
    ],
)
def test_missed_delete(before: str | None, after: str | None, serves: bool | None, expected: bool) -> None:
    assert missed_delete(before, after, serves) is expected


@pytest.mark.parametrize(
    ("last_checked", "now", "min_interval", "expected"),
    [
        pytest.param(100.0, 100.0, 30.0, False, id="just-checked"),
        pytest.param(100.0, 129.9, 30.0, False, id="inside-interval"),
        pytest.param(100.0, 130.0, 30.0, True, id="interval-elapsed"),
        pytest.param(100.0, 1000.0, 30.0, True, id="long-ago"),
        pytest.param(100.0, 100.0, 0.0, True, id="zero-interval"),
        pytest.param(200.0, 100.0, 30.0, True, id="clock-stepped-back"),
    ],
)
def test_should_reprobe(last_checked: float, now: float, min_interval: float, expected: bool) -> None:
    assert should_reprobe(last_checked, now, min_interval) is expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param((100.0, 100.0, -1.0), "min_interval must be >= 0, not -1.0", id="negative-interval"),
        pytest.param((math.nan, 100.0, 1.0), "last_checked must be a finite number, not nan", id="nan"),
        pytest.param((100.0, math.inf, 1.0), "now must be a finite number, not inf", id="inf"),
        pytest.param((True, 100.0, 1.0), "last_checked must be a finite number, not True", id="bool"),
        pytest.param(("100", 100.0, 1.0), "last_checked must be a finite number, not '100'", id="string"),
    ],
)
def test_should_reprobe_rejects_garbage(args: tuple, message: str) -> None:
    with pytest.raises(ValueError) as e:
        should_reprobe(*args)
    assert str(e.value) == message


@pytest.mark.parametrize(
    ("made", "expected"),
    [
        pytest.param(http_error(429, "Too Many Requests"), "HTTP 429: Too Many Requests", id="http-with-reason"),
        pytest.param(http_error(500), "HTTP 500", id="http-bare"),
        pytest.param(http_error(503, "line1\nline2\t x"), "HTTP 503: line1 line2 x", id="http-flattened"),
        pytest.param(http_error(502, "x" * 500), "HTTP 502: " + "x" * 197 + "...", id="http-clipped"),
        pytest.param(transport_error("timeout", "after 0.5s"), "timeout: after 0.5s", id="timeout"),
        pytest.param(transport_error("unreachable"), "unreachable", id="unreachable-bare"),
    ],
)
def test_error_strings(made: str, expected: str) -> None:
    assert made == expected


def test_transport_error_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError) as e:
        transport_error("dns")
    assert str(e.value) == "kind must be 'timeout' or 'unreachable', not 'dns'"


def test_latest_and_summarize() -> None:
    observations = [
        obs(A, True, at=1),
        obs(A, False, at=3),
        obs(B, True, at=2),
        obs(C, None, error="HTTP 429", at=2),
        obs("https://10.0.0.4:6443", None, error="timeout", at=2),
        obs("https://10.0.0.5:6443", None, error="HTTP 500", at=2),
    ]
    assert latest(observations)[A].checked_at == 3
    assert summarize(observations) == {
        "stale": [B],
        "consistent": [A],
        "not-ready": [C],
        "unreachable": ["https://10.0.0.4:6443"],
        "error": ["https://10.0.0.5:6443"],
    }
    assert summarize([]) == {c: [] for c in CLASSES}

