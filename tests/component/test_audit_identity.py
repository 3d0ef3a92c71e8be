"""The SQLite audit store keyed by identity (schema 4): a ghost Pod's (namespace, name, UID), a ghost Node's
(name, UID); the 3 -> 4 migration keeps every record, probe and heal of an existing file."""

from __future__ import annotations

import sqlite3

import pytest

from old_stores import write_old_store

from guard.audit.sqlite import SCHEMA_VERSION, AuditStore
from guard.core.records import HealAttempt, UnknownGhostError


@pytest.fixture
def store(tmp_path):
    s = AuditStore(str(tmp_path / "audit.db"))
    yield s
    s.close()


def block(s: AuditStore, name: str, uid: str = "u1", at: float = 100.0, namespace: str = "default") -> bool:
    return s.record_block(uid=uid, namespace=namespace, name=name, verdict="ghost-deleted", evidence={"reason": name},
                          at=at)


def test_one_uid_under_two_names_is_two_records_and_each_keeps_its_own_probes(store):
    """F9: a forged call records a live pod's UID under a name that is not its own; when the pod really becomes
    a ghost, its own record is written, and the replica probes land on it, not on the forged one."""
    assert block(store, "does-not-exist", at=100.0) is True
    assert block(store, "live-1", at=200.0) is True  # before schema 4: IdentityConflictError, nothing recorded
    assert block(store, "live-1", at=201.0) is False
    store.record_probe(uid="u1", replica="r1", serves=True, cache_resource_version="5", error=None, at=202.0,
                       namespace="default", name="live-1")
    records = {r.name: r for r in store.records()}
    assert records["live-1"].times_blocked == 2 and records["live-1"].stale_replicas == ["r1"]
    assert records["does-not-exist"].times_blocked == 1 and records["does-not-exist"].replicas == ()
    assert store.record("u1").name == "live-1"  # the most recently seen of that UID
    assert store.records(replica="r1") == [records["live-1"]]


def test_retract_and_heal_touch_only_the_named_identity(store):
    block(store, "forged")
    block(store, "real", at=110.0)
    assert store.retract(uid="u1", at=120.0, namespace="default", name="forged") is True
    store.record_heal(uid="u1", action="placeholder", outcome="healed", detail="ok", at=130.0, namespace="default",
                      name="real")
    by_name = {r.name: r for r in store.records(retracted=True)}
    assert by_name["forged"].retracted_at == 120.0 and by_name["real"].retracted_at is None
    assert by_name["real"].heals == (HealAttempt(130.0, "placeholder", "healed", "ok"),)
    assert by_name["forged"].heals == ()
    assert store.retract(uid="u1", at=140.0, namespace="default", name="nobody") is False
    with pytest.raises(UnknownGhostError):
        store.record_heal(uid="u2", action="none", outcome="alive", detail="", at=1.0)


def test_ghost_nodes_are_recorded_once_per_identity_with_their_replicas_and_heals(store):
    assert store.record_node(name="node-a", uid="n1", serving=["r2"], at=100.0, evidence={"quorum_get": "NotFound"})
    assert not store.record_node(name="node-a", uid="n1", serving=["r2"], at=110.0)
    assert store.record_node(name="node-a", uid="n2", serving=["r1"], at=120.0)  # recreated, lost again: another
    store.record_node_heal(name="node-a", uid="n1", action="placeholder", outcome="healed", detail="ok", at=130.0)
    assert not store.record_node(name="node-a", uid="n1", serving=[], healed=["r2"], at=131.0)
    n1, n2 = store.node_records()  # most recently seen first
    assert (n1.name, n1.uid, n1.times_detected, n1.first_seen, n1.last_seen) == ("node-a", "n1", 2, 100.0, 131.0)
    assert n1.stale_replicas == [] and [(r.replica, r.first_seen_serving, r.healed_at) for r in n1.replicas] == [
        ("r2", 100.0, 131.0)]
    assert n1.heals == (HealAttempt(130.0, "placeholder", "healed", "ok"),)
    assert n1.evidence == {"quorum_get": "NotFound"}
    assert (n2.uid, n2.stale_replicas, n2.heals) == ("n2", ["r1"], ())
    assert store.records(retracted=True) == [] and store.record("n1") is None  # pods and Nodes apart
    with pytest.raises(UnknownGhostError):
        store.record_node_heal(name="node-b", uid="", action="none", outcome="alive", detail="", at=1.0)


def test_node_records_are_pruned_like_pod_records(tmp_path):
    with AuditStore(str(tmp_path / "a.db"), max_age_seconds=10) as s:
        s.record_node(name="node-a", uid="n1", serving=["r1"], at=100.0)
        s.record_node_heal(name="node-a", uid="", action="placeholder", outcome="healed", detail="", at=100.0)
        assert s.prune(now=200.0) == 1 and s.node_records() == []
        conn = sqlite3.connect(s.path)
        assert [conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("replica_observations", "heal_attempts")] == [0, 0]
        conn.close()


def test_a_version_3_store_is_migrated_and_keeps_its_records_probes_and_heals(tmp_path):
    path = str(tmp_path / "v3.db")
    write_old_store(path, 3, """
        INSERT INTO ghosts VALUES ('u1', 'default', 'web-0', 'ghost-deleted', '{"reason": "r"}', 1.0, 2.0, 3, NULL);
        INSERT INTO ghosts VALUES ('u2', 'default', 'web-1', 'ghost-replaced', '{}', 1.0, 5.0, 1, 6.0);
        INSERT INTO replica_observations VALUES ('u1', 'r1', 1, '7', NULL, 2.0, 1.5, NULL);
        INSERT INTO heal_attempts VALUES ('u1', 3.0, 'placeholder', 'healed', 'ok');
    """)
    with AuditStore(path) as s:
        (web0,) = s.records()
        assert (web0.uid, web0.name, web0.times_blocked, web0.stale_replicas) == ("u1", "web-0", 3, ["r1"])
        assert web0.heals == (HealAttempt(3.0, "placeholder", "healed", "ok"),)
        assert s.record("u2").retracted_at == 6.0
        block(s, "forged", uid="u1", at=10.0)  # keyed by identity from now on
        assert sorted(r.name for r in s.records()) == ["forged", "web-0"]
    with AuditStore(path) as s:  # opened again: nothing migrated twice
        assert len(s.records(retracted=True)) == 3
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    assert not conn.execute("SELECT name FROM sqlite_master WHERE name LIKE '%_v3'").fetchall()
    conn.close()
