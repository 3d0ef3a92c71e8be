"""The guard's peak memory taking over a backlog: two source trees side by side (issue 29).

On a running real control plane (``--lab-dir``: a ``RealLab``'s directory, e.g. the one
``benchmarks/scale_sweep_real.py`` made, with its kubeconfigs and replicas), ``--pending`` pending pods
are created in one namespace (no kube-scheduler runs), then for each round and each tree
(``--trees A,B``: source trees, run with ``PYTHONPATH`` = the tree) a guard is started
(``--apiserver-replicas`` every replica), asked once (the first call after its start is a takeover:
the backlog it listed is queued for verification), and watched until it verified every pending pod;
its peak RSS (``VmHWM`` of gunicorn's master + worker, as before; and of every process of its tree:
master, worker, the worker's helper processes (``guard.serving.offload``), each and summed), its
peak PSS (the tree's ``Pss`` summed, sampled every 0.5 s: pages the fork shares counted once), its
time to ready and to the whole backlog verified, and its CPU are recorded. One guard at a time.

Run from the repository root: ``python -m benchmarks.backlog_rss --lab-dir DIR --trees OLD,NEW
[--pending 10000] [--rounds 2] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import orjson
import requests

from benchmarks.cpu_per_pod import tree_cpu
from benchmarks.cpu_per_pod_real import loadavg
from benchmarks.filter_latency import machine
from benchmarks.prepared_burst import metric
from benchmarks.scale_sweep_real import Poster, pending_bodies, peak_rss_mib, post_pods
from guard.lab.harness import GuardProcess, child_pids, eventually


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (workers, their helpers), depth first."""
    out = []
    for c in child_pids(pid):
        out += [c, *descendants(c)]
    return out


def status_kib(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/{'smaps_rollup' if field == 'Pss:' else 'status'}").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class PssPeak(threading.Thread):
    """The highest sum of ``Pss`` over a process tree, sampled every 0.5 s until ``stop``."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self.done = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.peak_kib = max(self.peak_kib, sum(status_kib(p, "Pss:") for p in [self.pid, *descendants(self.pid)]))

    def stop(self) -> float:
        self.done.set()
        self.join()
        return self.peak_kib / 1024


def tree_peaks(pid: int) -> dict[str, float]:
    """VmHWM (MiB) of the master, its workers, and their helpers (every process below a worker), and the sum."""
    workers = child_pids(pid)
    helpers = [h for w in workers for h in descendants(w)]
    mib = {"master": status_kib(pid, "VmHWM:") / 1024,
           "worker": sum(status_kib(w, "VmHWM:") for w in workers) / 1024,
           "helpers": sum(status_kib(h, "VmHWM:") for h in helpers) / 1024, "helper_count": len(helpers)}
    mib["tree"] = mib["master"] + mib["worker"] + mib["helpers"]
    return mib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lab-dir", required=True)
    ap.add_argument("--trees", required=True, help="two (or more) source trees, comma-separated, labelled by path; "
                    "PATH@NAME=VALUE runs that tree with one more environment variable (e.g. MALLOC_ARENA_MAX=2)")
    ap.add_argument("--pending", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--namespace", help="use this namespace's pods (already --pending of them) instead of creating them")
    args = ap.parse_args()
    d = Path(args.lab_dir)
    server = json.loads((d / "kubeconfig-0").read_text())["clusters"][0]["cluster"]["server"]
    port = int(server.rsplit(":", 1)[1])
    token = (d / "tokens.csv").read_text().split(",", 1)[0]
    lab = SimpleNamespace(port=port, ca_path=str(d / "ca.crt"), token=token)
    replicas = sorted(p.name for p in d.glob("kubeconfig-*"))
    urls = [f"https://127.0.0.{i + 1}:{port}" for i in range(len(replicas))]
    ns = args.namespace or f"rss-{os.getpid()}"
    if not args.namespace:
        poster = Poster(lab, 0)  # type: ignore[arg-type]
        if poster.post("/api/v1/namespaces", orjson.dumps({"metadata": {"name": ns}})) != 201:
            raise RuntimeError(f"could not create namespace {ns}")
        poster.post(f"/api/v1/namespaces/{ns}/serviceaccounts", orjson.dumps({"metadata": {"name": "default"}}))
        poster.close()
        created = post_pods(lab, ns, pending_bodies(args.pending), 8, list(range(len(replicas))))  # type: ignore[arg-type]
        print(f"{args.pending} pending pods in {ns} ({created:.0f}/s)", file=sys.stderr, flush=True)
    doc = {"machine": machine(), "pending": args.pending, "rows": []}
    trees = args.trees.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label in trees:
                tree, _, extra_env = label.partition("@")  # PATH@NAME=VALUE: that tree with one more variable
                env = {"PYTHONPATH": tree, **dict([extra_env.split("=", 1)] if extra_env else [])}
                t0 = time.perf_counter()
                g = GuardProcess(["--no-access-log", "--no-events", "--log-level", "warning", "--kubeconfig",
                                  str(d / "kubeconfig-0"), "--apiserver-replicas", ",".join(urls), "--audit-db",
                                  f"{tmp}/{r}-{len(doc['rows'])}.db"], cwd=tree, env=env)
                pss = PssPeak(g.proc.pid)
                pss.start()
                try:
                    g.wait("/readyz", timeout=300)
                    ready = time.perf_counter() - t0
                    requests.post(g.base + "/filter", timeout=30, headers={"Content-Type": "application/json"},
                                  data=orjson.dumps({"Pod": {"metadata": {"name": "p-00000", "namespace": ns}},
                                                     "Nodes": None, "NodeNames": ["node-0000"]}))
                    eventually(lambda: metric(g.base, "ghost_guard_prepare_verified_total") >= args.pending, 900,
                               what="the backlog verified", interval=1.0)
                    row = {"tree": label, "round": r, "ready_s": ready, "verified_s": time.perf_counter() - t0,
                           "peak_rss_mib": peak_rss_mib(g.proc.pid), "cpu_s": tree_cpu(g.proc.pid),
                           "peaks_mib": tree_peaks(g.proc.pid), "peak_pss_mib": pss.stop(), "load": loadavg()}
                finally:
                    pss.stop()
                    g.stop()
                doc["rows"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"{doc['machine']}; {args.pending} pending pods, {len(replicas)} replicas\n")
    print("| tree | rounds | peak RSS MiB, master + worker (each) | median | master / worker / helpers (median) | "
          "whole tree (each) | peak PSS, whole tree (each) | ready s | backlog verified s | CPU s |")
    print("|---|---:|---|---:|---|---|---|---:|---:|---:|")
    for tree in trees:
        rows = [x for x in doc["rows"] if x["tree"] == tree]
        each = ", ".join(f"{x['peak_rss_mib']:.0f}" for x in rows)
        parts = " / ".join(f"{statistics.median(x['peaks_mib'][k] for x in rows):.0f}" for k in ("master", "worker", "helpers"))
        print(f"| {tree} | {len(rows)} | {each} | "
              f"{statistics.median(x['peak_rss_mib'] for x in rows):.0f} | {parts} | "
              f"{', '.join(format(x['peaks_mib']['tree'], '.0f') for x in rows)} | "
              f"{', '.join(format(x['peak_pss_mib'], '.0f') for x in rows)} | "
              f"{statistics.median(x['ready_s'] for x in rows):.1f} | "
              f"{statistics.median(x['verified_s'] for x in rows):.1f} | "
              f"{statistics.median(x['cpu_s'] for x in rows):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
