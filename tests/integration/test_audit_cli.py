"""`ghost-guard audit` and `ghost-guard report` (as `python -m guard`) run as real subprocesses on a populated store."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from guard.audit.sqlite import AuditStore
from guard.core.settings import DEFAULT_AUDIT_DB

R1, R2, R3 = "https://127.0.0.1:6443", "https://127.0.0.2:6443", "https://127.0.0.3:6443"
GHOST_GUARD = [sys.executable, "-m", "guard"]  # `python -m guard` is `ghost-guard`, wherever pip put the script

NOW = time.time()
HOUR_AGO = NOW - 3600 - 60  # outside --since 1h
MINUTE_AGO = NOW - 60


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("GHOST_GUARD_")}
    environment.update(env or {})
    return subprocess.run([*GHOST_GUARD, *args], capture_output=True, text=True, timeout=60, env=environment)


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The lab incident after the fact: R2 missed web-1's delete; api-0 was served by R3, which has since restarted."""
    db = str(tmp_path_factory.mktemp("audit") / "audit.db")
    with AuditStore(db) as store:
        store.record_block(uid="uid-web-1", namespace="default", name="web-1", verdict="ghost-deleted",
                           evidence={"quorum_get": {"http_status": 404}, "reason": "NotFound"}, at=MINUTE_AGO)
        store.record_block(uid="uid-web-1", namespace="default", name="web-1", verdict="ghost-deleted",
                           evidence={"quorum_get": {"http_status": 404}, "reason": "NotFound"}, at=MINUTE_AGO + 10)
        store.record_probe(uid="uid-web-1", replica=R1, serves=False, cache_resource_version="120", error=None, at=MINUTE_AGO)
        store.record_probe(uid="uid-web-1", replica=R2, serves=True, cache_resource_version="100", error=None, at=MINUTE_AGO)
        store.record_probe(uid="uid-web-1", replica=R3, serves=False, cache_resource_version="120", error=None, at=MINUTE_AGO)
        store.record_block(uid="uid-api-0", namespace="prod", name="api-0", verdict="ghost-replaced",
                           evidence={"quorum_get": {"http_status": 200, "uid": "uid-api-0-new"}}, at=HOUR_AGO)
        store.record_probe(uid="uid-api-0", replica=R3, serves=True, cache_resource_version="80", error=None, at=HOUR_AGO)
        store.record_probe(uid="uid-api-0", replica=R3, serves=False, cache_resource_version="95", error=None, at=HOUR_AGO + 30)
    return db


def uids(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [r["uid"] for r in json.loads(result.stdout)]


def test_cli_default_db_is_the_store_default() -> None:
    result = run("audit", "--help")
    assert result.returncode == 0
    assert DEFAULT_AUDIT_DB in result.stdout
    assert "GHOST_GUARD_AUDIT_DB" in result.stdout


def test_audit_json(populated: str) -> None:
    result = run("audit", "--db", populated, "--output", "json")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert [r["uid"] for r in records] == ["uid-web-1", "uid-api-0"]
    web = records[0]
    assert set(web) == {"namespace", "name", "uid", "verdict", "evidence", "first_seen", "last_seen", "times_blocked", "retracted_at",
                        "stale_replicas", "replicas", "heals"}
    assert (web["namespace"], web["name"], web["verdict"], web["times_blocked"], web["stale_replicas"]) == (
        "default", "web-1", "ghost-deleted", 2, [R2])
    assert web["evidence"] == {"quorum_get": {"http_status": 404}, "reason": "NotFound"}
    assert [(r["replica"], r["state"], r["cache_resource_version"]) for r in web["replicas"]] == [
        (R1, "consistent", "120"), (R2, "stale", "100"), (R3, "consistent", "120")]
    api = records[1]
    assert api["stale_replicas"] == []
    assert api["replicas"][0]["healed_at"] is not None


def test_audit_jsonl_and_table(populated: str) -> None:
    jsonl = run("audit", "--db", populated, "-o", "jsonl")
    assert jsonl.returncode == 0, jsonl.stderr
    assert [json.loads(line)["name"] for line in jsonl.stdout.splitlines()] == ["web-1", "api-0"]
    table = run("audit", "--db", populated)
    assert table.returncode == 0, table.stderr
    header, web, api = table.stdout.splitlines()
    assert header.split("  ")[0] == "LAST SEEN"
    assert header.index("NAMESPACE") == web.index("default") == api.index("prod")
    assert web.split()[1:5] == ["default", "web-1", "ghost-deleted", "2"]
    assert R2 in web and R2 not in api


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(["--namespace", "prod"], ["uid-api-0"], id="namespace"),
        pytest.param(["--verdict", "ghost-deleted"], ["uid-web-1"], id="verdict"),
        pytest.param(["--replica", R2], ["uid-web-1"], id="replica-stale"),
        pytest.param(["--replica", R3], ["uid-api-0"], id="replica-healed-still-listed"),
        pytest.param(["--replica", R1], [], id="replica-never-served"),
        pytest.param(["--replica", "127.0.0.2"], ["uid-web-1"], id="replica-host-without-port"),
        pytest.param(["--replica", "127.0.0.9"], [], id="replica-host-never-served"),
        pytest.param(["--since", "1h"], ["uid-web-1"], id="since-duration"),
        pytest.param(["--since", "2d"], ["uid-web-1", "uid-api-0"], id="since-days"),
        pytest.param(["--since", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW - 1800))], ["uid-web-1"], id="since-iso"),
        pytest.param(["--limit", "1"], ["uid-web-1"], id="limit"),
        pytest.param(["--namespace", "kube-system"], [], id="no-match"),
    ],
)
def test_audit_filters(populated: str, args: list[str], expected: list[str]) -> None:
    assert uids(run("audit", "--db", populated, "-o", "json", *args)) == expected


def test_audit_replica_without_match_says_why(populated: str) -> None:
    r = run("audit", "--db", populated, "--replica", "127.0.0.9")
    assert r.returncode == 0 and "no ghost was ever seen served by replica 127.0.0.9" in r.stderr, r.stderr


def test_audit_db_from_environment(populated: str) -> None:
    assert uids(run("audit", "-o", "json", env={"GHOST_GUARD_AUDIT_DB": populated})) == ["uid-web-1", "uid-api-0"]


def test_report_names_the_stale_replica_and_the_runbook(populated: str) -> None:
    result = run("report", "--db", populated)
    assert result.returncode == 1, result.stderr  # it lists a replica serving a ghost: exit 1, as diagnose
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"Replica {R2} serves 1 ghost pod since ")
    assert lines[2].split()[:2] == ["default/web-1", "uid-web-1"]
    assert lines[-4:] == [
        "Remediation, in order:",
        "  1. Heal without restarting anything: ghost-guard heal default/web-1 (a placeholder created and deleted under a "
        "deleted ghost's name, or one annotation on the pod etcd has, replaces the stale copy in every watch cache that "
        "still follows etcd, and in kube-scheduler's informer with it; exit 0 when every replica agrees with etcd).",
        "  2. Confirm no cache serves the ghost any more: ghost-guard diagnose default/web-1 (expect 'verdict: consistent').",
        f"  3. Only if heal reports a replica frozen (its cache revision no longer moves; among {R2}): restart that "
        "apiserver replica alone (its watch cache is rebuilt from etcd), run ghost-guard heal again, and restart "
        "kube-scheduler only if it still tries to bind the ghost afterwards (kubernetes#123072).",
    ]
    as_json = run("report", "--db", populated, "-o", "json")
    assert as_json.returncode == 1, as_json.stderr
    report = json.loads(as_json.stdout)
    assert [r["replica"] for r in report["stale_replicas"]] == [R2]
    assert [h["replica"] for h in report["healed_replicas"]] == [R3]
    assert [g["uid"] for g in report["unattributed_ghosts"]] == ["uid-api-0"]


@pytest.mark.parametrize(
    ("args", "stale", "unattributed"),
    [
        pytest.param([], [R2], ["uid-api-0"], id="all"),
        pytest.param(["--since", "1h"], [R2], [], id="since"),
        pytest.param(["--namespace", "prod"], [], ["uid-api-0"], id="namespace"),
    ],
)
def test_report_filters(populated: str, args: list[str], stale: list[str], unattributed: list[str]) -> None:
    result = run("report", "--db", populated, "-o", "json", *args)
    assert result.returncode == (1 if stale else 0), result.stderr
    report = json.loads(result.stdout)
    assert [r["replica"] for r in report["stale_replicas"]] == stale
    assert [g["uid"] for g in report["unattributed_ghosts"]] == unattributed


def test_cli_does_not_change_the_store(populated: str) -> None:
    before = Path(populated).read_bytes()
    assert run("audit", "--db", populated).returncode == 0
    assert run("report", "--db", populated).returncode == 1  # R2 serves a ghost
    assert Path(populated).read_bytes() == before


def test_bad_db_paths_exit_2_with_one_line(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    missing = tmp_path / "missing.db"
    dangling = tmp_path / "dangling.db"
    dangling.symlink_to(tmp_path / "target.db")
    cases = {
        str(tmp_path): f"ghost-guard audit: audit store {tmp_path} is a directory, not a file",
        str(text): f"ghost-guard audit: cannot use {text} as a ghost-guard audit store: file is not a database",
        str(other): f"ghost-guard audit: {other} is an SQLite database of another program (application_id 0, 1 schema objects)",
        str(missing): f"ghost-guard audit: no audit store at {missing} (set --db or GHOST_GUARD_AUDIT_DB; `ghost-guard serve` creates it when it starts)",
        str(dangling): f"ghost-guard audit: no audit store at {dangling} (set --db or GHOST_GUARD_AUDIT_DB; `ghost-guard serve` creates it when it starts)",
        "/dev/null": "ghost-guard audit: audit store /dev/null is not a regular file",
    }
    for path, message in cases.items():
        result = run("audit", "--db", path)
        assert (result.returncode, result.stdout, result.stderr) == (2, "", message + "\n"), path
    assert not missing.exists() and not (tmp_path / "target.db").exists()  # reading never creates a store
    report = run("report", "--db", str(text))
    assert (report.returncode, report.stderr) == (2, f"ghost-guard report: cannot use {text} as a ghost-guard audit store: file is not a database\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--since", "yesterday"], "Invalid value for --since: --since 'yesterday' is neither a duration (like 30m, 1h, 2d) nor an ISO-8601 time (like 2026-06-02T10:00:00Z)", id="since"),
        pytest.param(["--verdict", "dead"], "Invalid value for '--verdict': 'dead' is not one of 'alive', 'ghost-deleted', 'ghost-replaced', 'already-bound', 'terminating', 'unknown'.", id="verdict"),
        pytest.param(["--namespace", "a\x01b"], "namespace must not contain control characters", id="namespace-control"),
        pytest.param(["--replica", "r" * 513], "replica must be 1 to 512 characters, got 513", id="replica-long"),
        pytest.param(["--limit", "0"], "Invalid value for '--limit': 0 is not in the range x>=1.", id="limit"),
        pytest.param(["--output", "yaml"], "Invalid value for '--output' / '-o': 'yaml' is not one of 'table', 'json', 'jsonl'.", id="output"),
    ],
)
def test_malformed_filters_exit_2(populated: str, args: list[str], message: str) -> None:
    result = run("audit", "--db", populated, *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == f"Error: {message}"
