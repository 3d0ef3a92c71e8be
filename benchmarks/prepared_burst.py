"""Pre-verification on the scheduling path: a serial client plays kube-scheduler.

On the lab (real etcd, 3 apiserver replicas, in its own process): pods are created while a serial
client, with its own informer on replica 0 (LIST resourceVersion=0, then WATCH),
makes one ``/filter`` call per pod as soon as the pod appears, like
kube-scheduler. Run against the guard (pre-verification on) and against the
minimal pass-through extender, alternating, in one run. The guard is stopped
while the pass-through runs, so it takes no CPU from it.

Reported per case: how first calls were answered (the guard's
``ghost_guard_verdicts_prepared_total``: from a verdict ready before the call;
``..._shared_read_total``: waited on the background GET still in flight;
``..._inline_total``: a GET of its own), ``/filter`` p50/p99, quorum GETs per
pod (the lab's request logs, all replicas), the serial client's pods/s, the
share of the client's time spent waiting on ``/filter`` (busy), and the lab's
pod creation rate in that run (the client cannot go faster than pods appear).

Cases: ``burst`` (500 pods created by 4 threads as fast as the lab takes them,
while the client runs: it keeps pace with creation, so every pod is a race
between the guard's background GET and the client's call), ``backlog`` (the
same 500 pods land before the client reaches them, as when the scheduler is
busy: pre-verification's design case) and ``trickle`` (10 pods/s).

Run from the repository root: ``python -m benchmarks.prepared_burst [--pods 500] [--trickle-seconds 20] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import requests
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import filter_latency
from benchmarks.filter_latency import pin_harness, start_passthrough
from benchmarks.soak_lab import LabProcess
from guard.lab.harness import GuardProcess, NotReached, eventually, pod_manifest, stop_group

NODES = [f"node-{i:03d}" for i in range(100)]


class Informer(threading.Thread):
    """Unscheduled pods of one namespace, from one replica's watch cache, in arrival order."""

    def __init__(self, lab: "LabProcess", namespace: str) -> None:
        super().__init__(daemon=True)
        self.api = lab.core_v1(0)
        self.namespace = namespace
        self.pods: queue.Queue = queue.Queue()
        self.ready = threading.Event()
        self.stopping = False
        self.bound = 0  # pods the watch has shown bound (MODIFIED with a nodeName)
        self.all_bound = threading.Event()
        self.expect_bound = 0

    def run(self) -> None:
        lst = self.api.list_namespaced_pod(self.namespace, resource_version="0", _preload_content=False)
        rv = orjson.loads(lst.data)["metadata"]["resourceVersion"]
        resp = self.api.list_namespaced_pod(self.namespace, resource_version=rv, watch=True, timeout_seconds=600,
                                            _preload_content=False)
        self.ready.set()
        buf = b""
        try:
            for chunk in resp.stream(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    ev = orjson.loads(line)
                    if ev["type"] == "ADDED":
                        self.pods.put((time.perf_counter(), ev["object"]))
                    elif ev["type"] == "MODIFIED" and ev["object"]["spec"].get("nodeName"):
                        self.bound += 1
                        if self.expect_bound and self.bound >= self.expect_bound:
                            self.all_bound.set()
                if self.stopping:
                    break
        except Exception:  # the stream is cut when the case ends
            if not self.stopping:
                raise
        finally:
            resp.release_conn()


def metric(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def start_guard(lab: LabProcess, tmp: str, n: int, extra: list[str], tree: str | None = None) -> GuardProcess:
    """A guard reading replica 0 (from this checkout, or ``tree``), once its watches run on every replica
    and it has verified the pending pods it listed at its start (the earlier cases' pods too), as for
    a guard that has been running."""
    g = filter_latency.start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", f"{tmp}/{n}.db", *extra],
                                   tree=tree)
    try:
        g.wait("/readyz", timeout=20)
        seen: list[float] = []

        def settled() -> bool:  # the startup verification's counter stood still for 4 reads
            seen.append(metric(g.base, "ghost_guard_prepare_verified_total"))
            return len(seen) > 4 and len(set(seen[-5:])) == 1

        try:
            eventually(settled, 60, what="the startup verification done", interval=0.25)
        except NotReached as e:
            print(f"going on: {e}", file=sys.stderr)
    except BaseException:
        g.stop()
        raise
    return g


def bind(api, pod: dict, node: str) -> None:
    """POST the pod's Binding, as kube-scheduler's binding cycle does (guard/lab/scheduler/core.py)."""
    meta = pod["metadata"]
    body = {"apiVersion": "v1", "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]},
            "target": {"kind": "Node", "name": node}}
    resp = api.create_namespaced_pod_binding(meta["name"], meta["namespace"], body, _preload_content=False,
                                             _request_timeout=10)
    resp.drain_conn()
    resp.release_conn()


def run_case(lab: LabProcess, namespace: str, extender: str, pods: int, rate: float | None,
             bind_pods: bool = False) -> dict:
    """One case. With ``bind_pods`` the client binds each pod after its ``/filter`` answer, as
    kube-scheduler does (asynchronously, 4 binding threads), and the case ends when its informer has
    seen every pod bound; without, pods stay unscheduled (and are listed by the guard until deleted)."""
    lab.core_v1(0).create_namespace({"metadata": {"name": namespace}})
    informer = Informer(lab, namespace)
    informer.expect_bound = pods if bind_pods else 0
    informer.start()
    informer.ready.wait(10)
    api = lab.core_v1(0)

    def create(i: int) -> None:
        api.create_namespaced_pod(namespace, pod_manifest(f"p-{i:04d}"), _request_timeout=10)

    created: list[float] = []

    def creator() -> None:
        t0 = time.perf_counter()
        if not rate:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(create, range(pods)))
        else:
            for i in range(pods):
                time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                create(i)
        created.append(pods / (time.perf_counter() - t0))

    since = time.time()
    latencies, first_seen, done_at = [], None, None
    creating = threading.Thread(target=creator, daemon=True)
    if rate == 0:  # backlog: the burst lands before the scheduler gets to it (it is busy, or restarting)
        creating.run()
        time.sleep(1.0)
        first_seen = time.perf_counter()
    else:
        creating.start()
    session = requests.Session()
    session.trust_env = False
    binder = ThreadPoolExecutor(4) if bind_pods else None
    binds = []
    for _ in range(pods):
        seen, pod = informer.pods.get(timeout=60)
        first_seen = first_seen or seen
        meta = pod["metadata"]
        body = orjson.dumps({"Pod": {"metadata": meta, "spec": pod["spec"], "status": pod.get("status", {})},
                             "Nodes": None, "NodeNames": NODES})
        t = time.perf_counter()
        r = session.post(extender + "/filter", data=body, headers={"Content-Type": "application/json"}, timeout=10)
        latencies.append(time.perf_counter() - t)
        if r.status_code != 200 or r.json()["NodeNames"] != NODES:
            raise RuntimeError(f"unexpected reply for {meta['name']}: {r.status_code} {r.text[:300]}")
        done_at = time.perf_counter()
        if binder is not None:
            binds.append(binder.submit(bind, api, pod, NODES[len(binds) % len(NODES)]))
    if binder is not None:
        for b in binds:
            b.result()
        binder.shutdown()
        if not informer.all_bound.wait(30):
            raise RuntimeError(f"the informer saw {informer.bound} of {pods} pods bound")
        done_at = time.perf_counter()
    informer.stopping = True
    if creating.ident is not None:
        creating.join(60)
    gets = lab.quorum_gets(namespace, since)
    s = sorted(latencies)
    return {"p50_ms": statistics.median(s) * 1000, "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1000,
            "pods_per_s": pods / (done_at - first_seen), "gets_per_pod": gets / pods,
            # the share of the client's time spent waiting on /filter, and the lab's creation rate
            "busy": sum(latencies) / (done_at - first_seen), "created_per_s": created[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--trickle-seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2, help="alternations of guard and pass-through per case")
    ap.add_argument("--no-pin", action="store_true", help="don't give the extender its own CPU")
    ap.add_argument("--cases", default="burst,backlog,trickle", help="which cases to run (comma-separated)")
    ap.add_argument("guard_flags", nargs="*", help="extra flags for ghost-guard serve (after --)")
    args = ap.parse_args()
    extra = args.guard_flags
    if not args.no_pin:
        pin_harness()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lab = LabProcess(f"{tmp}/lab", timeout=60)
        cases = {"burst": ("burst, created while the client runs", args.pods, None),
                 "backlog": ("burst, backlog (created before the client reaches it)", args.pods, 0.0),
                 "trickle": ("trickle 10/s", int(args.trickle_seconds * 10), 10.0)}
        try:
            cases = [cases[c.strip()] for c in args.cases.split(",")]
        except KeyError as e:
            ap.error(f"unknown case {e}; choose from burst, backlog, trickle")
        n = 0
        for case, pods, rate in cases:
            agg: dict[str, list[dict]] = {"guard": [], "pass-through": []}
            prepared_share = []
            for _round in range(args.rounds):
                for which in ("guard", "pass-through"):
                    n += 1
                    if which == "guard":
                        guard = start_guard(lab, tmp, n, extra)
                        proc, url = guard.proc, guard.base
                    else:
                        proc, url = start_passthrough()
                    try:
                        res = run_case(lab, f"b{n}", url, pods, rate)
                        if which == "guard":
                            counts = [metric(url, f"ghost_guard_verdicts_{k}_total")
                                      for k in ("prepared", "shared_read", "inline")]
                            prepared_share.append([c / max(1.0, sum(counts)) for c in counts])
                        agg[which].append(res)
                        print(f"{case}, {which}: {res}", file=sys.stderr, flush=True)
                    finally:
                        stop_group(proc)
            g = {k: statistics.mean(r[k] for r in agg["guard"]) for k in agg["guard"][0]}
            p = {k: statistics.mean(r[k] for r in agg["pass-through"]) for k in agg["pass-through"][0]}
            shares = [statistics.mean(r[i] for r in prepared_share) for i in range(3)]
            rows.append((case, pods, shares, g, p))
        lab.close()

    print(f"{filter_latency.machine()}; {args.rounds} rounds per cell, means\n")
    print("| case | pods | first calls: prepared / shared read in flight / own GET | guard p50 ms | guard p99 ms "
          "| pass-through p50 ms | pass-through p99 ms | quorum GETs per pod | guard pods/s | pass-through pods/s "
          "| pods/s ratio | client busy (guard / pass-through) | pods created/s (guard / pass-through) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case, pods, shares, g, p in rows:
        print(f"| {case} | {pods} | {shares[0]:.1%} / {shares[1]:.1%} / {shares[2]:.1%} | {g['p50_ms']:.2f} "
              f"| {g['p99_ms']:.2f} | {p['p50_ms']:.2f} | {p['p99_ms']:.2f} | {g['gets_per_pod']:.2f} "
              f"| {g['pods_per_s']:.0f} | {p['pods_per_s']:.0f} | {g['pods_per_s'] / p['pods_per_s']:.2f} "
              f"| {g['busy']:.0%} / {p['busy']:.0%} | {g['created_per_s']:.0f} / {p['created_per_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
