"""Where the guard's CPU per pod goes, by thread: the live case of ``cpu_per_pod`` with each thread's CPU.

The guard's worker runs its threads by job: the event loop (``MainThread``), the request pool
(``ThreadPoolExecutor-*``), the background verifiers (``ghost-verify-*``), the watch
(``ghost-watch-*``), the listings (``ghost-list*``), cache health. This runs one guard against
the lab (3 apiserver replicas), makes it the guard being called, creates ``--pods`` pods while a
serial client calls ``/filter`` for each and binds it (prepared_burst's live case), and reads every thread's
CPU (utime + stime of ``/proc/PID/task/TID``, exact per thread) before and after. Thread names
come from ``py-spy dump`` (py-spy's samples of *where* in a thread time goes were too unreliable
under ``--nonblocking`` for this; the per-thread totals are the kernel's). Needs py-spy
(``python3 -m pip install py-spy``), which the project does not install.

Run from the repository root: ``python -m benchmarks.thread_cpu [--pods 1000] [--nodes 100] [--backlog] [--no-bind] [--tree TREE]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import requests

from benchmarks import prepared_burst
from benchmarks.cpu_per_pod import TICK
from benchmarks.filter_latency import machine, pin_harness
from benchmarks.prepared_burst import run_case, start_guard
from benchmarks.soak_lab import LabProcess
from guard.lab.harness import stop_group


def thread_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """(user, system) seconds of each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            raw = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(tid)] = (int(fields[11]) / TICK, int(fields[12]) / TICK)
    return out


def thread_names(pid: int) -> dict[int, str]:
    dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'Thread (\d+) \(\w+\): "([^"]*)"', dump)}


def job(name: str | None) -> str:
    if name is None:
        return "(started during the run)"
    return re.sub(r"[-_]\d+$", "", re.sub(r"^ghost-watch-.*", "ghost-watch", re.sub(r"-\d+_\d+$", "", name)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--tree", help="the guard of another source tree")
    ap.add_argument("--no-bind", action="store_true", help="leave the pods unscheduled instead of binding each one")
    ap.add_argument("--backlog", action="store_true", help="the pods land before the client reaches them "
                    "(cpu_per_pod's backlog case) instead of being created while it runs")
    args = ap.parse_args()
    pin_harness()
    prepared_burst.NODES = [f"node-{i:04d}" for i in range(args.nodes)]
    with tempfile.TemporaryDirectory() as tmp:
        lab = LabProcess(f"{tmp}/lab", replicas=3, timeout=60)
        try:
            g = start_guard(lab, tmp, 1, [], args.tree)
            try:
                requests.post(g.base + "/filter", timeout=10, headers={"Content-Type": "application/json"},
                              data=orjson.dumps({"Pod": {"metadata": {"name": "warm-up", "namespace": "default",
                                                                      "uid": "warm"}}, "NodeNames": ["n1"]}))
                time.sleep(2)  # the takeover: the watch starts
                worker = next(int(p) for p in os.listdir("/proc") if p.isdigit()
                              and Path(f"/proc/{p}/stat").read_text().rsplit(") ", 1)[1].split()[1] == str(g.proc.pid))
                names = thread_names(worker)
                before = thread_cpu(worker)
                res = run_case(lab, "c1", g.base, args.pods, 0.0 if args.backlog else None, not args.no_bind)
                after = thread_cpu(worker)
            finally:
                stop_group(g.proc)
        finally:
            lab.close()
    by_job: dict[str, list[float]] = {}
    for tid, (user, system) in after.items():
        u0, s0 = before.get(tid, (0.0, 0.0))
        acc = by_job.setdefault(job(names.get(tid)), [0.0, 0.0])
        acc[0] += user - u0
        acc[1] += system - s0
    print(f"{machine()}; {args.pods} pods {'created before' if args.backlog else 'created while'} the client runs"
          f"{'' if args.no_bind else ', each bound'}, {args.nodes} node names per call; "
          f"{res['pods_per_s']:.0f} pods/s\n")
    print("| threads | CPU ms/pod | user | system |\n|---|---:|---:|---:|")
    per_pod = 1000 / args.pods
    for name, (user, system) in sorted(by_job.items(), key=lambda kv: -sum(kv[1])):
        if user + system > 0:
            print(f"| {name} | {(user + system) * per_pod:.3f} | {user * per_pod:.3f} | {system * per_pod:.3f} |")
    user, system = (sum(v[i] for v in by_job.values()) for i in (0, 1))
    print(f"| all (the worker process) | {(user + system) * per_pod:.3f} | {user * per_pod:.3f} | {system * per_pod:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
