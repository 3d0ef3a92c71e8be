"""`kubectl ghost-guard ...` (issue 26): the package installs an executable `kubectl-ghost_guard`
(pyproject.toml [project.scripts]), which the real kubectl finds on PATH and runs as a plugin.

The executable is written as pip writes a console script (the entry point from pyproject.toml), into a
temporary PATH directory, and run through /usr/bin/kubectl (its plugin discovery, not ours).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = shutil.which("kubectl")

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")]


def test_kubectl_runs_the_plugin(tmp_path: Path) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    target = scripts["kubectl-ghost_guard"]
    module, func = target.split(":")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    plugin = bindir / "kubectl-ghost_guard"
    plugin.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT)), "KUBECONFIG": str(tmp_path / "none")}

    listed = subprocess.run([KUBECTL, "plugin", "list"], capture_output=True, text=True, timeout=60, env=env)
    assert str(plugin) in listed.stdout, listed.stdout + listed.stderr

    helped = subprocess.run([KUBECTL, "ghost-guard", "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("Usage: kubectl ghost-guard [OPTIONS] COMMAND [ARGS]..."), helped.stdout

    db = tmp_path / "audit.db"
    from guard.audit.sqlite import AuditStore

    AuditStore(str(db)).close()
    report = subprocess.run([KUBECTL, "ghost-guard", "report", "--db", str(db)], capture_output=True, text=True,
                            timeout=60, env=env)
    assert report.returncode == 0, report.stderr
    assert report.stdout == "No apiserver replica is known to serve a ghost.\nNothing to do.\n", report.stdout
