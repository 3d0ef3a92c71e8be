"""The audit store: one durable, deduplicated record per blocked ghost Pod.

Embedded SQLite (stdlib ``sqlite3``), no server to run. Safe for several
gunicorn workers and several guard processes sharing one file:

- WAL journal and ``synchronous=FULL``: a write is on disk when its commit
  returns, so every *acknowledged* record (``record_block`` returned) survives
  ``kill -9`` of any process, and a killed writer never leaves a torn record
  (a transaction is all or nothing).
- Every write runs in ``BEGIN IMMEDIATE``, so writers queue on the file lock
  (``busy_timeout``) instead of failing with "database is locked" on a
  read-to-write upgrade.
- One connection per thread and per process. Connections are opened lazily
  and never cross a ``fork()``: a connection opened in another process id is
  dropped (not closed: closing would touch the parent's locks) and reopened.

Three tables: ``ghosts`` (one row per ghost UID), ``replica_observations``
(one row per UID and apiserver replica: the newest probe of that replica's
watch cache, plus when it started serving the ghost and when it healed) and
``heal_attempts`` (``serve --heal``). What a record holds, its field limits and
the errors are :mod:`guard.core.records`; this module maps them onto the tables
(``SCHEMA_VERSION`` and the migrations below). A fourth table, ``meta``, is the
``/readyz`` write check's scratch row (``check``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import stat
import threading
from collections.abc import Mapping
from typing import Any, Final

from guard.core.records import (
    HEAL_ACTIONS, HEAL_OUTCOMES, MAX_ERROR, MAX_HEAL_DETAIL, MAX_HEALS_PER_GHOST, MAX_NAME, MAX_NAMESPACE, MAX_REPLICA,
    MAX_RESOURCE_VERSION, MAX_UID, VERDICTS, AuditError, AuditRecord, HealAttempt, IdentityConflictError,
    NewRecordHook, ReplicaState, UnknownGhostError, check_text, check_time, evidence_json,
)

log = logging.getLogger("guard.audit")

APPLICATION_ID: Final = 0x47474144  # "GGAD": marks the file as a ghost-guard audit store
SCHEMA_VERSION: Final = 3  # 2: ghosts.retracted_at; 3: heal_attempts
BUSY_TIMEOUT_SECONDS: Final = 5.0
CHECK_BUSY_TIMEOUT_SECONDS: Final = 1.0
PRUNE_EVERY_WRITES: Final = 1000
PRUNE_EVERY_SECONDS: Final = 60.0

_INHERITED: list[sqlite3.Connection] = []
"""Connections opened before a fork(), kept alive (unused) in the child so they are never closed there."""

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS ghosts (
    uid           TEXT PRIMARY KEY,
    namespace     TEXT NOT NULL,
    name          TEXT NOT NULL,
    verdict       TEXT NOT NULL,
    evidence      TEXT NOT NULL,
    first_seen    REAL NOT NULL,
    last_seen     REAL NOT NULL,
    times_blocked INTEGER NOT NULL,
    retracted_at  REAL
);
CREATE INDEX IF NOT EXISTS ghosts_last_seen ON ghosts (last_seen);
CREATE INDEX IF NOT EXISTS ghosts_namespace ON ghosts (namespace, last_seen);
CREATE TABLE IF NOT EXISTS replica_observations (
    uid                    TEXT NOT NULL,
    replica                TEXT NOT NULL,
    serves                 INTEGER,
    cache_resource_version TEXT,
    error                  TEXT,
    last_checked           REAL NOT NULL,
    first_seen_serving     REAL,
    healed_at              REAL,
    PRIMARY KEY (uid, replica)
);
CREATE INDEX IF NOT EXISTS replica_observations_replica ON replica_observations (replica);
CREATE TABLE IF NOT EXISTS heal_attempts (
    uid     TEXT NOT NULL,
    at      REAL NOT NULL,
    action  TEXT NOT NULL,
    outcome TEXT NOT NULL,
    detail  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS heal_attempts_uid ON heal_attempts (uid, at);
"""


class AuditPathError(AuditError):
    """The path is not usable as an audit store (a directory, not SQLite, another program's database)."""


class AuditStore:
    """The durable, deduplicated record of blocked ghosts, on one SQLite file.

    ``max_age_seconds``/``max_records`` bound retention: :meth:`prune` drops
    records not seen for longer than ``max_age_seconds``, then the least
    recently seen beyond ``max_records``, unconfirmed records (no replica
    seen serving the ghost) before confirmed ones. :meth:`record_block` prunes by itself
    every 1000 writes or 60 s (of its ``at`` times), per process.

    ``on_new`` (a :data:`guard.core.records.NewRecordHook`): called with each record
    new to the file, after the commit that inserted it, once per UID across every
    process sharing the file (``guard.engine.incident`` writes the new-ghost line with it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_age_seconds: float = 30 * 86400,
        max_records: int = 100_000,
        on_new: NewRecordHook | None = None,
    ) -> None:
        if isinstance(max_age_seconds, bool) or not isinstance(max_age_seconds, (int, float)) or not math.isfinite(max_age_seconds) or max_age_seconds <= 0:
            raise ValueError(f"max_age_seconds must be a positive number, not {max_age_seconds!r}")
        if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
            raise ValueError(f"max_records must be a positive integer, not {max_records!r}")
        self.path = _check_path(path)
        self.max_age_seconds = float(max_age_seconds)
        self.max_records = max_records
        self._on_new = on_new
        self._local = threading.local()
        self._prune_lock = threading.Lock()
        self._writes_since_prune = 0
        self._last_prune_at: float | None = None
        self._closed = False
        # Validate and initialise now, so a bad path fails at startup, then drop
        # the connection: the process may fork (gunicorn preload) before use.
        self._connection()
        self._drop_connection()

    # -- writes ------------------------------------------------------------

    def record_block(self, *, uid: str, namespace: str, name: str, verdict: str, evidence: Mapping[str, Any], at: float) -> bool:
        """Record that ghost ``uid`` was blocked at ``at``. True if the UID is new to the store.

        Returns only after the commit is durable: that is the acknowledgement.
        A known UID gets ``times_blocked + 1``, ``last_seen`` = the newest
        ``at``, ``first_seen`` = the oldest, and the newest verdict. Evidence
        accumulates: the stored object is updated with the new one's keys
        (the newer write wins a key), so a later sighting that knows less
        keeps what the quorum GET said (if the merge would pass 4 KiB, the
        newer evidence alone is kept).
        """
        check_text("uid", uid, MAX_UID)
        check_text("namespace", namespace, MAX_NAMESPACE)
        check_text("name", name, MAX_NAME)
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; not {verdict!r}")
        evidence_text = evidence_json(evidence)
        at = check_time("at", at)
        conn = self._connection()
        try:
            with _immediate(conn):
                row = conn.execute("SELECT evidence, last_seen, namespace, name FROM ghosts WHERE uid = ?",
                                   (uid,)).fetchone()
                if row is not None and (row[2], row[3]) != (namespace, name):
                    raise IdentityConflictError(f"uid {uid} is recorded as {row[2]}/{row[3]}, not {namespace}/{name}: "
                                                f"not recorded")
                if row is None:
                    conn.execute(
                        "INSERT INTO ghosts (uid, namespace, name, verdict, evidence, first_seen, last_seen, times_blocked)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, 1)",
                        (uid, namespace, name, verdict, evidence_text, at, at),
                    )
                else:
                    stored, last_seen = _load_evidence(row[0]), row[1]
                    newest = at >= last_seen
                    merged = {**stored, **evidence} if newest else {**evidence, **stored}
                    merged_json = evidence_json(merged, strict=False) or (evidence_text if newest else row[0])
                    conn.execute(
                        "UPDATE ghosts SET retracted_at = NULL,"
                        " verdict = CASE WHEN ? THEN ? ELSE verdict END, evidence = ?,"
                        " first_seen = min(first_seen, ?), last_seen = max(last_seen, ?),"
                        " times_blocked = times_blocked + 1"
                        " WHERE uid = ?",
                        (newest, verdict, merged_json, at, at, uid),
                    )
        except sqlite3.Error as e:
            raise AuditError(f"cannot record block of {namespace}/{name} in {self.path}: {e}") from e
        new = row is None
        if new:
            self._announce(AuditRecord(uid=uid, namespace=namespace, name=name, verdict=verdict,
                                       evidence=dict(evidence), first_seen=at, last_seen=at, times_blocked=1))
        self._maybe_prune(at)
        return new

    def retract(self, *, uid: str, at: float, namespace: str | None = None, name: str | None = None) -> bool:
        """Mark ghost ``uid``'s record retracted at ``at`` (etcd showed the pod pending after all) and
        forget its replica probes, so that no report names a replica for it. True if there was a record.
        A later block of the same UID (a new, proven verdict) clears the mark. With ``namespace`` and
        ``name``, only a record of that identity is touched."""
        check_text("uid", uid, MAX_UID)
        at = check_time("at", at)
        conn = self._connection()
        try:
            with _immediate(conn):
                row = conn.execute("SELECT namespace, name FROM ghosts WHERE uid = ?", (uid,)).fetchone()
                if row is None or (namespace is not None and tuple(row) != (namespace, name)):
                    return False
                found = conn.execute("UPDATE ghosts SET retracted_at = ? WHERE uid = ?", (at, uid)).rowcount
                conn.execute("DELETE FROM replica_observations WHERE uid = ?", (uid,))
        except sqlite3.Error as e:
            raise AuditError(f"cannot retract the record of {uid} in {self.path}: {e}") from e
        return bool(found)

    def record_probe(self, *, uid: str, replica: str, serves: bool | None, cache_resource_version: str | None, error: str | None, at: float,
                     namespace: str | None = None, name: str | None = None) -> None:
        """Record one probe of ``replica``'s watch cache for ghost ``uid``.

        Keeps the newest probe per (uid, replica): a probe older than the one
        stored is ignored. ``first_seen_serving`` is set when the replica is
        first seen serving the ghost (again, after a heal); ``healed_at`` when a
        probe that answered finds it no longer serving it. A failed probe
        (``serves=None``) changes neither. ``error`` is clipped to 512
        characters. Raises :class:`UnknownGhostError` (an :class:`AuditError`
        and a :class:`LookupError`) if ``uid`` has no record. With ``namespace``
        and ``name``, a record of another identity is left alone (no error).
        """
        check_text("uid", uid, MAX_UID)
        probe = _probe_row(replica, serves, cache_resource_version, error, at)
        conn = self._connection()
        try:
            with _immediate(conn):
                row = conn.execute("SELECT retracted_at, namespace, name FROM ghosts WHERE uid = ?", (uid,)).fetchone()
                if row is None:
                    raise UnknownGhostError(f"no audit record for uid {uid!r}: record_block first")
                if row[0] is not None:  # withdrawn: a probe finishing late names no replica
                    return
                if namespace is not None and (row[1], row[2]) != (namespace, name):  # another pod's record
                    return
                conn.execute(
                    "INSERT INTO replica_observations"
                    " (uid, replica, serves, cache_resource_version, error, last_checked, first_seen_serving, healed_at)"
                    " VALUES (?1, ?2, ?3, ?4, ?5, ?6, CASE WHEN ?3 = 1 THEN ?6 END, NULL)"
                    " ON CONFLICT (uid, replica) DO UPDATE SET"
                    "  serves = excluded.serves,"
                    "  cache_resource_version = excluded.cache_resource_version,"
                    "  error = excluded.error,"
                    "  last_checked = excluded.last_checked,"
                    "  first_seen_serving = CASE"
                    "   WHEN ?3 = 1 AND (first_seen_serving IS NULL OR healed_at IS NOT NULL) THEN ?6"
                    "   ELSE first_seen_serving END,"
                    "  healed_at = CASE"
                    "   WHEN ?3 = 1 THEN NULL"
                    "   WHEN ?3 = 0 AND first_seen_serving IS NOT NULL AND healed_at IS NULL THEN ?6"
                    "   ELSE healed_at END"
                    " WHERE excluded.last_checked >= replica_observations.last_checked",
                    (uid, *probe),
                )
        except sqlite3.Error as e:
            raise AuditError(f"cannot record a probe of ghost {uid} in {self.path}: {e}") from e

    def record_heal(self, *, uid: str, action: str, outcome: str, detail: str, at: float) -> None:
        """Record one heal attempt of ghost ``uid`` (the newest MAX_HEALS_PER_GHOST are kept).

        Raises :class:`UnknownGhostError` if ``uid`` has no record, ValueError for an unknown
        ``action``/``outcome``; ``detail`` is clipped to 1024 characters."""
        check_text("uid", uid, MAX_UID)
        if action not in HEAL_ACTIONS:
            raise ValueError(f"action must be one of {', '.join(HEAL_ACTIONS)}; not {action!r}")
        if outcome not in HEAL_OUTCOMES:
            raise ValueError(f"outcome must be one of {', '.join(HEAL_OUTCOMES)}; not {outcome!r}")
        if not isinstance(detail, str):
            raise ValueError("detail must be a string")
        at = check_time("at", at)
        conn = self._connection()
        try:
            with _immediate(conn):
                if conn.execute("SELECT 1 FROM ghosts WHERE uid = ?", (uid,)).fetchone() is None:
                    raise UnknownGhostError(f"no audit record for uid {uid!r}: record_block first")
                conn.execute("INSERT INTO heal_attempts (uid, at, action, outcome, detail) VALUES (?, ?, ?, ?, ?)",
                             (uid, at, action, outcome, detail[:MAX_HEAL_DETAIL]))
                conn.execute("DELETE FROM heal_attempts WHERE uid = ?1 AND rowid NOT IN (SELECT rowid FROM heal_attempts"
                             " WHERE uid = ?1 ORDER BY at DESC, rowid DESC LIMIT ?2)", (uid, MAX_HEALS_PER_GHOST))
        except sqlite3.Error as e:
            raise AuditError(f"cannot record a heal of ghost {uid} in {self.path}: {e}") from e

    def prune(self, *, now: float) -> int:
        """Drop records last seen before ``now - max_age_seconds``, then, beyond ``max_records``, the least
        recently seen unconfirmed ones (no probe saw a replica serve the ghost), then confirmed ones.

        Returns how many ghost records were dropped (their replica rows go too).
        """
        now = check_time("now", now)
        conn = self._connection()
        try:
            with _immediate(conn):
                by_age = conn.execute("DELETE FROM ghosts WHERE last_seen < ?", (now - self.max_age_seconds,)).rowcount
                # Confirmed records (a probe saw a replica serve the ghost) are kept before unconfirmed ones,
                # the most recently seen first within each (guard.core.flood.prune_key): a flood of forged names
                # never pushes out the records that name a stale replica.
                by_count = conn.execute(
                    "DELETE FROM ghosts WHERE uid IN (SELECT uid FROM ghosts ORDER BY EXISTS (SELECT 1 FROM"
                    " replica_observations r WHERE r.uid = ghosts.uid AND r.first_seen_serving IS NOT NULL) DESC,"
                    " last_seen DESC, uid LIMIT -1 OFFSET ?)",
                    (self.max_records,),
                ).rowcount
                if by_age or by_count:
                    conn.execute("DELETE FROM replica_observations WHERE uid NOT IN (SELECT uid FROM ghosts)")
                    conn.execute("DELETE FROM heal_attempts WHERE uid NOT IN (SELECT uid FROM ghosts)")
        except sqlite3.Error as e:
            raise AuditError(f"cannot prune {self.path}: {e}") from e
        return by_age + by_count

    # -- reads -------------------------------------------------------------

    def records(
        self,
        *,
        namespace: str | None = None,
        verdict: str | None = None,
        replica: str | None = None,
        since: float | None = None,
        limit: int | None = None,
        retracted: bool = False,
    ) -> list[AuditRecord]:
        """Records, most recently seen first.

        Filters: ``namespace``; ``verdict``; ``replica`` (ghosts that replica
        was ever seen serving); ``since`` (last seen at or after it);
        ``limit`` (at most that many records); ``retracted`` (also records whose
        verdict was withdrawn; left out by default).
        """
        clauses: list[str] = [] if retracted else ["retracted_at IS NULL"]
        params: list[Any] = []
        if namespace is not None:
            check_text("namespace", namespace, MAX_NAMESPACE)
            clauses.append("namespace = ?")
            params.append(namespace)
        if verdict is not None:
            if verdict not in VERDICTS:
                raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; not {verdict!r}")
            clauses.append("verdict = ?")
            params.append(verdict)
        if replica is not None:
            check_text("replica", replica, MAX_REPLICA)
            clauses.append("uid IN (SELECT uid FROM replica_observations WHERE replica = ? AND first_seen_serving IS NOT NULL)")
            params.append(replica)
        if since is not None:
            clauses.append("last_seen >= ?")
            params.append(check_time("since", since))
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"limit must be a non-negative integer, not {limit!r}")
        return self._select(" AND ".join(clauses), params, limit=limit)

    def _select(self, where: str, params: list[Any], *, limit: int | None) -> list[AuditRecord]:
        # ``where`` is built from fixed clause texts only; every value is bound.
        sql = ("SELECT uid, namespace, name, verdict, evidence, first_seen, last_seen, times_blocked, retracted_at"
               " FROM ghosts")
        if where:
            sql += " WHERE " + where
        sql += " ORDER BY last_seen DESC, uid"
        if limit is not None:
            sql += " LIMIT ?"
            params = [*params, limit]
        conn = self._connection()
        try:
            # One read transaction: the ghosts and their replica rows are one snapshot.
            conn.execute("BEGIN")
            try:
                rows = conn.execute(sql, params).fetchall()
                replicas = self._replica_rows(conn, [r[0] for r in rows])
                heals = self._heal_rows(conn, [r[0] for r in rows])
            finally:
                conn.execute("COMMIT")
        except sqlite3.Error as e:
            raise AuditError(f"cannot read {self.path}: {e}") from e
        return [
            AuditRecord(
                uid=uid,
                namespace=ns,
                name=nm,
                verdict=vd,
                evidence=_load_evidence(ev),
                first_seen=fs,
                last_seen=ls,
                times_blocked=tb,
                replicas=tuple(replicas.get(uid, ())),
                retracted_at=ra,
                heals=tuple(heals.get(uid, ())),
            )
            for uid, ns, nm, vd, ev, fs, ls, tb, ra in rows
        ]

    def record(self, uid: str) -> AuditRecord | None:
        """The record of ghost ``uid``, or None (e.g. to decide on a re-probe with ``should_reprobe``)."""
        check_text("uid", uid, MAX_UID)
        found = self._select("uid = ?", [uid], limit=1)
        return found[0] if found else None

    def check(self) -> str | None:
        """None if the store is writable now, else one line saying why (``/readyz`` uses it)."""
        if self._closed:
            return "audit store is closed"
        try:
            conn = self._connection()
            # A probe must answer quickly: wait at most CHECK_BUSY_TIMEOUT_SECONDS for the write lock.
            conn.execute(f"PRAGMA busy_timeout = {int(CHECK_BUSY_TIMEOUT_SECONDS * 1000)}")
            try:
                with _immediate(conn):
                    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('checked_by_pid', ?)", (str(os.getpid()),))
            finally:
                conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
        except (AuditError, sqlite3.Error, OSError) as e:
            return f"audit store {self.path} is not writable: {e}"
        return None

    def close(self) -> None:
        """Close this thread's connection; the store refuses further use from any thread."""
        self._closed = True
        self._drop_connection()

    def __enter__(self) -> AuditStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._closed:
            raise AuditError(f"audit store {self.path} is closed")
        pid = os.getpid()
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == pid:
            return conn
        if conn is not None:
            # Inherited across fork(): never use or close the parent's connection
            # (closing could checkpoint or unlink the parent's WAL); keep it
            # referenced so garbage collection does not close it either.
            _INHERITED.append(conn)
        conn = self._open()
        self._local.conn = conn
        self._local.pid = pid
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            if getattr(self._local, "pid", None) == os.getpid():
                conn.close()
            else:
                _INHERITED.append(conn)
        self._local.conn = None
        self._local.pid = None

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=True)
        except sqlite3.Error as e:
            raise AuditPathError(f"cannot open audit store {self.path}: {e}") from e
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if app_id != APPLICATION_ID or version != SCHEMA_VERSION:
                self._initialise(conn)
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise AuditPathError(f"audit store {self.path} cannot use WAL journal mode (got {mode!r})")
            conn.execute("PRAGMA synchronous = FULL")
        except sqlite3.DatabaseError as e:
            conn.close()
            raise AuditPathError(f"cannot use {self.path} as a ghost-guard audit store: {e}") from e
        except BaseException:
            conn.close()
            raise
        return conn

    def _initialise(self, conn: sqlite3.Connection) -> None:
        with _immediate(conn):
            # Re-read under the write lock: another process may have just done it.
            app_id = conn.execute("PRAGMA application_id").fetchone()[0]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if app_id == APPLICATION_ID and version == SCHEMA_VERSION:
                return
            if app_id == APPLICATION_ID and version > SCHEMA_VERSION:
                raise AuditPathError(f"audit store {self.path} has schema version {version}, newer than this guard's {SCHEMA_VERSION}")
            if app_id != APPLICATION_ID:
                tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
                if app_id != 0 or tables:
                    raise AuditPathError(f"{self.path} is an SQLite database of another program (application_id {app_id}, {tables} schema objects)")
            if app_id == APPLICATION_ID and version == 1:  # 1 -> 2: a verdict can be withdrawn
                conn.execute("ALTER TABLE ghosts ADD COLUMN retracted_at REAL")
            # 2 -> 3: heal attempts (serve --heal) get their own table, created with the schema below

            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @staticmethod
    def _replica_rows(conn: sqlite3.Connection, uids: list[str]) -> dict[str, list[ReplicaState]]:
        out: dict[str, list[ReplicaState]] = {}
        if not uids:
            return out
        # Bound the number of parameters per statement (SQLite's limit is 32766).
        for start in range(0, len(uids), 500):
            chunk = uids[start : start + 500]
            marks = ",".join("?" * len(chunk))  # placeholders only; values are bound
            for uid, replica, serves, rv, error, checked, first_serving, healed_at in conn.execute(
                "SELECT uid, replica, serves, cache_resource_version, error, last_checked, first_seen_serving, healed_at"
                f" FROM replica_observations WHERE uid IN ({marks}) ORDER BY uid, replica",
                chunk,
            ):
                out.setdefault(uid, []).append(
                    ReplicaState(
                        replica=replica,
                        serves=None if serves is None else bool(serves),
                        cache_resource_version=rv,
                        error=error,
                        last_checked=checked,
                        first_seen_serving=first_serving,
                        healed_at=healed_at,
                    )
                )
        return out

    @staticmethod
    def _heal_rows(conn: sqlite3.Connection, uids: list[str]) -> dict[str, list[HealAttempt]]:
        out: dict[str, list[HealAttempt]] = {}
        for start in range(0, len(uids), 500):
            chunk = uids[start : start + 500]
            marks = ",".join("?" * len(chunk))  # placeholders only; values are bound
            for uid, at, action, outcome, detail in conn.execute(
                f"SELECT uid, at, action, outcome, detail FROM heal_attempts WHERE uid IN ({marks}) ORDER BY uid, at, rowid",
                chunk,
            ):
                out.setdefault(uid, []).append(HealAttempt(at, action, outcome, detail))
        return out

    def _maybe_prune(self, at: float) -> None:
        with self._prune_lock:
            self._writes_since_prune += 1
            due = (
                self._last_prune_at is None
                or self._writes_since_prune >= PRUNE_EVERY_WRITES
                or abs(at - self._last_prune_at) >= PRUNE_EVERY_SECONDS
            )
            if not due:
                return
            self._writes_since_prune = 0
            self._last_prune_at = at
        try:
            dropped = self.prune(now=at)
        except AuditError as e:
            # The record itself is committed; a failed prune is retried next time.
            log.warning("audit prune failed: %s", e)
            return
        if dropped:
            log.info("audit prune dropped %d records", dropped)

    def _announce(self, record: AuditRecord) -> None:
        """``on_new``, once the record is committed: a failing hook never fails the write."""
        if self._on_new is None:
            return
        try:
            self._on_new(record)
        except Exception:
            log.exception("new-record hook failed for %s/%s uid %s", record.namespace, record.name, record.uid)


class _immediate:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on error) on an autocommit connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.conn.execute("COMMIT")
        elif self.conn.in_transaction:
            self.conn.execute("ROLLBACK")


def _probe_row(replica: str, serves: object, cache_resource_version: object, error: object, at: object) -> tuple[str, int | None, str | None, str | None, float]:
    check_text("replica", replica, MAX_REPLICA)
    if serves is not None and not isinstance(serves, bool):
        raise ValueError(f"serves must be true, false or null, not {serves!r}")
    if cache_resource_version is not None:
        check_text("cache_resource_version", cache_resource_version, MAX_RESOURCE_VERSION)
    if error is not None:
        if not isinstance(error, str):
            raise ValueError(f"error must be a string or null, not {type(error).__name__}")
        error = error[:MAX_ERROR]
    return (replica, None if serves is None else int(serves), cache_resource_version, error, check_time("at", at))  # type: ignore[return-value]


def _check_path(path: str | os.PathLike[str]) -> str:
    try:
        text = os.fspath(path)
    except TypeError as e:
        raise AuditPathError(f"audit store path must be a path, not {type(path).__name__}") from e
    if not isinstance(text, str) or not text or "\x00" in text:
        raise AuditPathError(f"audit store path must be a non-empty file path, not {path!r}")
    if text == ":memory:" or text.startswith("file:"):
        raise AuditPathError(f"audit store path must be a file on disk, not {text!r}")
    try:
        st = os.stat(text)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(text))
        if not os.path.isdir(parent):
            raise AuditPathError(f"audit store {text}: directory {parent} does not exist") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise AuditPathError(f"audit store {text}: directory {parent} is not writable") from None
        return text
    except OSError as e:
        raise AuditPathError(f"audit store {text}: {e.strerror}") from e
    if stat.S_ISDIR(st.st_mode):
        raise AuditPathError(f"audit store {text} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise AuditPathError(f"audit store {text} is not a regular file")
    return text


def _load_evidence(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {"unreadable": text[:200]}
    return value if isinstance(value, dict) else {"value": value}
