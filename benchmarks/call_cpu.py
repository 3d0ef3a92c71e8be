"""CPU per /filter call on a cached verdict: the guard's serving path against the pass-through extender.

One live pod, its verdict cached after the first call; a serial client (``requests``, keep-alive,
HTTP/1.1 as kube-scheduler) calls ``/filter`` for it ``--calls`` times per extender, and the CPU of
the extender's process tree (utime + stime from ``/proc``) is divided by the calls. This isolates
what serving one call costs (accept loop, request parsing, the app, the reply) from verification
and watches. Extenders alternate, ``--rounds`` times: this checkout's guard, ``--baseline TREE``'s
guard (a ``git archive`` of another commit) and the pass-through.

Run from the repository root: ``python -m benchmarks.call_cpu [--calls 2000] [--nodes 100] [--rounds 2] [--baseline TREE]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import requests

from benchmarks.cpu_per_pod import tree_usage
from benchmarks.filter_latency import body, machine, pin_harness, start_passthrough
from benchmarks.prepared_burst import start_guard
from benchmarks.soak_lab import LabProcess
from guard.lab.harness import pod_manifest, stop_group


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--nodes", type=int, default=100, help="node names per call")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", metavar="TREE", help="also run the guard of another source tree")
    ap.add_argument("--no-pin", action="store_true", help="don't give the extender its own CPU")
    args = ap.parse_args()
    if not args.no_pin:
        pin_harness()
    nodes = [f"node-{i:04d}" for i in range(args.nodes)]
    variants = ["guard"] + (["baseline"] if args.baseline else []) + ["pass-through"]
    results: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        lab = LabProcess(f"{tmp}/lab", timeout=60)
        try:
            pod = lab.core_v1(0).create_namespaced_pod("default", pod_manifest("p"), _request_timeout=10)
            payload = body("default", "p", pod.metadata.uid, nodes)
            n = 0
            for _ in range(args.rounds):
                for which in variants:
                    n += 1
                    if which == "pass-through":
                        proc, url = start_passthrough()
                    else:
                        g = start_guard(lab, tmp, n, [], args.baseline if which == "baseline" else None)
                        proc, url = g.proc, g.base
                    try:
                        s = requests.Session()
                        for _ in range(50):  # warm: connection, imports, the verdict cached
                            s.post(url + "/filter", data=payload, headers={"Content-Type": "application/json"})
                        time.sleep(1.0)
                        u0 = tree_usage(proc.pid)
                        for _ in range(args.calls):
                            r = s.post(url + "/filter", data=payload, headers={"Content-Type": "application/json"})
                            r.raise_for_status()
                        u1 = tree_usage(proc.pid)
                        user, system, switches = (b - a for a, b in zip(u0, u1))
                        results[which].append((user * 1000 / args.calls, system * 1000 / args.calls,
                                               switches / args.calls))
                        print(which, results[which][-1], file=sys.stderr, flush=True)
                    finally:
                        stop_group(proc)
        finally:
            lab.close()
    print(f"{machine()}; {args.calls} calls per run, {args.nodes} node names per call, {args.rounds} rounds, means\n")
    print("| extender | CPU ms/call | user ms/call | system ms/call | context switches/call |")
    print("|---|---:|---:|---:|---:|")
    for which in variants:
        rs = results[which]
        user, system, sw = (statistics.mean(r[i] for r in rs) for i in range(3))
        print(f"| {which} | {user + system:.3f} | {user:.3f} | {system:.3f} | {sw:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
