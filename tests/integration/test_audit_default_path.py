"""`serve` without --audit-db where the default directory (/var/lib/ghost-guard) cannot be written
(issue 26, finding 6): it says so once, records to $XDG_STATE_HOME/ghost-guard/audit.db, and
`ghost-guard audit` / `report` (no --db either) read that same store. No error-level line.

A real `ghost-guard serve` (its own process: the note is the master's, once, not one per worker).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clirun import ghost_guard
from guard.lab.harness import eventually
from guard.core.settings import DEFAULT_AUDIT_DB

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(os.path.isdir(os.path.dirname(DEFAULT_AUDIT_DB)),
                                 reason=f"{os.path.dirname(DEFAULT_AUDIT_DB)} exists on this machine: the default is used")]


def test_serve_without_audit_db_records_where_audit_reads(start_guard, dead_kubeconfig, tmp_path: Path) -> None:
    state = tmp_path / "state"
    g = start_guard(["--kubeconfig", dead_kubeconfig, "--workers", "2", "--no-prepare", "--no-events"],
                    env={"XDG_STATE_HOME": str(state)}, wait=None, clean_env=True)
    g.wait("/healthz", 90)  # a loaded machine boots workers slowly
    store = state / "ghost-guard" / "audit.db"
    eventually(store.exists, 60, what="the audit store in $XDG_STATE_HOME", process=g)
    notes = [line for line in g.logs(None).splitlines() if "cannot be written here" in line]
    assert len(notes) == 1, g.logs(None)  # once, from the master, not per worker
    assert notes[0].count(str(store)) == 1 and "/var/lib/ghost-guard" in notes[0]
    assert not [r for r in g.log_records() if r.get("level") in ("error", "critical")], g.logs(None)

    r = ghost_guard("audit", env={"XDG_STATE_HOME": str(state)}, clean_env=True)
    assert r.returncode == 0, r.stderr  # it finds the store serve writes (empty so far)
    assert "no audit store" not in r.stderr
    r = ghost_guard("report", env={"XDG_STATE_HOME": str(state)}, clean_env=True)
    assert r.returncode == 0, r.stderr
