"""What an operator meets first at the command line (issue 26, findings 4 and 10).

- Commands load the Kubernetes client only when they talk to a cluster: `ghost-guard --help`, every
  command's `--help` and the offline commands (`report`/`audit` on a SQLite store) never import
  `kubernetes` (about 1.5 s of CPU; docs/OPERATIONS.md "Start-up" has the measurements), and neither do
  the cluster commands with a plain kubeconfig (they call the apiserver through guard/kube/api.py's LightApi).
- The top-level `--help` lists every command without cutting its description ("...").
- `--events` help names every Event the guard emits; the no-credentials error names $KUBECONFIG.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from clirun import ghost_guard

pytestmark = pytest.mark.timeout(120)

EVENTS = ("GhostPodBlocked", "StaleWatchCache", "PodMissingFromReplica", "GhostHealed", "GhostHealFailed")


def imported_after(args: list[str], env: dict[str, str] | None = None) -> tuple[set[str], str]:
    """The heavy packages a fresh interpreter holds after ``ghost-guard *args`` (in it), and its stdout."""
    code = ("import sys\nfrom guard.cli import main\n"
            f"try:\n    main({args!r}, prog_name='ghost-guard')\nexcept SystemExit:\n    pass\n"
            "print('IMPORTED', sorted(m for m in ('kubernetes', 'flask', 'gunicorn', 'guard.lab') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, **(env or {})})
    line = [x for x in r.stdout.splitlines() if x.startswith("IMPORTED")][-1]
    return set(ast.literal_eval(line[len("IMPORTED "):])), r.stdout


def test_help_and_offline_commands_never_import_the_kubernetes_client(tmp_path):
    from guard.cli import main

    for args in [["--help"], *([c, "--help"] for c in sorted(main.commands)), ["audit", "export", "--help"]]:
        held, _ = imported_after(args)
        assert not held, (args, held)
    db = str(tmp_path / "audit.db")
    from guard.audit.sqlite import AuditStore

    AuditStore(db).close()
    for args in (["report", "--db", db], ["audit", "--db", db]):
        held, _ = imported_after(args)
        assert "kubernetes" not in held, (args, held)


@pytest.mark.parametrize("args", [
    ["diagnose", "default/web-1"], ["heal", "--dry-run", "default/web-1"], ["report", "--live"],
    ["audit", "--audit-store", "kubernetes"]], ids=["diagnose", "heal", "report-live", "audit-kubernetes"])
def test_cluster_commands_with_a_plain_kubeconfig_never_import_the_kubernetes_client(shared_lab, tmp_path, args):
    """Issue 26: start-up <= 0.5 s. With the lab's kubeconfig (a token and the CA) the commands talk to the
    cluster (they print what they found) without the client library (guard/kube/api.py LightApi)."""
    urls = ",".join(r.url for r in shared_lab.replicas)
    extra = ["--apiserver-replicas", urls] if args[0] != "audit" else []
    if args[0] == "report":
        extra += ["--db", str(tmp_path / "none.db")]
    held, out = imported_after([*args, "--kubeconfig", shared_lab.kubeconfig(0), *extra])
    assert "kubernetes" not in held, (args, held, out)
    # the shared lab may hold other tests' GhostPods: the audit table or its absence, both read from the cluster
    expected = {"diagnose": ["verdict:"], "heal": ["default/web-1"], "report": ["replica"],
                "audit": ["no audit records", "LAST SEEN"]}
    assert any(e in out for e in expected[args[0]]), out


def test_serve_s_credentials_check_leaves_the_kubernetes_client_out_of_the_master(shared_lab, tmp_path):
    """`serve`'s preflight runs in the gunicorn master, which lives as long as the guard and serves nothing:
    with a plain kubeconfig it checks the credentials without importing `kubernetes` (23 MiB of the master's
    RSS for its whole life, issue 29); a kubeconfig that cannot load still fails there, with the same words."""
    code = ("import sys\nfrom guard.core.settings import Settings\nfrom guard.serving.server import StartupError, preflight\n"
            "for kc in sys.argv[1:]:\n    try:\n        preflight(Settings(kubeconfig=kc))\n        print('OK')\n"
            "    except StartupError as e:\n        print('ERROR', e)\nprint('IMPORTED', 'kubernetes' in sys.modules)")
    bad = tmp_path / "bad"
    bad.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    r = subprocess.run([sys.executable, "-c", code, shared_lab.kubeconfig(0)], capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.splitlines() == ["OK", "IMPORTED False"], (r.stdout, r.stderr)
    r = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.stdout.startswith(f"ERROR cannot load cluster credentials from {bad}:"), (r.stdout, r.stderr)


def test_top_level_help_lists_every_command_uncut():
    r = ghost_guard("--help")
    commands = r.stdout.split("Commands:", 1)[1].strip().splitlines()
    assert len(commands) == 8 and not any(line.rstrip().endswith("...") for line in commands), commands


def test_events_help_names_every_event():
    text = " ".join(ghost_guard("serve", "--help").stdout.split())
    assert all(e in text for e in EVENTS), text


def test_no_credentials_names_kubeconfig(tmp_path):
    r = ghost_guard("diagnose", "default/web-0", env={"KUBECONFIG": None, "HOME": str(tmp_path),
                                                       "KUBERNETES_SERVICE_HOST": None})
    assert r.returncode == 2 and "$KUBECONFIG" in r.stderr and "Traceback" not in r.stderr, r.stderr
