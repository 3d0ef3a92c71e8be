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

Three tables: ``ghosts`` (one row per ghost identity, the key of
:data:`guard.core.records.Identity`: a Pod's (namespace, name, UID), ``kind = 'pod'``; a
ghost Node's name and UID, ``kind = 'node'`` with an empty namespace), ``replica_observations``
(one row per ghost and apiserver replica: the newest probe of that replica's
watch cache, plus when it started serving the ghost and when it healed) and
``heal_attempts`` (``serve --heal``, ``heal node/NAME --audit-store``), both joined to ``ghosts.id``. What a record holds, its field limits and
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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from guard.core.records import (
    HEAL_ACTIONS, HEAL_OUTCOMES, MAX_ERROR, MAX_HEAL_DETAIL, MAX_HEALS_PER_GHOST, MAX_NAMESPACE, MAX_REPLICA,
    MAX_RESOURCE_VERSION, MAX_UID, NODE_VERDICT, VERDICTS, AuditError, AuditRecord, HealAttempt, NewRecordHook,
    NodeRecord, ReplicaState, UnknownGhostError, check_text, check_time, evidence_json, identity, node_identity,
)

log = logging.getLogger("guard.audit")

APPLICATION_ID: Final = 0x47474144  # "GGAD": marks the file as a ghost-guard audit store
SCHEMA_VERSION: Final = 4  # 2: ghosts.retracted_at; 3: heal_attempts; 4: keyed by identity, ghost Nodes
BUSY_TIMEOUT_SECONDS: Final = 5.0
CHECK_BUSY_TIMEOUT_SECONDS: Final = 1.0
PRUNE_EVERY_WRITES: Final = 1000
PRUNE_EVERY_SECONDS: Final = 60.0

_INHERITED: list[sqlite3.Connection] = []
"""Connections opened before a fork(), kept alive (unused) in the child so they are never closed there."""

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS ghosts (
    id            INTEGER PRIMARY KEY,
    kind          TEXT NOT NULL DEFAULT 'pod',
    uid           TEXT NOT NULL,
    namespace     TEXT NOT NULL,
    name          TEXT NOT NULL,
    verdict       TEXT NOT NULL,
    evidence      TEXT NOT NULL,
    first_seen    REAL NOT NULL,
    last_seen     REAL NOT NULL,
    times_blocked INTEGER NOT NULL,
    retracted_at  REAL,
    UNIQUE (kind, namespace, name, uid)
);
CREATE INDEX IF NOT EXISTS ghosts_uid ON ghosts (uid);
CREATE INDEX IF NOT EXISTS ghosts_last_seen ON ghosts (last_seen);
CREATE INDEX IF NOT EXISTS ghosts_namespace ON ghosts (namespace, last_seen);
CREATE TABLE IF NOT EXISTS replica_observations (
    ghost                  INTEGER NOT NULL,
    replica                TEXT NOT NULL,
    serves                 INTEGER,
    cache_resource_version TEXT,
    error                  TEXT,
    last_checked           REAL NOT NULL,
    first_seen_serving     REAL,
    healed_at              REAL,
    PRIMARY KEY (ghost, replica)
);
CREATE INDEX IF NOT EXISTS replica_observations_replica ON replica_observations (replica);
CREATE TABLE IF NOT EXISTS heal_attempts (
    ghost   INTEGER NOT NULL,
    at      REAL NOT NULL,
    action  TEXT NOT NULL,
    outcome TEXT NOT NULL,
    detail  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS heal_attempts_ghost ON heal_attempts (ghost, at);
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

    ``on_new`` (a :data:`guard.core.records.NewRecordHook`): called with each ghost Pod record
    new to the file, after the commit that inserted it, once per identity across every
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
        """Record that ghost ``(namespace, name, uid)`` was blocked at ``at``. True if the identity is new to
        the store (a UID recorded under another name is another record: a forged call's record never hides
        the real pod's).

        Returns only after the commit is durable: that is the acknowledgement.
        A known identity gets ``times_blocked + 1``, ``last_seen`` = the newest
        ``at``, ``first_seen`` = the oldest, and the newest verdict. Evidence
        accumulates: the stored object is updated with the new one's keys
        (the newer write wins a key), so a later sighting that knows less
        keeps what the quorum GET said (if the merge would pass 4 KiB, the
        newer evidence alone is kept).
        """
        key = identity(namespace, name, uid)
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; not {verdict!r}")
        evidence_text = str(evidence_json(evidence))
        at = check_time("at", at)
        conn = self._connection()
        try:
            with _immediate(conn):
                row = self._upsert(conn, "pod", key, verdict, evidence, evidence_text, at, count=1)
        except sqlite3.Error as e:
            raise AuditError(f"cannot record block of {namespace}/{name} in {self.path}: {e}") from e
        new = row is None
        if new:
            self._announce(AuditRecord(uid=uid, namespace=namespace, name=name, verdict=verdict,
                                       evidence=dict(evidence), first_seen=at, last_seen=at, times_blocked=1))
        self._maybe_prune(at)
        return new

    def _upsert(self, conn: sqlite3.Connection, kind: str, key: tuple[str, str, str], verdict: str,
                evidence: Mapping[str, Any], evidence_text: str, at: float, *, count: int) -> tuple | None:
        """Insert the identity's row, or count ``count`` more sightings and merge the evidence; the row as it
        was (None: inserted). Within the caller's write transaction."""
        namespace, name, uid = key
        row = conn.execute("SELECT id, evidence, last_seen FROM ghosts WHERE kind = ? AND namespace = ? AND name = ?"
                           " AND uid = ?", (kind, namespace, name, uid)).fetchone()
        if row is None:
            conn.execute(
                "INSERT INTO ghosts (kind, uid, namespace, name, verdict, evidence, first_seen, last_seen, times_blocked)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (kind, uid, namespace, name, verdict, evidence_text, at, at, count),
            )
            return None
        stored, last_seen = _load_evidence(row[1]), row[2]
        newest = at >= last_seen
        merged = {**stored, **evidence} if newest else {**evidence, **stored}
        merged_json = evidence_json(merged, strict=False) or (evidence_text if newest else row[1])
        conn.execute(
            "UPDATE ghosts SET retracted_at = NULL,"
            " verdict = CASE WHEN ? THEN ? ELSE verdict END, evidence = ?,"
            " first_seen = min(first_seen, ?), last_seen = max(last_seen, ?),"
            " times_blocked = times_blocked + ?"
            " WHERE id = ?",
            (newest, verdict, merged_json, at, at, count, row[0]),
        )
        return tuple(row)

    @staticmethod
    def _ids(conn: sqlite3.Connection, uid: str, namespace: str | None, name: str | None) -> list[int]:
        """The ghost Pod rows of ``uid``: the one of that identity with ``namespace`` and ``name``, else every one."""
        if namespace is not None and name is not None:
            return [r[0] for r in conn.execute("SELECT id FROM ghosts WHERE kind = 'pod' AND uid = ? AND namespace = ?"
                                               " AND name = ?", (uid, namespace, name))]
        return [r[0] for r in conn.execute("SELECT id FROM ghosts WHERE kind = 'pod' AND uid = ?", (uid,))]

    def retract(self, *, uid: str, at: float, namespace: str | None = None, name: str | None = None) -> bool:
        """Mark the record of ghost ``(namespace, name, uid)`` retracted at ``at`` (etcd showed the pod pending
        after all) and forget its replica probes, so that no report names a replica for it. True if there was
        a record. A later block of the same identity (a new, proven verdict) clears the mark. Without
        ``namespace`` and ``name``, every record of that UID is touched."""
        check_text("uid", uid, MAX_UID)
        at = check_time("at", at)
        conn = self._connection()
        try:
            with _immediate(conn):
                ids = self._ids(conn, uid, namespace, name)
                for ghost in ids:
                    conn.execute("UPDATE ghosts SET retracted_at = ? WHERE id = ?", (at, ghost))
                    conn.execute("DELETE FROM replica_observations WHERE ghost = ?", (ghost,))
                found = len(ids)
        except sqlite3.Error as e:
            raise AuditError(f"cannot retract the record of {uid} in {self.path}: {e}") from e
        return bool(found)

    def record_probe(self, *, uid: str, replica: str, serves: bool | None, cache_resource_version: str | None, error: str | None, at: float,
                     namespace: str | None = None, name: str | None = None) -> None:
        """Record one probe of ``replica``'s watch cache for ghost ``uid``.

        Keeps the newest probe per (ghost, replica): a probe older than the one
        stored is ignored. ``first_seen_serving`` is set when the replica is
        first seen serving the ghost (again, after a heal); ``healed_at`` when a
        probe that answered finds it no longer serving it. A failed probe
        (``serves=None``) changes neither. ``error`` is clipped to 512
        characters. Raises :class:`UnknownGhostError` (an :class:`AuditError`
        and a :class:`LookupError`) if ``uid`` has no record. With ``namespace``
        and ``name``, only the record of that identity (none: left alone, no error); without, every record of
        the UID.
        """
        check_text("uid", uid, MAX_UID)
        probe = _probe_row(replica, serves, cache_resource_version, error, at)
        conn = self._connection()
        try:
            with _immediate(conn):
                if conn.execute("SELECT 1 FROM ghosts WHERE kind = 'pod' AND uid = ?", (uid,)).fetchone() is None:
                    raise UnknownGhostError(f"no audit record for uid {uid!r}: record_block first")
                for ghost in self._ids(conn, uid, namespace, name):
                    self._probe(conn, ghost, probe)
        except sqlite3.Error as e:
            raise AuditError(f"cannot record a probe of ghost {uid} in {self.path}: {e}") from e

    @staticmethod
    def _probe(conn: sqlite3.Connection, ghost: int, probe: tuple) -> None:
        """One probe of one replica on ghost row ``ghost`` (a retracted record takes none: a probe finishing
        late names no replica). Within the caller's write transaction."""
        if conn.execute("SELECT retracted_at FROM ghosts WHERE id = ?", (ghost,)).fetchone()[0] is not None:
            return
        conn.execute(
            "INSERT INTO replica_observations"
            " (ghost, replica, serves, cache_resource_version, error, last_checked, first_seen_serving, healed_at)"
            " VALUES (?1, ?2, ?3, ?4, ?5, ?6, CASE WHEN ?3 = 1 THEN ?6 END, NULL)"
            " ON CONFLICT (ghost, replica) DO UPDATE SET"
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
            (ghost, *probe),
        )

    def record_heal(self, *, uid: str, action: str, outcome: str, detail: str, at: float,
                    namespace: str | None = None, name: str | None = None) -> None:
        """Record one heal attempt of ghost ``uid`` (the newest MAX_HEALS_PER_GHOST are kept): on the record of
        that identity with ``namespace`` and ``name``, else on every record of the UID.

        Raises :class:`UnknownGhostError` if ``uid`` has no record, ValueError for an unknown
        ``action``/``outcome``; ``detail`` is clipped to 1024 characters."""
        check_text("uid", uid, MAX_UID)
        self._record_heal(lambda conn: self._ids(conn, uid, namespace, name), _heal_row(action, outcome, detail, at),
                          f"no audit record for uid {uid!r}: record_block first", f"ghost {uid}")

    def _record_heal(self, find: Callable[[sqlite3.Connection], list[int]], heal: tuple[float, str, str, str],
                     missing: str, what: str) -> None:
        """One heal attempt on every ghost row ``find`` names (UnknownGhostError ``missing`` when none)."""
        conn = self._connection()
        try:
            with _immediate(conn):
                ids = find(conn)
                if not ids:
                    raise UnknownGhostError(missing)
                for ghost in ids:
                    self._heal(conn, ghost, heal)
        except sqlite3.Error as e:
            raise AuditError(f"cannot record a heal of {what} in {self.path}: {e}") from e

    @staticmethod
    def _heal(conn: sqlite3.Connection, ghost: int, heal: tuple[float, str, str, str]) -> None:
        conn.execute("INSERT INTO heal_attempts (ghost, at, action, outcome, detail) VALUES (?, ?, ?, ?, ?)",
                     (ghost, *heal))
        conn.execute("DELETE FROM heal_attempts WHERE ghost = ?1 AND rowid NOT IN (SELECT rowid FROM heal_attempts"
                     " WHERE ghost = ?1 ORDER BY at DESC, rowid DESC LIMIT ?2)", (ghost, MAX_HEALS_PER_GHOST))

    # -- ghost Nodes ---------------------------------------------------------

    def record_node(self, *, name: str, uid: str, serving: Sequence[str], at: float, healed: Sequence[str] = (),
                    evidence: Mapping[str, Any] | None = None) -> bool:
        """Record ghost Node ``(name, uid)`` (a quorum read said etcd lacks it) as served by the replicas
        ``serving`` at ``at``, and no longer served by ``healed``. True if the identity is new to the store.
        Each call with replicas serving it counts one detection; the replicas are kept as probes are
        (``first_seen_serving``, ``healed_at``)."""
        key = node_identity(name, uid)
        at = check_time("at", at)
        evidence = dict(evidence or {})
        evidence_text = str(evidence_json(evidence))
        probes = [_probe_row(r, True, None, None, at) for r in serving] + [
            _probe_row(r, False, None, None, at) for r in healed]
        conn = self._connection()
        try:
            with _immediate(conn):
                row = self._upsert(conn, "node", key, NODE_VERDICT, evidence, evidence_text, at, count=1 if serving else 0)
                ghost = self._node_id(conn, name, uid)
                for probe in probes:
                    self._probe(conn, ghost, probe)
        except sqlite3.Error as e:
            raise AuditError(f"cannot record ghost Node {name} in {self.path}: {e}") from e
        self._maybe_prune(at)
        return row is None

    def record_node_heal(self, *, name: str, uid: str, action: str, outcome: str, detail: str, at: float) -> None:
        """Record one heal attempt of ghost Node ``(name, uid)``; with ``uid`` "", on every record of the name.
        Raises :class:`UnknownGhostError` if there is none."""
        node_identity(name, uid)
        self._record_heal(lambda conn: [r[0] for r in conn.execute(
            "SELECT id FROM ghosts WHERE kind = 'node' AND name = ? AND (uid = ? OR ? = '')", (name, uid, uid))],
            _heal_row(action, outcome, detail, at), f"no audit record for ghost Node {name!r}", f"ghost Node {name}")

    @staticmethod
    def _node_id(conn: sqlite3.Connection, name: str, uid: str) -> int:
        return int(conn.execute("SELECT id FROM ghosts WHERE kind = 'node' AND namespace = '' AND name = ? AND uid = ?",
                                (name, uid)).fetchone()[0])

    def node_records(self, *, since: float | None = None, limit: int | None = None) -> list[NodeRecord]:
        """Ghost Node records, most recently seen first (``since``: last seen at or after it; ``limit``)."""
        clauses, params = ["kind = 'node'"], []
        if since is not None:
            clauses.append("last_seen >= ?")
            params.append(check_time("since", since))
        _check_limit(limit)
        return [NodeRecord(name=r.name, uid=r.uid, first_seen=r.first_seen, last_seen=r.last_seen,
                           times_detected=r.times_blocked, evidence=r.evidence, replicas=r.replicas, heals=r.heals)
                for r in self._select(" AND ".join(clauses), params, limit=limit)]

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
                    "DELETE FROM ghosts WHERE id IN (SELECT id FROM ghosts ORDER BY EXISTS (SELECT 1 FROM"
                    " replica_observations r WHERE r.ghost = ghosts.id AND r.first_seen_serving IS NOT NULL) DESC,"
                    " last_seen DESC, uid, id LIMIT -1 OFFSET ?)",
                    (self.max_records,),
                ).rowcount
                if by_age or by_count:
                    conn.execute("DELETE FROM replica_observations WHERE ghost NOT IN (SELECT id FROM ghosts)")
                    conn.execute("DELETE FROM heal_attempts WHERE ghost NOT IN (SELECT id FROM ghosts)")
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
        clauses: list[str] = ["kind = 'pod'"] + ([] if retracted else ["retracted_at IS NULL"])
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
            clauses.append("id IN (SELECT ghost FROM replica_observations WHERE replica = ? AND first_seen_serving IS NOT NULL)")
            params.append(replica)
        if since is not None:
            clauses.append("last_seen >= ?")
            params.append(check_time("since", since))
        _check_limit(limit)
        return self._select(" AND ".join(clauses), params, limit=limit)

    def _select(self, where: str, params: list[Any], *, limit: int | None) -> list[AuditRecord]:
        # ``where`` is built from fixed clause texts only; every value is bound.
        sql = ("SELECT id, uid, namespace, name, verdict, evidence, first_seen, last_seen, times_blocked, retracted_at"
               " FROM ghosts")
        if where:
            sql += " WHERE " + where
        sql += " ORDER BY last_seen DESC, uid, id"
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
                replicas=tuple(replicas.get(ghost, ())),
                retracted_at=ra,
                heals=tuple(heals.get(ghost, ())),
            )
            for ghost, uid, ns, nm, vd, ev, fs, ls, tb, ra in rows
        ]

    def record(self, uid: str) -> AuditRecord | None:
        """The most recently seen record of a ghost Pod with this UID (any name), or None."""
        check_text("uid", uid, MAX_UID)
        found = self._select("kind = 'pod' AND uid = ?", [uid], limit=1)
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
            if app_id == APPLICATION_ID and version < 4:  # 2 -> 3: heal attempts; 3 -> 4: keyed by identity
                _migrate_to_identity(conn)

            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    @staticmethod
    def _replica_rows(conn: sqlite3.Connection, uids: list[int]) -> dict[int, list[ReplicaState]]:
        out: dict[int, list[ReplicaState]] = {}
        if not uids:
            return out
        # Bound the number of parameters per statement (SQLite's limit is 32766).
        for start in range(0, len(uids), 500):
            chunk = uids[start : start + 500]
            marks = ",".join("?" * len(chunk))  # placeholders only; values are bound
            for uid, replica, serves, rv, error, checked, first_serving, healed_at in conn.execute(
                "SELECT ghost, replica, serves, cache_resource_version, error, last_checked, first_seen_serving, healed_at"
                f" FROM replica_observations WHERE ghost IN ({marks}) ORDER BY ghost, replica",
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
    def _heal_rows(conn: sqlite3.Connection, uids: list[int]) -> dict[int, list[HealAttempt]]:
        out: dict[int, list[HealAttempt]] = {}
        for start in range(0, len(uids), 500):
            chunk = uids[start : start + 500]
            marks = ",".join("?" * len(chunk))  # placeholders only; values are bound
            for uid, at, action, outcome, detail in conn.execute(
                f"SELECT ghost, at, action, outcome, detail FROM heal_attempts WHERE ghost IN ({marks})"
                " ORDER BY ghost, at, rowid",
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


def _migrate_to_identity(conn: sqlite3.Connection) -> None:
    """Schema 2 or 3 -> 4, in the caller's write transaction: ``ghosts`` keyed by UID becomes keyed by identity
    (an ``id``, ``kind``, unique (kind, namespace, name, uid)); its replica rows and heal attempts follow their
    ghost's new ``id``. Every record is kept as it was (each UID had one identity)."""
    conn.execute("ALTER TABLE ghosts RENAME TO ghosts_v3")
    conn.execute("DROP INDEX IF EXISTS ghosts_last_seen")
    conn.execute("DROP INDEX IF EXISTS ghosts_namespace")
    conn.execute("ALTER TABLE replica_observations RENAME TO replica_observations_v3")
    conn.execute("DROP INDEX IF EXISTS replica_observations_replica")
    has_heals = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'heal_attempts'").fetchone()
    if has_heals:
        conn.execute("ALTER TABLE heal_attempts RENAME TO heal_attempts_v3")
        conn.execute("DROP INDEX IF EXISTS heal_attempts_uid")
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            conn.execute(statement)
    conn.execute("INSERT INTO ghosts (kind, uid, namespace, name, verdict, evidence, first_seen, last_seen, times_blocked,"
                 " retracted_at) SELECT 'pod', uid, namespace, name, verdict, evidence, first_seen, last_seen,"
                 " times_blocked, retracted_at FROM ghosts_v3")
    conn.execute("INSERT INTO replica_observations (ghost, replica, serves, cache_resource_version, error, last_checked,"
                 " first_seen_serving, healed_at) SELECT g.id, r.replica, r.serves, r.cache_resource_version, r.error,"
                 " r.last_checked, r.first_seen_serving, r.healed_at FROM replica_observations_v3 r"
                 " JOIN ghosts g ON g.kind = 'pod' AND g.uid = r.uid")
    if has_heals:
        conn.execute("INSERT INTO heal_attempts (ghost, at, action, outcome, detail) SELECT g.id, h.at, h.action,"
                     " h.outcome, h.detail FROM heal_attempts_v3 h JOIN ghosts g ON g.kind = 'pod' AND g.uid = h.uid"
                     " ORDER BY h.rowid")
        conn.execute("DROP TABLE heal_attempts_v3")
    conn.execute("DROP TABLE replica_observations_v3")
    conn.execute("DROP TABLE ghosts_v3")


def _check_limit(limit: object) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer, not {limit!r}")


def _heal_row(action: object, outcome: object, detail: object, at: object) -> tuple[float, str, str, str]:
    if action not in HEAL_ACTIONS:
        raise ValueError(f"action must be one of {', '.join(HEAL_ACTIONS)}; not {action!r}")
    if outcome not in HEAL_OUTCOMES:
        raise ValueError(f"outcome must be one of {', '.join(HEAL_OUTCOMES)}; not {outcome!r}")
    if not isinstance(detail, str):
        raise ValueError("detail must be a string")
    return (check_time("at", at), str(action), str(outcome), detail[:MAX_HEAL_DETAIL])


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
