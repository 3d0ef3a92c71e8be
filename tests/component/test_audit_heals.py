"""The audit store's heal attempts (serve --heal): record_heal, AuditRecord.heals, the v2 -> v3 migration."""

from __future__ import annotations

import sqlite3

import pytest

from old_stores import write_old_store

from guard.audit.sqlite import SCHEMA_VERSION, AuditStore
from guard.core.records import MAX_HEALS_PER_GHOST, HealAttempt, UnknownGhostError


@pytest.fixture
def store(tmp_path):
    s = AuditStore(str(tmp_path / "audit.db"))
    s.record_block(uid="u1", namespace="default", name="web-0", verdict="ghost-deleted", evidence={"reason": "r"}, at=100.0)
    yield s
    s.close()


def test_heals_are_kept_oldest_first_with_the_record(store):
    store.record_heal(uid="u1", action="placeholder", outcome="frozen", detail="replica 10.0.0.2:6443 frozen", at=101.0)
    store.record_heal(uid="u1", action="placeholder", outcome="healed", detail="every replica agrees", at=102.0)
    (rec,) = store.records()
    assert rec.heals == (HealAttempt(101.0, "placeholder", "frozen", "replica 10.0.0.2:6443 frozen"),
                         HealAttempt(102.0, "placeholder", "healed", "every replica agrees"))


def test_only_the_newest_heals_are_kept(store):
    for i in range(MAX_HEALS_PER_GHOST + 5):
        store.record_heal(uid="u1", action="annotate", outcome="timeout", detail=str(i), at=200.0 + i)
    heals = store.record("u1").heals
    assert len(heals) == MAX_HEALS_PER_GHOST
    assert heals[0].detail == "5" and heals[-1].detail == str(MAX_HEALS_PER_GHOST + 4)


@pytest.mark.parametrize("kwargs, error", [
    pytest.param({"uid": "nope"}, UnknownGhostError, id="unknown-ghost"),
    pytest.param({"action": "restart"}, ValueError, id="unknown-action"),
    pytest.param({"outcome": "maybe"}, ValueError, id="unknown-outcome"),
    pytest.param({"at": float("nan")}, ValueError, id="bad-time"),
])
def test_bad_heals_are_refused(store, kwargs, error):
    args = {"uid": "u1", "action": "none", "outcome": "alive", "detail": "d", "at": 1.0, **kwargs}
    with pytest.raises(error):
        store.record_heal(**args)
    assert store.record("u1").heals == ()


def test_a_version_2_store_is_migrated_and_keeps_its_records(tmp_path):
    path = str(tmp_path / "v2.db")
    write_old_store(path, 2, """
        INSERT INTO ghosts VALUES ('u1', 'default', 'web-0', 'ghost-deleted', '{"reason": "r"}', 1.0, 2.0, 3, NULL);
    """)
    with AuditStore(path) as s:
        (rec,) = s.records()
        assert (rec.uid, rec.times_blocked, rec.heals) == ("u1", 3, ())
        s.record_heal(uid="u1", action="placeholder", outcome="healed", detail="ok", at=3.0)
        assert s.record("u1").heals == (HealAttempt(3.0, "placeholder", "healed", "ok"),)
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
    conn.close()


def test_pruning_a_ghost_drops_its_heals(tmp_path):
    with AuditStore(str(tmp_path / "a.db"), max_age_seconds=10) as s:
        s.record_block(uid="u1", namespace="default", name="web-0", verdict="ghost-deleted", evidence={}, at=100.0)
        s.record_heal(uid="u1", action="placeholder", outcome="healed", detail="ok", at=100.0)
        assert s.prune(now=200.0) == 1
        conn = sqlite3.connect(s.path)
        assert conn.execute("SELECT count(*) FROM heal_attempts").fetchone()[0] == 0
        conn.close()
