"""The one token bucket (guard/core/token_bucket.py), on a fake clock: the burst, the rate, the wait
it names, a token given back, a clock that goes back, and the arguments it refuses."""

from __future__ import annotations

import threading

import pytest

from guard.core.token_bucket import TokenBucket


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# Each step: (seconds the clock moves first, what to do: "take" or "give", what take answers).
CASES = {
    "a burst, then the rate": (2.0, 3, [
        (0.0, "take", 0.0), (0.0, "take", 0.0), (0.0, "take", 0.0),
        (0.0, "take", 0.5),  # one token every 0.5 s
        (0.25, "take", 0.25),  # waiting takes nothing
        (0.25, "take", 0.0),
    ]),
    "refilled, never beyond the burst": (2.0, 3, [
        (0.0, "take", 0.0), (0.0, "take", 0.0), (0.0, "take", 0.0),
        (10.0, "take", 0.0), (0.0, "take", 0.0), (0.0, "take", 0.0), (0.0, "take", 0.5),
    ]),
    "a token given back is taken again": (1.0, 1, [
        (0.0, "take", 0.0), (0.0, "take", 1.0), (0.0, "give", None), (0.0, "take", 0.0), (0.0, "take", 1.0),
    ]),
    "giving back never overfills": (1.0, 2, [
        (0.0, "give", None), (0.0, "take", 0.0), (0.0, "take", 0.0), (0.0, "take", 1.0),
    ]),
    "a clock going back refills nothing": (1.0, 1, [
        (0.0, "take", 0.0), (-10.0, "take", 1.0), (11.0, "take", 0.0), (0.5, "take", 0.5),
    ]),
    "a slow rate: seconds per token": (0.2, 1, [
        (0.0, "take", 0.0), (0.0, "take", 5.0), (4.0, "take", 1.0), (1.0, "take", 0.0),
    ]),
    "a fractional burst (--verify-qps 2.5)": (2.5, 2.5, [
        (0.0, "take", 0.0), (0.0, "take", 0.0), (0.0, "take", 0.2), (0.2, "take", 0.0), (0.0, "take", 0.4),
    ]),
}


@pytest.mark.parametrize("rate, burst, steps", list(CASES.values()), ids=list(CASES))
def test_token_bucket(rate, burst, steps):
    clock = Clock()
    bucket = TokenBucket(rate, burst, clock)
    for i, (move, action, expected) in enumerate(steps):
        clock.now += move
        if action == "give":
            bucket.give_back()
        else:
            assert bucket.take() == pytest.approx(expected, abs=1e-9), f"step {i}"


@pytest.mark.parametrize("rate, burst", [pytest.param(0, 1, id="no-rate"), pytest.param(-1, 1, id="negative-rate"),
                                         pytest.param(float("nan"), 1, id="nan-rate"), pytest.param(1, 0, id="no-burst"),
                                         pytest.param(1, 0.5, id="burst-below-one")])
def test_token_bucket_refuses_nonsense(rate, burst):
    with pytest.raises(ValueError):
        TokenBucket(rate, burst, Clock())


def test_token_bucket_reads_the_clock_it_is_given_only():
    clock = Clock(0.0)
    bucket = TokenBucket(1.0, 1, clock)
    assert bucket.take() == 0.0
    clock.now = 1e9  # only this clock counts, whatever the machine's time
    assert bucket.take() == 0.0


def test_token_bucket_gives_each_token_once_across_threads():
    clock = Clock()
    bucket = TokenBucket(1.0, 1000, clock)
    taken: list[float] = []

    def take() -> None:
        for _ in range(250):
            taken.append(bucket.take())

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(1 for w in taken if w == 0.0) == 1000
