"""guard/audit/sqlite.py on real files with real processes: kill -9, concurrent writers, fork, retention, validation."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.audit.sqlite import (
    SCHEMA_VERSION,
    AuditPathError,
    AuditStore,
)
from guard.core.records import AuditError, AuditRecord, UnknownGhostError

T0 = 1_780_000_000.0
R1, R2, R3 = "https://127.0.0.1:6443", "https://127.0.0.2:6443", "https://127.0.0.3:6443"

# A writer process. Prints "ready", waits for one line on stdin, then writes
# `count` ghosts per thread; after each record_block + record_probe returned
# (acknowledged) it prints the UID (with --ack). Every thread also blocks each
# shared UID once. With "announce", the store's on_new hook prints each new record's UID.
WRITER = textwrap.dedent(
    """
    import sys, threading
    from guard.audit.sqlite import AuditStore
    db, prefix, count, threads, shared, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    T0 = 1_780_000_000.0
    said = threading.Lock()
    def say(line):  # one write per line, under a lock: print() from two threads can splice two lines
        with said:
            sys.stdout.write(line + "\\n")
            sys.stdout.flush()
    def announce(record):
        say("new " + record.uid)
    store = AuditStore(db, on_new=announce if mode == "announce" else None)
    print("ready", flush=True)
    sys.stdin.readline()
    def work(t):
        for i in range(count):
            uid = f"{prefix}-{t}-{i:06d}"
            store.record_block(uid=uid, namespace="ns-" + prefix, name=f"pod-{t}-{i}", verdict="ghost-deleted",
                               evidence={"quorum_get": {"http_status": 404}, "reason": "NotFound", "i": i}, at=T0 + i)
            store.record_probe(uid=uid, replica="https://127.0.0.2:6443", serves=True,
                               cache_resource_version=str(1000 + i), error=None, at=T0 + i)
            if mode == "ack":
                say(uid)
            if i < shared:
                store.record_block(uid=f"shared-{i}", namespace="shared", name=f"shared-{i}", verdict="ghost-deleted",
                                   evidence={"quorum_get": {"http_status": 404}}, at=T0 + i)
    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers: w.start()
    for w in workers: w.join()
    store.close()
    """
)


@pytest.fixture
def spawn() -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", WRITER, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None and p.stdout.readline() == "ready\n", p.stderr.read() if p.stderr else ""
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=30)


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "audit.db")


def integrity(path: str) -> str:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


# -- durability and concurrency -------------------------------------------------------


@pytest.mark.parametrize("kill_after", [1, 37, 400])
def test_every_acknowledged_record_survives_kill_9_mid_burst(db: str, spawn, kill_after: int) -> None:
    AuditStore(db).close()
    writer = spawn(db, "burst", "1000000", "1", "0", "ack")
    writer.stdin.write("go\n")
    writer.stdin.flush()
    acked: list[str] = []
    while len(acked) < kill_after:
        line = writer.stdout.readline()
        assert line.endswith("\n"), writer.stderr.read()
        acked.append(line.strip())
    os.kill(writer.pid, signal.SIGKILL)  # mid-burst: the writer never stops on its own
    # Read the rest through the same buffered stream: communicate() would read the raw pipe and lose the
    # lines readline() already buffered ahead.
    rest = writer.stdout.read()
    writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    acked += [line for line in rest.split("\n")[:-1]]  # complete lines only: each was printed after its commit

    assert integrity(db) == "ok"
    with AuditStore(db) as store:
        records = {r.uid: r for r in store.records()}
        for uid in acked:
            i = int(uid.rsplit("-", 1)[1])
            r = records[uid]
            assert (r.namespace, r.name, r.verdict, dict(r.evidence), r.first_seen, r.last_seen, r.times_blocked) == (
                "ns-burst", f"pod-0-{i}", "ghost-deleted", {"quorum_get": {"http_status": 404}, "reason": "NotFound", "i": i},
                T0 + i, T0 + i, 1,
            )
            assert [(s.replica, s.serves, s.cache_resource_version, s.first_seen_serving) for s in r.replicas] == [
                (R2, True, str(1000 + i), T0 + i)
            ]
        # At most the one write in flight at the kill is stored without its acknowledgement, and it is whole.
        extra = set(records) - set(acked)
        assert len(extra) <= 1
        for uid in extra:
            i = int(uid.rsplit("-", 1)[1])
            assert (records[uid].name, dict(records[uid].evidence)["i"]) == (f"pod-0-{i}", i)
        # The store stays writable after the crash.
        assert store.record_block(uid="after-crash", namespace="ns", name="p", verdict="ghost-deleted", evidence={}, at=T0) is True
        assert store.check() is None


def test_two_processes_with_two_threads_each_lose_no_write(db: str, spawn) -> None:
    AuditStore(db).close()
    per_thread, shared = 150, 40
    writers = [spawn(db, f"w{n}", str(per_thread), "2", str(shared), "announce") for n in range(2)]
    for w in writers:
        w.stdin.write("go\n")
        w.stdin.flush()
    outputs = [w.communicate(timeout=120) for w in writers]
    for w, (_, err) in zip(writers, outputs):
        assert w.returncode == 0, err
        assert "locked" not in err and "Traceback" not in err, err

    with AuditStore(db) as store:
        records = {r.uid: r for r in store.records()}
    own = {f"w{n}-{t}-{i:06d}" for n in range(2) for t in range(2) for i in range(per_thread)}
    shared_uids = {f"shared-{i}" for i in range(shared)}
    assert set(records) == own | shared_uids
    assert {records[u].times_blocked for u in own} == {1}
    assert {records[u].times_blocked for u in shared_uids} == {4}  # 2 processes x 2 threads, none lost
    assert all(len(records[u].replicas) == 1 for u in own)
    # Each new ghost was announced (on_new) exactly once across both processes.
    lines = [line for out, _ in outputs for line in out.splitlines() if line != "ready"]
    assert all(line.startswith("new ") for line in lines), lines[:5]
    assert sorted(line.removeprefix("new ") for line in lines) == sorted(own | shared_uids)
    assert integrity(db) == "ok"


def test_store_opened_before_fork_is_safe_in_the_child(db: str) -> None:
    store = AuditStore(db)
    assert store.record_block(uid="parent-1", namespace="ns", name="a", verdict="ghost-deleted", evidence={}, at=T0)
    pid = os.fork()
    if pid == 0:  # child: uses the store object it inherited, connection included
        code = 1
        try:
            store.record_block(uid="child-1", namespace="ns", name="b", verdict="ghost-deleted", evidence={}, at=T0 + 1)
            store.record_block(uid="parent-1", namespace="ns", name="a", verdict="ghost-deleted", evidence={}, at=T0 + 2)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's connection still works after the child used (and dropped) its inherited copy.
    assert store.record_block(uid="parent-2", namespace="ns", name="c", verdict="ghost-deleted", evidence={}, at=T0 + 3)
    got = {r.uid: r.times_blocked for r in store.records()}
    store.close()
    assert got == {"parent-1": 2, "child-1": 1, "parent-2": 1}
    assert integrity(db) == "ok"


# -- semantics ------------------------------------------------------------------------


def test_block_dedup_keeps_first_and_newest(db: str) -> None:
    with AuditStore(db) as store:
        assert store.record_block(uid="u", namespace="ns", name="p", verdict="ghost-deleted",
                                  evidence={"quorum_get": {"http_status": 404}, "reason": "first"}, at=T0 + 10) is True
        # A later sighting that knows less keeps what the quorum GET said; its own keys win.
        assert store.record_block(uid="u", namespace="ns", name="p", verdict="ghost-deleted",
                                  evidence={"reason": "seen again", "n": 2}, at=T0 + 20) is False
        # A late write carrying an older time changes first_seen; it neither sets the verdict nor wins a key.
        assert store.record_block(uid="u", namespace="ns", name="p", verdict="unknown",
                                  evidence={"reason": "late", "late": True}, at=T0 + 5) is False
        (r,) = store.records()
        assert (r.first_seen, r.last_seen, r.times_blocked, r.verdict, dict(r.evidence)) == (
            T0 + 5, T0 + 20, 3, "ghost-deleted", {"quorum_get": {"http_status": 404}, "reason": "seen again", "n": 2, "late": True})
        # Evidence that would pass 4 KiB once merged: the newer evidence alone is kept.
        store.record_block(uid="u", namespace="ns", name="p", verdict="ghost-deleted", evidence={"big": "x" * 4070}, at=T0 + 30)
        assert dict(store.record("u").evidence) == {"big": "x" * 4070}


def test_probe_history_stale_then_healed_then_stale_again(db: str) -> None:
    with AuditStore(db) as store:
        store.record_block(uid="u", namespace="default", name="web-1", verdict="ghost-deleted", evidence={}, at=T0)
        store.record_probe(uid="u", replica=R2, serves=True, cache_resource_version="100", error=None, at=T0 + 1)
        store.record_probe(uid="u", replica=R1, serves=False, cache_resource_version="101", error=None, at=T0 + 1)
        store.record_probe(uid="u", replica=R2, serves=None, cache_resource_version=None, error="timeout: after 0.5s", at=T0 + 30)

        def r2():
            (rec,) = store.records()
            return next(s for s in rec.replicas if s.replica == R2)

        s = r2()
        assert (s.serves, s.error, s.first_seen_serving, s.healed_at, s.stale) == (None, "timeout: after 0.5s", T0 + 1, None, True)
        store.record_probe(uid="u", replica=R2, serves=True, cache_resource_version="150", error=None, at=T0 + 60)
        assert (r2().first_seen_serving, r2().cache_resource_version) == (T0 + 1, "150")
        # A probe older than the stored one is ignored.
        store.record_probe(uid="u", replica=R2, serves=False, cache_resource_version="90", error=None, at=T0 + 2)
        assert (r2().serves, r2().last_checked, r2().healed_at) == (True, T0 + 60, None)
        # The replica restarted: healed.
        store.record_probe(uid="u", replica=R2, serves=False, cache_resource_version="160", error=None, at=T0 + 90)
        s = r2()
        assert (s.serves, s.first_seen_serving, s.healed_at, s.stale) == (False, T0 + 1, T0 + 90, False)
        store.record_probe(uid="u", replica=R2, serves=False, cache_resource_version="170", error=None, at=T0 + 120)
        assert r2().healed_at == T0 + 90
        # Serving again after a heal restarts the clock.
        store.record_probe(uid="u", replica=R2, serves=True, cache_resource_version="180", error=None, at=T0 + 150)
        s = r2()
        assert (s.first_seen_serving, s.healed_at, s.stale) == (T0 + 150, None, True)
        (rec,) = store.records()
        assert rec.stale_replicas == [R2]
        assert [x.replica for x in rec.replicas] == [R1, R2]


def test_records_filters(db: str) -> None:
    with AuditStore(db) as store:
        store.record_block(uid="a", namespace="default", name="web-1", verdict="ghost-deleted", evidence={}, at=T0)
        store.record_block(uid="b", namespace="prod", name="api-0", verdict="ghost-replaced", evidence={}, at=T0 + 100)
        store.record_block(uid="c", namespace="prod", name="job-1", verdict="ghost-deleted", evidence={}, at=T0 + 200)
        store.record_probe(uid="a", replica=R2, serves=True, cache_resource_version="1", error=None, at=T0)
        store.record_probe(uid="b", replica=R2, serves=False, cache_resource_version="1", error=None, at=T0)
        store.record_probe(uid="c", replica=R3, serves=True, cache_resource_version="1", error=None, at=T0)
        store.record_probe(uid="c", replica=R3, serves=False, cache_resource_version="2", error=None, at=T0 + 5)

        def uids(**kw) -> list[str]:
            return [r.uid for r in store.records(**kw)]

        assert uids() == ["c", "b", "a"]
        assert uids(namespace="prod") == ["c", "b"]
        assert uids(verdict="ghost-deleted") == ["c", "a"]
        assert uids(replica=R2) == ["a"]  # R2 never served b
        assert uids(replica=R3) == ["c"]  # served c once, healed since
        assert uids(replica="https://nowhere:6443") == []
        assert uids(since=T0 + 100) == ["c", "b"]
        assert uids(namespace="prod", verdict="ghost-deleted", since=T0) == ["c"]
        assert uids(limit=2) == ["c", "b"]
        assert uids(namespace="x'; DROP TABLE ghosts; --") == []
        assert uids() == ["c", "b", "a"]


# -- retention ------------------------------------------------------------------------


def test_prune_by_age_and_count(db: str) -> None:
    # All writes fall within 60 s of the first, so record_block's own pruning runs only at the first one.
    with AuditStore(db, max_age_seconds=100, max_records=3) as store:
        for n in range(6):  # ghost n last seen at T0 + 10n
            store.record_block(uid=f"g{n}", namespace="ns", name=f"p{n}", verdict="ghost-deleted", evidence={}, at=T0 + 10 * n)
            store.record_probe(uid=f"g{n}", replica=R2, serves=True, cache_resource_version="1", error=None, at=T0 + 10 * n)
        store.record_block(uid="g0", namespace="ns", name="p0", verdict="ghost-deleted", evidence={}, at=T0 + 55)
        # Age: now = T0 + 130 drops those last seen before T0 + 30 (g1, g2); then count keeps the newest 3 (drops g3).
        assert store.prune(now=T0 + 130) == 3
        assert [r.uid for r in store.records()] == ["g0", "g5", "g4"]
        assert store.prune(now=T0 + 130) == 0
        assert store.prune(now=T0 + 1000) == 3
        assert store.records() == []
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT count(*) FROM replica_observations").fetchone()[0] == 0  # no orphans
    finally:
        conn.close()


def test_record_block_prunes_by_itself_at_a_bounded_rate(db: str) -> None:
    with AuditStore(db, max_records=2) as store:
        for n in range(5):  # all within 60 s of the first write: no prune after the first
            store.record_block(uid=f"g{n}", namespace="ns", name="p", verdict="ghost-deleted", evidence={}, at=T0 + n)
        assert len(store.records()) == 5
        store.record_block(uid="g5", namespace="ns", name="p", verdict="ghost-deleted", evidence={}, at=T0 + 61)
        assert [r.uid for r in store.records()] == ["g5", "g4"]


# -- bad input and bad paths ----------------------------------------------------------------



@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"uid": ""}, "uid must be 1 to 128 characters, got 0", id="empty-uid"),
        pytest.param({"uid": "u" * 129}, "uid must be 1 to 128 characters, got 129", id="long-uid"),
        pytest.param({"uid": 5}, "uid must be a string, not int", id="int-uid"),
        pytest.param({"namespace": "n" * 64}, "namespace must be 1 to 63 characters, got 64", id="long-namespace"),
        pytest.param({"name": "a\nb"}, "name must not contain control characters", id="newline-name"),
        pytest.param({"verdict": "ghost"}, "verdict must be one of alive, ghost-deleted, ghost-replaced, already-bound, terminating, unknown; not 'ghost'", id="bad-verdict"),
        pytest.param({"evidence": ["x"]}, "evidence must be a JSON object, not list", id="list-evidence"),
        pytest.param({"evidence": {"x": object()}}, "evidence must be JSON-serialisable: Object of type object is not JSON serializable", id="opaque-evidence"),
        pytest.param({"evidence": {"x": "y" * 5000}}, "evidence must be at most 4096 bytes of JSON, got 5008", id="huge-evidence"),
        pytest.param({"at": float("nan")}, "at must be a finite, non-negative number of seconds since the epoch, not nan", id="nan-at"),
        pytest.param({"at": -1}, "at must be a finite, non-negative number of seconds since the epoch, not -1", id="negative-at"),
        pytest.param({"at": "now"}, "at must be a finite, non-negative number of seconds since the epoch, not 'now'", id="string-at"),
    ],
)
def test_record_block_rejects_bad_input(db: str, kwargs: dict, message: str) -> None:
    good = {"uid": "u", "namespace": "ns", "name": "p", "verdict": "ghost-deleted", "evidence": {}, "at": T0}
    with AuditStore(db) as store:
        with pytest.raises(ValueError) as e:
            store.record_block(**{**good, **kwargs})
        assert str(e.value) == message
        assert store.records() == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"replica": ""}, "replica must be 1 to 512 characters, got 0", id="empty-replica"),
        pytest.param({"serves": 1}, "serves must be true, false or null, not 1", id="int-serves"),
        pytest.param({"cache_resource_version": "9" * 65}, "cache_resource_version must be 1 to 64 characters, got 65", id="long-rv"),
        pytest.param({"error": 42}, "error must be a string or null, not int", id="int-error"),
    ],
)
def test_record_probe_rejects_bad_input(db: str, kwargs: dict, message: str) -> None:
    good = {"uid": "u", "replica": R1, "serves": True, "cache_resource_version": "1", "error": None, "at": T0}
    with AuditStore(db) as store:
        store.record_block(uid="u", namespace="ns", name="p", verdict="ghost-deleted", evidence={}, at=T0)
        with pytest.raises(ValueError) as e:
            store.record_probe(**{**good, **kwargs})
        assert str(e.value) == message
        with pytest.raises(UnknownGhostError) as e:  # an AuditError and a LookupError
            store.record_probe(**{**good, "uid": "never-blocked"})
        assert str(e.value) == "no audit record for uid 'never-blocked': record_block first"
        store.record_probe(**{**good, "error": "x" * 2000, "serves": None})
        assert store.records()[0].replicas[0].error == "x" * 512


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"verdict": "dead"}, "verdict must be one of alive, ghost-deleted, ghost-replaced, already-bound, terminating, unknown; not 'dead'", id="verdict"),
        pytest.param({"since": -5.0}, "since must be a finite, non-negative number of seconds since the epoch, not -5.0", id="since"),
        pytest.param({"limit": -1}, "limit must be a non-negative integer, not -1", id="limit"),
        pytest.param({"namespace": ""}, "namespace must be 1 to 63 characters, got 0", id="namespace"),
    ],
)
def test_records_rejects_bad_filters(db: str, kwargs: dict, message: str) -> None:
    with AuditStore(db) as store:
        with pytest.raises(ValueError) as e:
            store.records(**kwargs)
        assert str(e.value) == message


def test_bad_paths_are_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    cases = {
        str(tmp_path): f"audit store {tmp_path} is a directory, not a file",
        str(tmp_path / "missing" / "audit.db"): f"audit store {tmp_path / 'missing' / 'audit.db'}: directory {tmp_path / 'missing'} does not exist",
        str(text): f"cannot use {text} as a ghost-guard audit store: file is not a database",
        str(other): f"{other} is an SQLite database of another program (application_id 0, 1 schema objects)",
        ":memory:": "audit store path must be a file on disk, not ':memory:'",
        "": "audit store path must be a non-empty file path, not ''",
    }
    for path, message in cases.items():
        with pytest.raises(AuditPathError) as e:
            AuditStore(path)
        assert str(e.value) == message, path
    assert text.read_text() == "not a database\n"  # untouched


def test_newer_schema_is_refused(db: str) -> None:
    AuditStore(db).close()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(AuditPathError) as e:
        AuditStore(db)
    assert str(e.value) == f"audit store {db} has schema version 99, newer than this guard's {SCHEMA_VERSION}"


def test_constructor_rejects_bad_limits(db: str) -> None:
    for kwargs, message in [
        ({"max_age_seconds": 0}, "max_age_seconds must be a positive number, not 0"),
        ({"max_records": 0}, "max_records must be a positive integer, not 0"),
        ({"max_records": True}, "max_records must be a positive integer, not True"),
    ]:
        with pytest.raises(ValueError) as e:
            AuditStore(db, **kwargs)
        assert str(e.value) == message


def test_check_and_close(db: str) -> None:
    store = AuditStore(db)
    assert store.check() is None
    store.close()
    assert store.check() == "audit store is closed"
    with pytest.raises(AuditError) as e:
        store.records()
    assert str(e.value) == f"audit store {db} is closed"


LOCK_HOLDER = textwrap.dedent(
    """
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1], isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    print("locked", flush=True)
    sys.stdin.readline()
    conn.execute("ROLLBACK")
    """
)


def test_check_reports_a_store_another_process_keeps_locked(db: str) -> None:
    store = AuditStore(db)
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, db], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n", holder.stderr.read()
        assert store.check() == f"audit store {db} is not writable: database is locked"
    finally:
        holder.communicate("release\n", timeout=30)
    assert holder.returncode == 0
    assert store.check() is None
    # The short wait applies to the check only: writes keep the full busy timeout.
    assert store._connection().execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    store.close()


def test_wal_and_full_sync_are_on(db: str) -> None:
    store = AuditStore(db)
    store.record_block(uid="u", namespace="ns", name="p", verdict="ghost-deleted", evidence={}, at=T0)
    conn = store._connection()  # the store's own connection: the settings every write runs under
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    store.close()


def test_on_new_is_called_once_per_new_record_after_its_commit(db: str) -> None:
    seen: list[tuple[AuditRecord, list[str]]] = []

    def on_new(record: AuditRecord) -> None:  # what is committed when the hook runs
        with AuditStore(db) as reader:
            seen.append((record, [r.uid for r in reader.records()]))

    with AuditStore(db, on_new=on_new) as store:
        assert store.record_block(uid="u1", namespace="default", name="web-1", verdict="ghost-deleted",
                                  evidence={"reason": "gone"}, at=T0) is True
        assert store.record_block(uid="u1", namespace="default", name="web-1", verdict="ghost-deleted",
                                  evidence={"reason": "gone"}, at=T0 + 1) is False
        assert store.record_block(uid="u2", namespace="default", name="web-2", verdict="ghost-replaced",
                                  evidence={}, at=T0 + 2) is True
    assert seen == [
        (AuditRecord(uid="u1", namespace="default", name="web-1", verdict="ghost-deleted", evidence={"reason": "gone"},
                     first_seen=T0, last_seen=T0, times_blocked=1), ["u1"]),
        (AuditRecord(uid="u2", namespace="default", name="web-2", verdict="ghost-replaced", evidence={},
                     first_seen=T0 + 2, last_seen=T0 + 2, times_blocked=1), ["u2", "u1"]),
    ]


def test_a_failing_on_new_hook_never_fails_the_write(db: str) -> None:
    def broken(record: AuditRecord) -> None:
        raise OSError("stdout is closed")

    with AuditStore(db, on_new=broken) as store:
        assert store.record_block(uid="u1", namespace="default", name="web-1", verdict="ghost-deleted", evidence={},
                                  at=T0) is True
        assert [r.uid for r in store.records()] == ["u1"]


def test_probe_sequences_match_the_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Any sequence of probes (in or out of order, failed or not) leaves what a plain model says."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    store = AuditStore(str(tmp_path_factory.mktemp("model") / "audit.db"))
    counter = iter(range(10**9))
    probes = st.lists(
        st.tuples(st.sampled_from([R1, R2]), st.sampled_from([True, False, None]), st.integers(0, 20)),
        min_size=1, max_size=12,
    )

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(probes)
    def check(sequence: list[tuple[str, bool | None, int]]) -> None:
        uid = f"model-{next(counter)}"
        store.record_block(uid=uid, namespace="ns", name="p", verdict="ghost-deleted", evidence={}, at=T0)
        model: dict[str, dict] = {}
        for replica, serves, t in sequence:
            at = T0 + t
            store.record_probe(uid=uid, replica=replica, serves=serves, cache_resource_version=str(t),
                               error=None if serves is not None else "timeout", at=at)
            m = model.get(replica)
            if m is not None and at < m["last_checked"]:
                continue
            m = model.setdefault(replica, {"first_seen_serving": None, "healed_at": None})
            m.update(serves=serves, last_checked=at)
            if serves is True:
                if m["first_seen_serving"] is None or m["healed_at"] is not None:
                    m["first_seen_serving"] = at
                m["healed_at"] = None
            elif serves is False and m["first_seen_serving"] is not None and m["healed_at"] is None:
                m["healed_at"] = at
        record = store.record(uid)
        assert record is not None
        got = {s.replica: {"serves": s.serves, "last_checked": s.last_checked,
                           "first_seen_serving": s.first_seen_serving, "healed_at": s.healed_at}
               for s in record.replicas}
        assert got == model

    try:
        check()
    finally:
        store.close()
