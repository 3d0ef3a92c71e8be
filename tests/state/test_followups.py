"""The follow-up queue (guard/engine/followups.py, the checker's): beyond the 1,000 running or queued,
follow-ups wait keyed by pod identity. A flood of distinct ghosts loses none; a looping ghost's repeated sightings are
coalesced into one waiting entry and counted (ghost_guard_followups_coalesced_total)."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY
from scripted import Etcd, ScriptedGets, check, pod, settings

from guard.engine.checker import FOLLOWUP_BACKLOG, Checker, Events
from guard.lab.harness import eventually


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def test_a_flood_of_distinct_ghosts_loses_no_follow_up_and_a_looping_ghost_is_coalesced():
    gets = ScriptedGets(Etcd())  # etcd has none of these pods: every one is a ghost
    gate = threading.Event()
    new: list = []
    sightings: list = []
    lock = threading.Lock()

    def on_new(p, decision, read):
        gate.wait(30)  # the audit store / probes are slow: the backlog fills
        with lock:
            new.append(p)

    def on_sighting(p, decision):
        with lock:
            sightings.append(p)

    # real background threads
    checker = Checker(settings(), gets, events=Events(new_ghost=on_new, sighting=on_sighting))
    coalesced0, dropped0 = counter("ghost_guard_followups_coalesced_total"), counter("ghost_guard_followups_dropped_total")
    n = 3 * FOLLOWUP_BACKLOG
    for i in range(n):
        assert check(checker, pod(f"ghost-{i}", f"uid-{i}")).is_ghost
    assert checker.followups_waiting() == n - FOLLOWUP_BACKLOG  # beyond the backlog: waiting, not dropped
    looping = pod("ghost-0", "uid-0")
    for _ in range(500):  # the scheduler loops on one ghost meanwhile: one waiting sighting
        assert check(checker, looping).is_ghost
    assert checker.followups_waiting() == n - FOLLOWUP_BACKLOG + 1
    assert counter("ghost_guard_followups_coalesced_total") - coalesced0 == 499
    gate.set()
    eventually(lambda: len(new) == n and checker.followups_waiting() == 0, 60, what="every follow-up run")
    assert len(set(new)) == n
    eventually(lambda: sightings == [looping], 10, what="the coalesced sighting")
    assert counter("ghost_guard_followups_dropped_total") == dropped0
