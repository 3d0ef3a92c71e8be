"""The flood budget on the checker (guard/engine/checker.py, guard/core/flood.py): first sightings of ghosts no replica
ever listed ("unsighted": forged names) get a record, an Event and a follow-up only within
--unsighted-ghost-rate/-burst, per namespace and in all; the rest are still blocked, counted in
ghost_guard_flood_shed_total and asked again at their next call; a real ("sighted") ghost's follow-up
runs before every queued unsighted one. Real checker threads, scripted etcd, a fake clock."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY
from scripted import Etcd, FakeClock, ScriptedGets, check, settings

from guard.core import flood
from guard.engine.checker import Checker, Events
from guard.lab.harness import eventually
from guard.core.verdict import PodRef


def shed(reason: str) -> float:
    return REGISTRY.get_sample_value("ghost_guard_flood_shed_total", {"reason": reason}) or 0.0


def test_a_flood_of_forged_names_is_shed_within_its_budget_and_a_real_ghost_goes_first():
    clock = FakeClock()
    real = PodRef("prod", "web-0", "uid-real")
    gate = threading.Event()
    started: list[PodRef] = []
    lock = threading.Lock()

    def on_new(p, decision, read):
        with lock:
            started.append(p)
        gate.wait(30)  # the probes are slow: what is admitted queues up behind the first two

    checker = Checker(settings(unsighted_ghost_rate=0.5, unsighted_ghost_burst=2), ScriptedGets(Etcd()), timer=clock,
                      events=Events(new_ghost=on_new, tier=lambda p: flood.SIGHTED if p == real else flood.UNSIGHTED))
    before = {r: shed(r) for r in flood.SHED_REASONS}
    forged = [PodRef(f"ns-{i % 30}", f"forged-{i}", f"uid-{i}") for i in range(150)]  # 5 in each of 30 namespaces
    for p in sorted(forged, key=lambda p: p.namespace):
        assert check(checker, p).is_ghost  # the verdict is never touched
    eventually(lambda: len(started) == 2, 10, what="both follow-up threads busy")
    assert check(checker, real).is_ghost
    gate.set()
    # all namespaces together: 10 x the burst of one (20 admitted: 2 in each of the first 10 namespaces asked)
    eventually(lambda: len(started) == 21, 20, what="every admitted follow-up run")
    assert started.index(real) <= 3, started  # before the 18 forged ones still queued when it came
    assert {p.namespace for p in started if p != real} == set(sorted({p.namespace for p in forged})[:10])
    assert shed(flood.NAMESPACE_BUDGET) - before[flood.NAMESPACE_BUDGET] == 10 * 3
    assert shed(flood.GLOBAL_BUDGET) - before[flood.GLOBAL_BUDGET] == 20 * 5
    assert shed(flood.QUEUE_FULL) == before[flood.QUEUE_FULL]

    # A shed ghost asked again once tokens are back is admitted then (a real ghost the guard could not
    # see is recorded at its next call); one already admitted is not announced twice.
    late = next(p for p in forged if p.namespace == "ns-29")
    assert check(checker, late).is_ghost
    assert late not in started
    clock.advance(2.0)  # 1 token in ns-29's bucket (0.5/s) and in the shared one (5/s)
    assert check(checker, late).is_ghost
    eventually(lambda: late in started, 10, what="the shed ghost's follow-up at its next call")
    assert check(checker, late).is_ghost and started.count(late) == 1


def test_repeated_sightings_of_a_forged_ghost_wait_as_one_while_a_real_ghost_counts_each():
    """A caller replaying a forged identity that was admitted cannot fill the follow-up queue with it;
    a real ghost's every sighting is still recorded (times_blocked stays exact)."""
    real, fake = PodRef("prod", "web-0", "uid-real"), PodRef("prod", "forged", "uid-forged")
    gate = threading.Event()
    seen: list[PodRef] = []
    lock = threading.Lock()

    def on_sighting(p, decision):
        gate.wait(30)
        with lock:
            seen.append(p)

    checker = Checker(settings(), ScriptedGets(Etcd()), timer=FakeClock(),
                      events=Events(sighting=on_sighting,
                                    tier=lambda p: flood.SIGHTED if p == real else flood.UNSIGHTED))
    for p in (real, fake):
        assert check(checker, p).is_ghost  # first sightings (no listener)
    for _ in range(50):
        assert check(checker, fake).is_ghost and check(checker, real).is_ghost
    gate.set()
    eventually(lambda: seen.count(real) == 50, 10, what="every sighting of the real ghost")
    eventually(lambda: fake in seen, 10, what="the forged ghost's sighting")
    assert seen.count(fake) <= 2  # the one running when the others came, and one waiting: not 50
