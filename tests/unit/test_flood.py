"""The flood rules (guard/core/flood.py), with a fake clock: the budget for first sightings of ghosts no
replica ever listed, per namespace and in all; the retention order (confirmed records kept over
unconfirmed ones), as the rule says and as the SQLite store applies it at --audit-max-records."""

from __future__ import annotations

import pytest

from guard.core import flood
from guard.audit.sqlite import AuditStore
from guard.core.records import AuditRecord, ReplicaState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_namespace_gets_its_burst_then_its_rate():
    clock = Clock()
    budget = flood.FloodBudget(0.5, 3, clock)
    assert [budget.admit("a") for _ in range(4)] == [None, None, None, flood.NAMESPACE_BUDGET]
    clock.now += 1.9
    assert budget.admit("a") == flood.NAMESPACE_BUDGET  # 0.95 token
    clock.now += 0.1
    assert budget.admit("a") is None
    assert budget.admit("b") is None  # another namespace has its own bucket


def test_all_namespaces_together_get_ten_times_one_and_a_refusal_costs_the_namespace_nothing():
    clock = Clock()
    budget = flood.FloodBudget(1.0, 2, clock)
    admitted = [ns for ns in (f"ns-{i}" for i in range(100)) if budget.admit(ns) is None]
    assert len(admitted) == flood.GLOBAL_FACTOR * 2
    assert budget.admit("ns-99") == flood.GLOBAL_BUDGET
    clock.now += 0.15  # 1.5 shared tokens back (10/s); ns-99 still holds both of its own
    assert budget.admit("ns-99") is None
    clock.now += 0.1
    assert budget.admit("ns-99") is None
    clock.now += 0.15  # the shared bucket has tokens again, ns-99 only 0.4
    assert budget.admit("ns-99") == flood.NAMESPACE_BUDGET


def test_namespaces_remembered_are_bounded():
    budget = flood.FloodBudget(1.0, 1, Clock(), max_namespaces=3)
    for ns in "abcd":
        budget.admit(ns)
    assert len(budget._namespaces) == 3 and "a" not in budget._namespaces


def record(uid: str, last_seen: float, *, served: bool) -> AuditRecord:
    replicas = (ReplicaState("10.0.0.2:6443", served, "7", None, last_seen, last_seen if served else None, None),)
    return AuditRecord(uid=uid, namespace="ns", name=uid, verdict="ghost-deleted", evidence={}, first_seen=0.0,
                       last_seen=last_seen, times_blocked=1, replicas=replicas)


def test_retention_keeps_confirmed_records_first_then_the_most_recently_seen():
    records = [record("old-real", 1.0, served=True), record("forged-new", 9.0, served=False),
               record("forged-old", 2.0, served=False), record("real", 5.0, served=True)]
    assert [r.uid for r in sorted(records, key=flood.prune_key)] == ["real", "old-real", "forged-new", "forged-old"]


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_sqlite_store_prunes_in_that_order(tmp_path, keep):
    with AuditStore(tmp_path / "a.db", max_records=keep) as store:
        # a real ghost first, confirmed (a replica was seen serving it) and never asked again ...
        store.record_block(uid="real", namespace="ns", name="real", verdict="ghost-deleted", evidence={}, at=10.0)
        store.record_probe(uid="real", replica="10.0.0.2:6443", serves=True, cache_resource_version="7", error=None,
                           at=11.0)
        # ... then forged names, each newer than it, one only probed (no replica serves it)
        for i in range(5):
            store.record_block(uid=f"forged-{i}", namespace="ns", name=f"forged-{i}", verdict="ghost-deleted",
                               evidence={}, at=20.0 + i)
        store.record_probe(uid="forged-4", replica="10.0.0.2:6443", serves=False, cache_resource_version="8",
                           error=None, at=30.0)
        assert store.prune(now=40.0) == 6 - keep
        kept = [r.uid for r in store.records()]
    assert sorted(kept) == sorted(["real"] + [f"forged-{i}" for i in range(4, 5 - keep, -1)])
