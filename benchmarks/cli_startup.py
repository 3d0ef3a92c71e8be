"""Start-up of the CLI's cluster commands: how long before ``diagnose``, ``heal``, ``report --live`` and
``audit --audit-store kubernetes`` send their first request, and their CPU in all (issue 26: goal 0.5 s).

A Python lab (2 replicas, in this process) holds a ghost ``default/web-1`` on replica 1. Each command
runs as its own process (``python -m guard ...``, as an operator runs it), ``--rounds`` times, in turn.
While it runs, this process watches the lab's request logs; at the first request of that process it
reads the child's CPU time from ``/proc/PID/stat``. Per command:

- ``cpu to 1st request``: the child's user+system CPU when the lab saw its first request (interpreter,
  imports, credentials, client set-up; a few ms of polling lag);
- ``wall to 1st request``: spawn to first request, wall clock (inflated by the machine's load);
- ``cpu total``: the child's user+system CPU in all (``report --live`` waits 5 s on purpose: its wall
  time says nothing about start-up).

``--baseline REF`` runs the same commands from ``git archive REF`` too, alternating, for a before/after
in one run. Run from the repository root: ``python -m benchmarks.cli_startup [--rounds 5] [--baseline main]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float | None:
    """user+system CPU seconds of a running process (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def run_once(lab, tree: str, argv: list[str]) -> dict[str, float]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GHOST_GUARD_")}, "PYTHONPATH": tree}
    before = os.times()
    since = time.time()
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "guard", *argv], env=env, cwd=tree,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_cpu = first_wall = None
    while proc.poll() is None:
        if first_cpu is None and any(r.requests(since=since) for r in lab.replicas):
            first_wall = time.monotonic() - start
            first_cpu = _cpu(proc.pid)
        time.sleep(0.005)
    wall = time.monotonic() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"cpu_first": first_cpu if first_cpu is not None else float("nan"),
            "wall_first": first_wall if first_wall is not None else float("nan"),
            "cpu_total": cpu, "wall_total": wall, "rc": float(proc.returncode)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", default=None, metavar="REF", help="also run this git ref's tree (git archive)")
    args = ap.parse_args()
    from guard.lab import Lab
    from guard.lab.harness import make_ghost

    here = str(Path(__file__).resolve().parents[1])
    trees = {"this tree": here}
    with tempfile.TemporaryDirectory(prefix="cli-startup-") as tmp, Lab(replicas=2) as lab:
        if args.baseline:
            base = Path(tmp) / "baseline"
            base.mkdir()
            archive = subprocess.run(["git", "archive", args.baseline], cwd=here, capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
            trees = {args.baseline: str(base), **trees}
        make_ghost(lab, "default", "web-1", stale=1)
        kc = lab.kubeconfig(0)
        urls = ",".join(r.url for r in lab.replicas)
        commands = {
            "diagnose": ["diagnose", "default/web-1", "--kubeconfig", kc, "--apiserver-replicas", urls],
            "heal --dry-run": ["heal", "--dry-run", "default/web-1", "--kubeconfig", kc, "--apiserver-replicas", urls],
            "report --live": ["report", "--live", "--db", str(Path(tmp) / "none.db"), "--kubeconfig", kc,
                              "--apiserver-replicas", urls],
            "audit --audit-store kubernetes": ["audit", "--audit-store", "kubernetes", "--kubeconfig", kc],
        }
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for name, argv in commands.items():
                for label, tree in trees.items():
                    results.setdefault((name, label), []).append(run_once(lab, tree, argv))
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (cpus: {os.cpu_count()}); rounds: {args.rounds}; "
          "medians, seconds")
    print(f"{'command':32}{'tree':>12}{'cpu to 1st req':>16}{'wall to 1st req':>17}{'cpu total':>11}{'exit':>6}")
    for (name, label), runs in results.items():
        def med(key: str) -> float:
            return statistics.median(r[key] for r in runs)
        codes = sorted({int(r["rc"]) for r in runs})
        print(f"{name:32}{label:>12}{med('cpu_first'):>16.2f}{med('wall_first'):>17.2f}{med('cpu_total'):>11.2f}"
              f"{','.join(map(str, codes)):>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
