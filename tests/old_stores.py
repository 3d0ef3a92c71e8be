"""Audit stores as older guards wrote them (SQLite schema versions before ``guard.audit.sqlite.SCHEMA_VERSION``), for
the migration tests: each must still open, with every record kept."""

from __future__ import annotations

import sqlite3

from guard.audit.sqlite import APPLICATION_ID

# Schema 2 (ghosts keyed by UID, with retracted_at) and the replica probes; schema 3 adds heal_attempts.
V2_TABLES = """
    CREATE TABLE ghosts (uid TEXT PRIMARY KEY, namespace TEXT NOT NULL, name TEXT NOT NULL, verdict TEXT NOT NULL,
        evidence TEXT NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL, times_blocked INTEGER NOT NULL,
        retracted_at REAL);
    CREATE TABLE replica_observations (uid TEXT NOT NULL, replica TEXT NOT NULL, serves INTEGER,
        cache_resource_version TEXT, error TEXT, last_checked REAL NOT NULL, first_seen_serving REAL, healed_at REAL,
        PRIMARY KEY (uid, replica));
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
V3_TABLES = V2_TABLES + """
    CREATE INDEX ghosts_last_seen ON ghosts (last_seen);
    CREATE INDEX ghosts_namespace ON ghosts (namespace, last_seen);
    CREATE INDEX replica_observations_replica ON replica_observations (replica);
    CREATE TABLE heal_attempts (uid TEXT NOT NULL, at REAL NOT NULL, action TEXT NOT NULL, outcome TEXT NOT NULL,
        detail TEXT NOT NULL);
    CREATE INDEX heal_attempts_uid ON heal_attempts (uid, at);
"""


def write_old_store(path: str, version: int, rows: str) -> None:
    """A ghost-guard audit store of schema ``version`` (2 or 3) at ``path``, holding ``rows`` (INSERT statements)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executescript({2: V2_TABLES, 3: V3_TABLES}[version] + rows)
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.close()
