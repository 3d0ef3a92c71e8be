"""The guard at Kubernetes' scale limits (issue 29): nodes x pending pods on the real control plane.

One :class:`guard.lab.real.controlplane.RealLab` for the whole run: etcd, **3 kube-apiserver
replicas** (127.0.0.1-3, no fault proxy, ``--delete-collection-workers 8``), the real kube-scheduler
on replica 2 (as ``cpu_per_pod_real``: the product's KubeSchedulerConfiguration, ``qps``/``burst``
1000, ``ignorable: false``, plain HTTP to either extender). Before any case the cluster is given
``--bound`` pods (default 30,000) that are already bound (``spec.nodeName`` set at create, raw
POSTs from 16 threads over the 3 replicas): they sit on node names no Node has (``gone-N``; the
fake Nodes keep their 110-pod room for the cases' pods), so every apiserver's watch cache, every
listing of pods by field selector and kube-scheduler's cache hold them, as in a full cluster.

Cells: nodes (``--nodes``, default 100,1000,5000; fake Ready Nodes added or removed between cells)
x pending pods P (``--pending``, default 100,1000,10000). Per cell and round, two phases, each run
for the guard and then the pass-through (``benchmarks/passthrough_extender.py``), one extender at a time:

- **live**: the extender (the guard waited for until its start-up verification settled, then
  asked once, as ``cpu_per_pod_real``) and kube-scheduler run; the P pods are created by 8 threads
  (raw POSTs on replica 1). pods/s = P / (first create -> last pod bound).
- **backlog (a takeover)**: the P pods are created while nothing runs, then the extender is
  started (launch -> ``/readyz``, no settling wait: the guard lists, verifies and answers from a
  cold start) and kube-scheduler right after it, as after a control-plane restart or failover.
  pods/s = (P - 1) / (first pod bound -> last pod bound); **time to first verdict** = extender
  launch -> first pod bound (the extender's and kube-scheduler's start included), and
  kube-scheduler's launch -> first pod bound (``first_bound_after_scheduler_s``): the guard's first
  call after its start is a *takeover* (guard/engine/prepare.py: answered inline, the backlog it listed
  queued for verification), the same path as the first call after ``--prepare-idle-after``.

Per case: extender CPU per pod (utime + stime of its process tree, from ``/readyz`` (backlog; the CPU
of its start to there, imports and first listings included, is ``start_cpu_s``) or the first create
(live) to the last pod bound), extender peak RSS (``VmHWM`` summed over gunicorn's
master and worker), and from every replica's ``/metrics`` the deltas of ``apiserver_request_total``
(by verb/resource/subresource) and ``apiserver_watch_events_total`` (pods) over the same window,
also per second of the window (the guard's listings are a rate, not a per-pod cost); the CPU of etcd
and the 3 apiservers and of kube-scheduler over the same window, per pod (backlog: kube-scheduler's
start included); and the guard's mean ``/filter`` time (its own histogram: parse to reply).

The pods of a case are deleted after it (``deletecollection``); the next case starts with none
pending. ``--budget-min`` stops the run before a case would start past it (the plan runs in order:
every cell once, then the extra rounds of ``--extra``); every case is appended to ``--json`` as it
ends, so a partial run is kept. ``--plot`` draws the PNGs from a JSON file without running anything.

Run from the repository root: ``python -m benchmarks.scale_sweep_real --kube-bin DIR --json FILE
[--nodes 100,1000,5000] [--pending 100,1000,10000] [--extra 5000x100,5000x10000,100x100,100x10000]
[--extra-rounds 2] [--budget-min 55] [-- GUARD FLAGS]``; then ``--plot FILE --out docs/``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from kubernetes.client.exceptions import ApiException

from benchmarks import filter_latency
from benchmarks.cpu_per_pod import tree_cpu, tree_usage
from benchmarks.cpu_per_pod_real import (BindWatch, bench_pod, control_plane_pids, guard_counts, loadavg, log_problems,
                                         scheduler_edit, size, warm)
from benchmarks.filter_latency import start_passthrough
from benchmarks.prepared_burst import start_guard
from guard.lab.harness import GuardProcess, child_pids, create, eventually, node_manifest, parse_metrics, stop_group
from guard.lab.real.controlplane import RealLab
from guard.lab.scheduler import ExtenderConfig

REPLICAS = 3
CREATE_REPLICA = 0
SCHEDULER_REPLICA = 1
CREATORS = 8
BOUND_NS = "bound"
EXTENDERS = ("guard", "pass-through")


# --- bulk writes: raw HTTPS POSTs, one kept-alive connection per thread ------------------------------


class Poster:
    """POSTs to one replica over a kept-alive connection (the lab's token and CA)."""

    def __init__(self, lab: RealLab, replica: int) -> None:
        self.host, self.port = f"127.0.0.{replica + 1}", lab.port
        self.ctx = ssl.create_default_context(cafile=lab.ca_path)
        self.headers = {"Authorization": f"Bearer {lab.token}", "Content-Type": "application/json",
                        "Accept": "application/json"}
        self.conn: http.client.HTTPSConnection | None = None

    def post(self, path: str, body: bytes) -> int:
        for attempt in range(3):
            if self.conn is None:
                self.conn = http.client.HTTPSConnection(self.host, self.port, context=self.ctx, timeout=60)
            try:
                self.conn.request("POST", path, body, self.headers)
                resp = self.conn.getresponse()
                resp.read()
                if resp.status in (429, 500, 503, 504) and attempt < 2:
                    time.sleep(0.2)
                    continue
                return resp.status
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        return 0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def post_pods(lab: RealLab, namespace: str, bodies: list[bytes], threads: int, replicas: list[int]) -> float:
    """POST every body as a pod of ``namespace`` from ``threads`` threads spread over ``replicas``;
    returns pods created per second. Raises if any create failed (other than 409: it exists)."""
    chunks = [bodies[i::threads] for i in range(threads)]
    bad: list[int] = []

    def run(i: int) -> None:
        p = Poster(lab, replicas[i % len(replicas)])
        try:
            for b in chunks[i]:
                status = p.post(f"/api/v1/namespaces/{namespace}/pods", b)
                if status not in (201, 409):
                    bad.append(status)
        finally:
            p.close()

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, range(threads)))
    if bad:
        raise RuntimeError(f"{len(bad)} pod creates in {namespace} failed: {sorted(set(bad))}")
    return len(bodies) / (time.perf_counter() - t)


def bound_pod(i: int) -> bytes:
    pod = bench_pod(f"b-{i:06d}")
    pod["spec"]["nodeName"] = f"gone-{i % 5000:04d}"
    return orjson.dumps(pod)


def pending_bodies(count: int) -> list[bytes]:
    return [orjson.dumps(bench_pod(f"p-{i:05d}")) for i in range(count)]


def fill_bound(lab: RealLab, count: int) -> float:
    lab.ensure_namespace(BOUND_NS, replica=0)
    return post_pods(lab, BOUND_NS, [bound_pod(i) for i in range(count)], 16, list(range(len(lab.replicas))))


def set_nodes(lab: RealLab, have: int, want: int) -> None:
    """Nodes node-0000 .. node-(want-1), adding or deleting from ``have``; waited for on every replica."""
    api = lab.core_v1(CREATE_REPLICA)

    def add(i: int) -> None:
        try:
            create(api, node_manifest(f"node-{i:04d}"))
        except ApiException as e:
            if e.status != 409:  # there already
                raise

    with ThreadPoolExecutor(8) as pool:
        if want > have:
            list(pool.map(add, range(have, want)))
        else:
            list(pool.map(lambda i: api.delete_node(f"node-{i:04d}", _request_timeout=30), range(want, have)))

    names = {f"node-{i:04d}" for i in range(max(have, want))}

    def ours(r: int) -> int:
        return sum(1 for n in lab.core_v1(r).list_node(_request_timeout=60).items if n.metadata.name in names)

    eventually(lambda: all(ours(r) == want for r in range(len(lab.replicas))), 120,
               what=f"{want} nodes on every replica", interval=0.5)


def delete_pods(lab: RealLab, namespace: str) -> None:
    api = lab.core_v1(CREATE_REPLICA)
    api.delete_collection_namespaced_pod(namespace, grace_period_seconds=0, _request_timeout=600)
    eventually(lambda: not api.list_namespaced_pod(namespace, limit=1, _request_timeout=60).items, 600,
               what=f"the pods of {namespace} deleted", interval=1.0)


# --- readings ------------------------------------------------------------------------------------------


def apiserver_counts(lab: RealLab) -> dict[str, float]:
    """Every replica's resource requests (``verb/resource[/subresource]``) and pod watch events, summed."""
    out: dict[str, float] = {}
    for r in lab.replicas:
        if not r.running:
            continue
        for (name, labels), value in parse_metrics(lab.metrics(r.index)).items():
            d = dict(labels)
            if name == "apiserver_request_total" and d.get("resource"):
                key = "/".join(x for x in (d.get("verb", ""), d["resource"], d.get("subresource", "")) if x)
            elif name == "apiserver_watch_events_total" and (d.get("resource") == "pods" or d.get("kind") == "Pod"):
                key = "watch-events/pods"
            else:
                continue
            out[key] = out.get(key, 0.0) + value
    return out


def scheduler_cpu(lab: RealLab) -> float:
    """kube-scheduler's CPU seconds so far (0.0 when it does not run)."""
    proc = lab.scheduler.proc if lab.scheduler else None
    return tree_cpu(proc.pid) if proc is not None else 0.0


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory (VmHWM) of ``pid`` and its children, summed, MiB."""
    total = 0
    for p in [pid, *child_pids(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def start_extender(lab: RealLab, which: str, tmp: str, n: int, guard_flags: list[str], settle: bool
                   ) -> tuple[Any, str, GuardProcess | None]:
    flags = ["--apiserver-replicas", ",".join(lab.urls), *guard_flags]
    if which == "pass-through":
        proc, url = start_passthrough()
        return proc, url, None
    if settle:
        g = start_guard(lab, tmp, n, flags)  # type: ignore[arg-type]
    else:
        g = filter_latency.start_guard(["--kubeconfig", lab.kubeconfig(CREATE_REPLICA), "--audit-db",
                                        f"{tmp}/{n}.db", *flags])
        g.wait("/readyz", timeout=120)
    return g.proc, g.base, g


def run_case(lab: RealLab, which: str, phase: str, nodes: int, pending: int, n: int, tmp: str,
             guard_flags: list[str], timeout: float) -> dict[str, Any]:
    namespace = f"c{n}"
    lab.ensure_namespace(namespace, replica=CREATE_REPLICA)
    res: dict[str, Any] = {"n": n, "extender": which, "phase": phase, "nodes": nodes, "pending": pending,
                           "load_start": loadavg(), "started": time.strftime("%H:%M:%S", time.gmtime())}
    watch = BindWatch(lab, namespace, pending)
    watch.start()
    if not watch.ready.wait(60) or watch.error:
        raise RuntimeError(f"the watch of {namespace} did not start: {watch.error!r}")
    bodies = pending_bodies(pending)
    cp = control_plane_pids(lab)  # etcd and the 3 apiservers
    sched0 = 0.0  # backlog: kube-scheduler starts inside the window, its start included
    proc = None
    guard = None
    sched_log = lab._path("kube-scheduler.log")
    try:
        if phase == "backlog":
            res["created_per_s"] = post_pods(lab, namespace, bodies, CREATORS, [CREATE_REPLICA])
            req0 = apiserver_counts(lab)
            cp0 = sum(tree_cpu(pid) for pid in cp)
            t_launch = time.perf_counter()
            w0 = time.monotonic()
            proc, url, guard = start_extender(lab, which, tmp, n, guard_flags, settle=False)
            res["ready_s"] = time.perf_counter() - t_launch
            use0 = tree_usage(proc.pid)  # from ready on; its start (imports, listings) reported apart
            res["start_cpu_s"] = use0[0] + use0[1]
        else:
            proc, url, guard = start_extender(lab, which, tmp, n, guard_flags, settle=True)
            warm(url)
        g0 = guard_counts(url) if guard else {}
        guard_log0 = size(guard.log.name) if guard else 0
        sched_log0 = size(sched_log)
        extender = ExtenderConfig(url_prefix=url, filter_verb="filter", preempt_verb="preempt",
                                  node_cache_capable=True, http_timeout=5.0)
        if phase == "live":
            lab.start_scheduler(extender, replica=SCHEDULER_REPLICA, edit=scheduler_edit, timeout=120)
            req0 = apiserver_counts(lab)
            cp0 = sum(tree_cpu(pid) for pid in cp)
            sched0 = scheduler_cpu(lab)
            use0 = tree_usage(proc.pid)
            w0 = time.monotonic()
            t0 = time.perf_counter()
            res["created_per_s"] = post_pods(lab, namespace, bodies, CREATORS, [CREATE_REPLICA])
        else:
            t_sched = time.perf_counter()
            lab.start_scheduler(extender, replica=SCHEDULER_REPLICA, edit=scheduler_edit, timeout=120)
        if not watch.done.wait(timeout) or watch.error or len(watch.bound) < pending:
            raise RuntimeError(f"{which} {phase}: {len(watch.bound)} of {pending} pods bound after {timeout}s "
                               f"({watch.error!r})\n{lab.scheduler.tail() if lab.scheduler else ''}")
        use1 = tree_usage(proc.pid)
        req1 = apiserver_counts(lab)
        cp1 = sum(tree_cpu(pid) for pid in cp)
        sched1 = scheduler_cpu(lab)
        window = time.monotonic() - w0
        res["load_end"] = loadavg()
        res["peak_rss_mib"] = peak_rss_mib(proc.pid)
        res["bench_watch_restarts"] = watch.restarts  # its LISTs/WATCHes are in the requests, both servers alike
        times = sorted(watch.bound.values())
        if phase == "live":
            res["pods_per_s"] = pending / (times[-1] - t0)
        else:
            res["pods_per_s"] = (pending - 1) / max(1e-6, times[-1] - times[0])
            res["first_verdict_s"] = times[0] - t_launch
            res["first_bound_after_scheduler_s"] = times[0] - t_sched
        user, system, _ = (b - a for a, b in zip(use0, use1))
        res["cpu_ms_per_pod"] = (user + system) * 1000 / pending
        # The rest of the 2 cores' work over the same window: etcd and the apiservers, and kube-scheduler
        # (backlog: its start included). Where the guard's extra quorum GET per pod costs, if anywhere.
        res["control_plane_cpu_ms_per_pod"] = (cp1 - cp0) * 1000 / pending
        res["scheduler_cpu_ms_per_pod"] = (sched1 - sched0) * 1000 / pending
        res["window_s"] = window
        delta = {k: v - req0.get(k, 0.0) for k, v in req1.items() if v - req0.get(k, 0.0) > 0}
        res["requests"] = {k: int(v) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])}
        res["requests_per_pod"] = sum(v for k, v in delta.items() if not k.startswith("watch-events")) / pending
        res["watch_events_per_pod"] = delta.get("watch-events/pods", 0.0) / pending
        res["pod_gets_per_pod"] = delta.get("GET/pods", 0.0) / pending
        res["pod_lists_per_s"] = delta.get("LIST/pods", 0.0) / window
        res["pod_watches_per_s"] = delta.get("WATCH/pods", 0.0) / window
        if guard:
            g1 = guard_counts(url)
            res["guard"] = {k: int(g1[k] - g0[k]) for k in g1 if k != "filter_seconds"}
            # What kube-scheduler waited for the guard's /filter answers, in the guard (parse to reply).
            calls = g1["filter_calls"] - g0["filter_calls"]
            res["filter_ms_mean"] = (g1["filter_seconds"] - g0["filter_seconds"]) * 1000 / calls if calls else float("nan")
            res["guard_log_problems"], res["guard_log_sample"] = log_problems(guard.log.name, guard_log0, klog=False)
        res["scheduler_log_errors"], res["scheduler_log_sample"] = log_problems(sched_log, sched_log0, klog=True)
    finally:
        watch.stopping = True
        lab.stop_scheduler()
        if proc is not None:
            stop_group(proc)
    delete_pods(lab, namespace)
    return res


# --- the plan, the table, the plots --------------------------------------------------------------------


def plan(node_counts: list[int], pendings: list[int], extra: list[tuple[int, int]], extra_rounds: int,
         phases: list[str]) -> list[tuple[int, int, int, str, str]]:
    """(nodes, pending, round, phase, extender) in run order: every cell once (nodes ascending), then
    ``extra_rounds`` more of each ``extra`` cell (in the order given)."""
    out = []
    for nodes in node_counts:
        for p in pendings:
            out += [(nodes, p, 0, ph, w) for ph in phases for w in EXTENDERS]
    for nodes, p in extra:
        for r in range(1, extra_rounds + 1):
            out += [(nodes, p, r, ph, w) for ph in phases for w in EXTENDERS]
    return out


def med(rs: list[dict[str, Any]], k: str) -> float:
    vals = [r[k] for r in rs if k in r]
    return statistics.median(vals) if vals else float("nan")


def cells(results: list[dict[str, Any]]) -> dict[tuple[int, int, str], dict[str, list[dict[str, Any]]]]:
    out: dict[tuple[int, int, str], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        out.setdefault((r["nodes"], r["pending"], r["phase"]), {w: [] for w in EXTENDERS})[r["extender"]].append(r)
    return out


def table(results: list[dict[str, Any]]) -> str:
    rows = ["| nodes | pending | phase | rounds | guard pods/s | pass-through pods/s | ratio per round (median) "
            "| CPU ms/pod guard / pass-through | guard peak RSS MiB | requests/pod guard / pass-through "
            "| pod GETs/pod (guard) | pod LISTs/s guard / pass-through | pod watch events/pod guard / pass-through "
            "| first verdict s guard / pass-through (from kube-scheduler's launch) "
            "| control-plane CPU ms/pod guard / pass-through | kube-scheduler CPU ms/pod guard / pass-through "
            "| guard /filter mean ms | load (1 min) at starts |",
            "|---:|---:|---|---:|---:|---:|---|---|---:|---|---:|---|---|---|---|---|---:|---|"]
    for (nodes, pending, phase), agg in sorted(cells(results).items()):
        g, p = agg["guard"], agg["pass-through"]
        pairs = list(zip(g, p))
        ratios = [a["pods_per_s"] / b["pods_per_s"] for a, b in pairs]
        ratio = ", ".join(f"{x:.2f}" for x in ratios) + (f" (**{statistics.median(ratios):.2f}**)" if ratios else "")
        fv = "-"
        if phase == "backlog":
            fv = f"{med(g, 'first_verdict_s'):.1f} / {med(p, 'first_verdict_s'):.1f}"
            if any("first_bound_after_scheduler_s" in r for r in g + p):
                fv += (f" ({med(g, 'first_bound_after_scheduler_s'):.1f} / "
                       f"{med(p, 'first_bound_after_scheduler_s'):.1f})")
        loads = ", ".join(r["load_start"].split()[0] for r in sorted(g + p, key=lambda r: r["n"]))
        rows.append(f"| {nodes} | {pending} | {phase} | {len(pairs)} | {med(g, 'pods_per_s'):.0f} | "
                    f"{med(p, 'pods_per_s'):.0f} | {ratio} | {med(g, 'cpu_ms_per_pod'):.2f} / "
                    f"{med(p, 'cpu_ms_per_pod'):.2f} | {med(g, 'peak_rss_mib'):.0f} | "
                    f"{med(g, 'requests_per_pod'):.2f} / {med(p, 'requests_per_pod'):.2f} | "
                    f"{med(g, 'pod_gets_per_pod'):.2f} | {med(g, 'pod_lists_per_s'):.2f} / "
                    f"{med(p, 'pod_lists_per_s'):.2f} | {med(g, 'watch_events_per_pod'):.1f} / "
                    f"{med(p, 'watch_events_per_pod'):.1f} | {fv} | "
                    f"{med(g, 'control_plane_cpu_ms_per_pod'):.2f} / {med(p, 'control_plane_cpu_ms_per_pod'):.2f} | "
                    f"{med(g, 'scheduler_cpu_ms_per_pod'):.2f} / {med(p, 'scheduler_cpu_ms_per_pod'):.2f} | "
                    f"{med(g, 'filter_ms_mean'):.3f} | {loads} |")
    return "\n".join(rows)


def plot(results: list[dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per measure: a line per node count (and extender) against pending pods, log x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = cells(results)
    node_counts = sorted({k[0] for k in agg})
    out.mkdir(parents=True, exist_ok=True)
    measures = [("pods_per_s", "pods/s", "scale_sweep_pods_per_s.png"),
                ("cpu_ms_per_pod", "extender CPU ms per scheduled pod", "scale_sweep_cpu_per_pod.png"),
                ("peak_rss_mib", "extender peak RSS (MiB)", "scale_sweep_rss.png"),
                ("requests_per_pod", "apiserver requests per pod (3 replicas)", "scale_sweep_requests_per_pod.png")]
    written = []
    for key, label, name in measures:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, phase in zip(axes, ("live", "backlog")):
            for i, nodes in enumerate(node_counts):
                for w, style in (("guard", "-o"), ("pass-through", "--s")):
                    pts = sorted((k[1], med(v[w], key)) for k, v in agg.items()
                                 if k[0] == nodes and k[2] == phase and v[w])
                    if pts:
                        ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=f"C{i}",
                                label=f"{w}, {nodes} nodes")
            ax.set_xscale("log")
            ax.set_xlabel("pending pods")
            ax.set_title(phase if phase == "live" else "backlog (takeover)")
            ax.grid(True, alpha=0.3)
        axes[0].set_ylabel(label)
        axes[1].legend(fontsize=7)
        fig.suptitle(f"{label}: guard vs pass-through, real kube-scheduler v1.36.2, 3 apiservers (median of rounds)",
                     fontsize=9)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kube-bin", metavar="DIR")
    ap.add_argument("--nodes", default="100,1000,5000")
    ap.add_argument("--pending", default="100,1000,10000")
    ap.add_argument("--cells", default="", help="NODESxPENDING,... to run once each in this order, instead of "
                    "--nodes x --pending (nodes are added or deleted between cells)")
    ap.add_argument("--bound", type=int, default=30000, help="bound pods in the cluster before the first case")
    ap.add_argument("--extra", default="5000x100,5000x10000,100x100,100x10000",
                    help="NODESxPENDING cells given --extra-rounds more rounds after every cell ran once")
    ap.add_argument("--extra-rounds", type=int, default=2)
    ap.add_argument("--phases", default="live,backlog")
    ap.add_argument("--budget-min", type=float, default=55.0, help="no case starts after this many minutes")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for a case's pods to be bound")
    ap.add_argument("--json", metavar="FILE", help="every case appended as it ends (and read by --plot)")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNGs and print the table of these JSON files "
                    "(comma-separated: the cases of several runs together)")
    ap.add_argument("--out", default="docs", help="where --plot writes the PNGs")
    ap.add_argument("guard_flags", nargs="*", help="extra flags for ghost-guard serve (after --)")
    args = ap.parse_args()
    if args.plot:
        cases = [c for f in args.plot.split(",") for c in json.loads(Path(f).read_text())["cases"]]
        for path in plot(cases, Path(args.out)):
            print(f"wrote {path}", file=sys.stderr)
        print(table(cases))
        return 0
    node_counts = [int(x) for x in args.nodes.split(",")]
    pendings = [int(x) for x in args.pending.split(",")]
    extra = [tuple(int(v) for v in c.split("x")) for c in args.extra.split(",") if c]
    phases = [p.strip() for p in args.phases.split(",")]
    todo = plan(node_counts, pendings, extra, args.extra_rounds, phases)  # type: ignore[arg-type]
    if args.cells:
        todo = []
        for c in args.cells.split(","):
            nodes, p = (int(v) for v in c.split("x"))
            todo += [(nodes, p, 0, ph, w) for ph in phases for w in EXTENDERS]
        todo += plan([], [], extra, args.extra_rounds, phases)
    began = time.monotonic()
    doc: dict[str, Any] = {"machine": filter_latency.machine(), "load_at_start": loadavg(), "plan": todo,
                           "cases": [], "skipped": [], "bound": args.bound, "replicas": REPLICAS}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        lab = RealLab(replicas=REPLICAS, kube_bin=args.kube_bin, proxies=False, out_dir=f"{tmp}/lab",
                      apiserver_args=["--delete-collection-workers=8"])
        try:
            lab.start()
            t = time.perf_counter()
            doc["bound_created_per_s"] = fill_bound(lab, args.bound) if args.bound else 0.0
            doc["bound_fill_s"] = time.perf_counter() - t
            print(f"{args.bound} bound pods in {doc['bound_fill_s']:.0f}s", file=sys.stderr, flush=True)
            save()
            have = 0
            for i, (nodes, pending, rnd, phase, which) in enumerate(todo):
                if (time.monotonic() - began) / 60 > args.budget_min and which == EXTENDERS[0]:
                    doc["skipped"] = todo[i:]
                    break
                if nodes != have:
                    set_nodes(lab, have, nodes)
                    have = nodes
                res = run_case(lab, which, phase, nodes, pending, i + 1, tmp, args.guard_flags, args.timeout)
                res["round"] = rnd
                doc["cases"].append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "requests"}), file=sys.stderr, flush=True)
                save()
            doc["minutes"] = (time.monotonic() - began) / 60
            doc["load_at_end"] = loadavg()
            save()
        finally:
            lab.close()
    print(f"{doc['machine']}; {REPLICAS} kube-apiserver replicas; {args.bound} bound pods; "
          f"{doc.get('minutes', 0):.0f} min; load {doc['load_at_start']} -> {doc.get('load_at_end')}\n")
    print(table(doc["cases"]))
    if doc["skipped"]:
        print(f"\nnot run (budget): {len(doc['skipped'])} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
