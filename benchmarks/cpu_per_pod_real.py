"""The guard on a real kube-scheduler: pods/s and CPU per scheduled pod, beside the pass-through extender.

``benchmarks/cpu_per_pod.py`` measures the guard against a Python client playing kube-scheduler on the
Python lab; this one runs the real thing (issue 24 item 6): :class:`guard.lab.real.controlplane.RealLab`
with real etcd, 2 real kube-apiserver replicas (127.0.0.1 and 127.0.0.2; no etcd fault proxy: nothing
is faulted, and the proxy would put a Python process in every etcd call) and the **real kube-scheduler**
(on replica 2) started with the product's ``KubeSchedulerConfiguration`` (``render_scheduler_config``)
with the extender under test registered, changed only where a benchmark must:

- ``clientConnection.qps``/``burst`` 1000 (default 50/100), so the scheduler's client is not the limit
  (set in the configuration: with ``--config``, kube-scheduler ignores ``--kube-api-qps``);
- the extender over plain HTTP for both extenders alike (``--insecure-http``; the shipped mTLS would add
  the same record encryption to both over kept-alive connections);
- ``ignorable: false``: an extender error fails that scheduling attempt instead of being skipped, so
  "every pod bound" means every pod went through a successful ``/filter`` call of the extender measured.

Extenders, alternating in each cell (guard, pass-through, guard, ...): the guard
(``ghost-guard serve --kubeconfig`` replica 1 ``--apiserver-replicas`` both, quiet, as in
cpu_per_pod.py, waited for until its startup verification settled) and the minimal pass-through
(``benchmarks/passthrough_extender.py``: Flask under gunicorn gthread, 1 worker, 16 threads). Each
gets one ``/filter`` call for a pod that does not exist before its case, so the guard is "the one being
asked" (``--prepare-idle-after``) as the guard of a running scheduler is. Only one extender runs at a time.

Nodes: fake Nodes (``harness.node_manifest``: Ready, 4 CPU, 8Gi, 110 pods; the
``node.kubernetes.io/not-ready`` taint that admission adds is removed by ``harness.create``; no kubelet).
Pods: one container, requests 10m CPU / 16Mi, ``automountServiceAccountToken: false`` (no kubelet,
no controller-manager: the namespace's ``default`` ServiceAccount is created by ``ensure_namespace``).

Phases:

- **live**: kube-scheduler runs; N pods are created by 4 threads on replica 1. pods/s = N / (first
  create -> last pod seen bound).
- **backlog**: the N pods are created while *no kube-scheduler runs* (as after a scheduler restart or
  failover; the extender is up and reachable, so nothing is skipped or errors), then kube-scheduler is
  started. pods/s = (N - 1) / (first pod bound -> last pod bound), which leaves out kube-scheduler's
  start (1-2 s idle, more under load; also reported: from its launch, ``release_pods_per_s``).

"Bound" is seen on a watch of the case's namespace on replica 1 (``spec.nodeName`` set). Per case:

- **extender CPU per scheduled pod**: utime + stime of the extender's process tree (``/proc``; gunicorn
  master and worker) from before the first pod is created (backlog: the guard verifies pods as they land)
  to the last pod bound, divided by N;
- **apiserver requests per pod**: ``apiserver_request_total`` of both replicas over the same window,
  summed (resource requests only), in all and by kind: pod GETs (the guard's quorum GETs: nothing else
  GETs pods here), pod LISTs, creates and bindings. The difference between the two extenders' rows is the
  guard's load on the control plane;
- **control-plane CPU per pod**: etcd and both apiservers over the window, and kube-scheduler over its
  whole life (start included);
- the guard's answers: prepared (verified before the call), shared read (waited on a GET in flight),
  inline (a GET of its own), its ``/filter`` calls, fail-open count, and the warning/error lines in its
  log; kube-scheduler's error lines (klog ``E...``) in the case;
- the 1-minute load average (``/proc/loadavg``) at the case's start and end.

Run from the repository root (binaries: ``--kube-bin DIR``, ``$GHOST_GUARD_KUBE_BIN``, ``$KUBEBUILDER_ASSETS``):
``python -m benchmarks.cpu_per_pod_real [--kube-bin DIR] [--pods 500] [--nodes 100,1000] [--rounds 2]
[--phases live,backlog] [--json FILE] [--baseline TREE] [--floor] [-- GUARD FLAGS]``; ``--baseline`` adds a third
extender, the guard of another source tree (``guard-baseline``), after the guard in each round: before and after a
change in one run; ``--floor`` adds ``floor`` (``passthrough_extender.floor_app``: the pass-through plus one quorum
GET of each pending pod ahead of the call, what the guard's guarantee costs any extender). Prints one JSON line per
case on stderr and a
Markdown table (means of the rounds; the pods/s ratio also as each round's guard / pass-through pair).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import requests

from benchmarks import filter_latency
from benchmarks.cpu_per_pod import tree_cpu, tree_usage
from benchmarks.filter_latency import pin_harness, start_passthrough
from benchmarks.prepared_burst import metric, start_guard
from guard.lab.harness import GuardProcess, child_pids, create, eventually, node_manifest, parse_metrics, stop_group
from guard.lab.real.controlplane import RealLab
from guard.lab.scheduler import ExtenderConfig

CREATE_REPLICA = 0  # pods created and watched here; the guard's kubeconfig
SCHEDULER_REPLICA = 1  # kube-scheduler's informers and bindings
CREATORS = 4
QPS = 1000


def bench_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"automountServiceAccountToken": False,
                     "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}]}}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class BindWatch(threading.Thread):
    """A watch of one namespace's pods on one replica: when each pod was first seen with ``spec.nodeName``.

    It resumes as an informer does: a watch that ends before every pod is seen bound (kube-apiserver closes
    a watcher that falls behind, "Forcing watcher close due to unresponsiveness", which a loaded machine
    hits at 1,000 pods: the case then waited for its timeout) is opened again from the last resourceVersion
    it delivered; one that is too old (410 Gone) is re-listed, the pods the list shows bound counted at the
    list. ``restarts`` counts both (in the case's results)."""

    def __init__(self, lab: RealLab, namespace: str, expect: int) -> None:
        super().__init__(daemon=True)
        from kubernetes import client, config

        # its own client: a watch cut short must not go back to the pool the creators use
        self.client = config.new_client_from_config(config_file=lab.kubeconfig(CREATE_REPLICA))
        self.api = client.CoreV1Api(self.client)
        self.namespace = namespace
        self.expect = expect
        self.bound: dict[str, float] = {}
        self.ready = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.stopping = False
        self.restarts = 0

    def _seen(self, obj: dict) -> None:
        name = obj.get("metadata", {}).get("name")
        if obj.get("spec", {}).get("nodeName") and name not in self.bound:
            self.bound[name] = time.perf_counter()
            if len(self.bound) >= self.expect:
                self.done.set()

    def _list(self) -> str:
        lst = self.api.list_namespaced_pod(self.namespace, _preload_content=False, _request_timeout=30)
        doc = orjson.loads(lst.data)
        for item in doc.get("items") or []:
            self._seen(item)
        return doc["metadata"]["resourceVersion"]

    def _watch(self, rv: str) -> str | None:
        """One watch from ``rv`` to its end: the last resourceVersion delivered, or None when it expired (410)."""
        resp = self.api.list_namespaced_pod(self.namespace, resource_version=rv, watch=True, timeout_seconds=900,
                                            allow_watch_bookmarks=True, _preload_content=False)
        try:
            self.ready.set()
            buf = b""
            for chunk in resp.stream(65536):
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    event = orjson.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        if obj.get("code") == 410:
                            return None
                        raise RuntimeError(f"watch error event: {obj}")
                    rv = obj.get("metadata", {}).get("resourceVersion") or rv
                    if event.get("type") != "BOOKMARK":
                        self._seen(obj)
                if self.stopping or self.done.is_set():
                    break
            return rv
        finally:
            resp.close()  # never back to a pool with the stream unread

    def run(self) -> None:
        try:
            rv: str | None = self._list()
            while not (self.stopping or self.done.is_set()):
                if rv is None:  # expired: list again
                    self.restarts += 1
                    rv = self._list()
                    continue
                rv = self._watch(rv)
                if not (self.stopping or self.done.is_set()):
                    self.restarts += 1
        except BaseException as e:  # noqa: BLE001 - reported by the case
            if not self.stopping:
                self.error = e
            self.ready.set()
            self.done.set()
        finally:
            self.client.close()


def add_nodes(lab: RealLab, first: int, last: int) -> None:
    api = lab.core_v1(CREATE_REPLICA)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: create(api, node_manifest(f"node-{i:04d}")), range(first, last)))


def create_pods(lab: RealLab, namespace: str, pods: int) -> float:
    """Create the case's pods from ``CREATORS`` threads; returns pods created per second."""
    api = lab.core_v1(CREATE_REPLICA)

    def one(i: int) -> None:
        resp = api.create_namespaced_pod(namespace, bench_pod(f"p-{i:04d}"), _preload_content=False,
                                         _request_timeout=30)
        resp.drain_conn()  # the reply read to its end before the connection goes back to the pool
        resp.release_conn()

    t = time.perf_counter()
    with ThreadPoolExecutor(CREATORS) as pool:
        list(pool.map(one, range(pods)))
    return pods / (time.perf_counter() - t)


def delete_pods(lab: RealLab, namespace: str) -> None:
    api = lab.core_v1(CREATE_REPLICA)
    api.delete_collection_namespaced_pod(namespace, grace_period_seconds=0, _request_timeout=120)
    eventually(lambda: not api.list_namespaced_pod(namespace, _request_timeout=30).items, 120,
               what=f"the pods of {namespace} deleted")


def request_counts(lab: RealLab) -> dict[tuple[str, str, str], float]:
    """``apiserver_request_total`` summed over the running replicas by (verb, resource, subresource),
    resource requests only (not /metrics, /readyz...)."""
    out: dict[tuple[str, str, str], float] = {}
    for r in lab.replicas:
        if not r.running:
            continue
        for (name, labels), value in parse_metrics(lab.metrics(r.index)).items():
            if name != "apiserver_request_total":
                continue
            d = dict(labels)
            if not d.get("resource"):
                continue
            key = (d.get("verb", ""), d["resource"], d.get("subresource", ""))
            out[key] = out.get(key, 0.0) + value
    return out


def control_plane_pids(lab: RealLab) -> list[int]:
    etcd = getattr(lab.etcd, "_proc", None)
    pids = [r.pid for r in lab.replicas if r.pid is not None]
    return pids + ([etcd.pid] if etcd is not None else [])


def scheduler_edit(cfg: dict[str, Any]) -> None:
    conn = cfg.setdefault("clientConnection", {})
    conn["qps"] = QPS
    conn["burst"] = QPS
    for entry in cfg.get("extenders", []):
        entry["ignorable"] = False


def guard_counts(url: str) -> dict[str, float]:
    names = {"prepared": "ghost_guard_verdicts_prepared_total", "shared_read": "ghost_guard_verdicts_shared_read_total",
             "inline": "ghost_guard_verdicts_inline_total", "fail_open": "ghost_guard_fail_open_total"}
    text = requests.get(url + "/metrics", timeout=10).text
    samples = parse_metrics(text)
    out = {k: sum(v for (n, _), v in samples.items() if n == name) for k, name in names.items()}
    out["filter_calls"] = sum(v for (n, labels), v in samples.items()
                              if n == "ghost_guard_requests_total" and dict(labels).get("endpoint") == "/filter")
    out["filter_seconds"] = sum(v for (n, labels), v in samples.items()
                                if n == "ghost_guard_request_duration_seconds_sum"
                                and dict(labels).get("endpoint") == "/filter")
    return out


def warm(url: str, *, timeout: float = 60.0) -> None:
    """One /filter call for a pod that does not exist: the guard is the one being asked from now on.

    That pod is a ghost, and a new ghost's follow-up runs off the request path: etcd read again (a second
    quorum GET), then every replica's cache probed. Returns once the probes are in ``/readyz`` (each
    replica's ``last_probe``), so that the GET is not counted in the case's window: it was, once in a while
    (6 pod GETs for 5 pods in the real tier's bench case, 1,001 for 1,000 in the scale sweep). The guard of
    a case is new, so any probe is this one's. A pass-through answers /readyz 404: nothing to wait for."""
    requests.post(url + "/filter", timeout=10, headers={"Content-Type": "application/json"},
                  data=orjson.dumps({"Pod": {"metadata": {"name": "warm-up", "namespace": "default", "uid": "warm"}},
                                     "Nodes": None, "NodeNames": ["node-0000"]})).raise_for_status()

    def probed() -> bool:
        resp = requests.get(url + "/readyz", timeout=10)
        if resp.status_code == 404:
            return True
        replicas = (resp.json().get("details") or {}).get("replicas") or {}
        return bool(replicas) and all((r or {}).get("last_probe") for r in replicas.values())

    eventually(probed, timeout, what="the warm-up ghost's follow-up (its second quorum GET and replica probes)")


def log_problems(path: str, offset: int, klog: bool) -> tuple[int, list[str]]:
    """Warning/error lines written to ``path`` after ``offset`` (klog: lines starting with ``E``)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0, []
    if klog:  # "E1202 05:06:55.143234   17730 options.go:205] message": the message, once per kind
        bad = [line.split("] ", 1)[-1] for line in lines if line.startswith("E")]
    else:
        bad = [line for line in lines if any(w in line for w in ("WARNING", "ERROR", "CRITICAL", "Traceback"))]
    return len(bad), list(dict.fromkeys(bad))[:3]


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its children (gunicorn's master and worker), MiB."""
    total = 0
    for p in [pid, *child_pids(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def run_case(lab: RealLab, which: str, phase: str, pods: int, n: int, tmp: str, guard_flags: list[str],
             timeout: float, baseline: str | None = None) -> dict[str, Any]:
    namespace = f"{phase}-{n}"
    lab.ensure_namespace(namespace, replica=CREATE_REPLICA)
    guard: GuardProcess | None = None
    if which in ("guard", "guard-baseline"):
        guard = start_guard(lab, tmp, n, ["--apiserver-replicas", ",".join(lab.urls), *guard_flags],  # type: ignore[arg-type]
                            tree=baseline if which == "guard-baseline" else None)
        proc, url = guard.proc, guard.base
    elif which == "floor":
        proc, url = start_passthrough("benchmarks.passthrough_extender:floor_app", env={
            "FLOOR_APISERVER": lab.urls[CREATE_REPLICA], "FLOOR_CA": lab.ca_path, "FLOOR_TOKEN": lab.token})
    else:
        proc, url = start_passthrough()
    sched_log = lab._path("kube-scheduler.log")
    res: dict[str, Any] = {"extender": which, "phase": phase, "nodes": None, "pods": pods}
    watch = BindWatch(lab, namespace, pods)
    try:
        watch.start()
        if not watch.ready.wait(30) or watch.error:
            raise RuntimeError(f"the watch of {namespace} did not start: {watch.error!r}")
        warm(url)
        g0 = guard_counts(url) if guard else {}
        guard_log0 = size(guard.log.name) if guard else 0
        sched_log0 = size(sched_log)
        res["load_start"] = loadavg()
        req0 = request_counts(lab)
        cp = control_plane_pids(lab)
        cp0 = sum(tree_cpu(p) for p in cp)
        use0 = tree_usage(proc.pid)
        extender = ExtenderConfig(url_prefix=url, filter_verb="filter", preempt_verb="preempt",
                                  node_cache_capable=True, http_timeout=5.0)

        def start_scheduler() -> None:
            lab.start_scheduler(extender, replica=SCHEDULER_REPLICA, edit=scheduler_edit, timeout=120)

        if phase == "live":
            start_scheduler()
            t0 = time.perf_counter()
            res["created_per_s"] = create_pods(lab, namespace, pods)
        else:
            res["created_per_s"] = create_pods(lab, namespace, pods)
            t0 = time.perf_counter()
            start_scheduler()
        if not watch.done.wait(timeout) or watch.error or len(watch.bound) < pods:
            raise RuntimeError(f"{which} {phase}: {len(watch.bound)} of {pods} pods bound after {timeout}s "
                               f"({watch.error!r})\n{lab.scheduler.tail() if lab.scheduler else ''}")
        if which == "floor":  # its GETs gate nothing: the window ends once it made them all, so they are counted
            eventually(lambda: requests.get(url + "/floor", timeout=10).json()["gets"] >= pods, 120,
                       what="the floor's GET of every pod")
        use1 = tree_usage(proc.pid)
        cp1 = sum(tree_cpu(p) for p in cp)
        sched_cpu = tree_cpu(lab.scheduler.proc.pid) if lab.scheduler and lab.scheduler.proc else float("nan")
        req1 = request_counts(lab)
        res["load_end"] = loadavg()
        res["extender_rss_mib"] = rss_mib(proc.pid)
        res["bench_watch_restarts"] = watch.restarts  # its LISTs/WATCHes are in the requests, both servers alike
        times = sorted(watch.bound.values())
        user, system, switches = (b - a for a, b in zip(use0, use1))
        if phase == "live":
            res["pods_per_s"] = pods / (times[-1] - t0)
        else:
            res["pods_per_s"] = (pods - 1) / max(1e-6, times[-1] - times[0])
        res["release_pods_per_s"] = pods / (times[-1] - t0)
        res["cpu_ms_per_pod"] = (user + system) * 1000 / pods
        res["user_ms_per_pod"] = user * 1000 / pods
        res["sys_ms_per_pod"] = system * 1000 / pods
        res["switches_per_pod"] = switches / pods
        res["control_plane_cpu_ms_per_pod"] = (cp1 - cp0) * 1000 / pods
        res["scheduler_cpu_ms_per_pod"] = sched_cpu * 1000 / pods
        delta = {k: v - req0.get(k, 0.0) for k, v in req1.items() if v - req0.get(k, 0.0) > 0}
        res["requests_per_pod"] = sum(delta.values()) / pods
        res["pod_gets_per_pod"] = delta.get(("GET", "pods", ""), 0.0) / pods
        res["pod_lists_per_pod"] = delta.get(("LIST", "pods", ""), 0.0) / pods
        res["requests"] = {"/".join(x for x in k if x): int(v) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])}
        if which == "floor":
            res["floor"] = requests.get(url + "/floor", timeout=10).json()
        if guard:
            g1 = guard_counts(url)
            res["guard"] = {k: int(g1[k] - g0[k]) for k in g1 if k != "filter_seconds"}
            answered = sum(res["guard"][k] for k in ("prepared", "shared_read", "inline"))
            res["prepared_share"] = res["guard"]["prepared"] / answered if answered else float("nan")
            res["guard_log_problems"], res["guard_log_sample"] = log_problems(guard.log.name, guard_log0, klog=False)
        res["scheduler_log_errors"], res["scheduler_log_sample"] = log_problems(sched_log, sched_log0, klog=True)
    finally:
        watch.stopping = True
        lab.stop_scheduler()
        stop_group(proc)
    delete_pods(lab, namespace)
    return res


def mean(rs: list[dict[str, Any]], k: str) -> float:
    vals = [r[k] for r in rs if k in r]
    return statistics.mean(vals) if vals else float("nan")


def table(rows: list[tuple[int, str, dict[str, list[dict[str, Any]]]]]) -> str:
    out = ["| nodes | phase | guard pods/s | pass-through pods/s | ratio per round (median) "
           "| extender CPU ms/pod, guard / pass-through | apiserver requests/pod, guard / pass-through "
           "| pod GETs/pod, guard / pass-through | prepared share | control plane CPU ms/pod, guard / pass-through "
           "| pods created/s, guard / pass-through | load (1 min) at the cases' starts |",
           "|---:|---|---:|---:|---|---|---|---|---:|---|---|---|"]
    for nodes, phase, agg in rows:
        g, p = agg["guard"], agg["pass-through"]
        ratios = [a["pods_per_s"] / b["pods_per_s"] for a, b in zip(g, p)]
        ratio = ", ".join(f"{r:.2f}" for r in ratios) + (f" ({statistics.median(ratios):.2f})" if ratios else "")
        f = agg.get("floor") or []
        if f:
            fr = [a["pods_per_s"] / b["pods_per_s"] for a, b in zip(f, p)]
            ratio += " / floor " + ", ".join(f"{r:.2f}" for r in fr) + f" ({statistics.median(fr):.2f})"
            ratio += f", floor CPU {mean(f, 'cpu_ms_per_pod'):.2f} ms/pod"
        loads = ", ".join(r["load_start"].split()[0] for r in sorted(g + p, key=lambda r: r["n"]))
        out.append(f"| {nodes} | {phase} | {mean(g, 'pods_per_s'):.0f} | {mean(p, 'pods_per_s'):.0f} | {ratio} "
                   f"| {mean(g, 'cpu_ms_per_pod'):.2f} / {mean(p, 'cpu_ms_per_pod'):.2f} "
                   f"| {mean(g, 'requests_per_pod'):.2f} / {mean(p, 'requests_per_pod'):.2f} "
                   f"| {mean(g, 'pod_gets_per_pod'):.2f} / {mean(p, 'pod_gets_per_pod'):.2f} "
                   f"| {mean(g, 'prepared_share'):.0%} "
                   f"| {mean(g, 'control_plane_cpu_ms_per_pod'):.1f} / {mean(p, 'control_plane_cpu_ms_per_pod'):.1f} "
                   f"| {mean(g, 'created_per_s'):.0f} / {mean(p, 'created_per_s'):.0f} | {loads} |")
    return "\n".join(out)


def cases_table(results: list[dict[str, Any]]) -> str:
    """One row per case, in the order they ran."""
    out = ["| # | nodes | phase | extender | pods/s | created/s | extender CPU ms/pod (user+sys) | extender RSS MiB "
           "| requests/pod | pod GETs/pod | prepared / shared read / inline | control plane CPU ms/pod "
           "| kube-scheduler CPU ms/pod | load (1 min) start / end |",
           "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in results:
        g = r.get("guard")
        answers = f"{g['prepared']} / {g['shared_read']} / {g['inline']}" if g else "-"
        out.append(f"| {r['n']} | {r['nodes']} | {r['phase']} | {r['extender']} | {r['pods_per_s']:.0f} "
                   f"| {r['created_per_s']:.0f} | {r['cpu_ms_per_pod']:.2f} | {r['extender_rss_mib']:.0f} "
                   f"| {r['requests_per_pod']:.2f} | {r['pod_gets_per_pod']:.2f} | {answers} "
                   f"| {r['control_plane_cpu_ms_per_pod']:.1f} | {r['scheduler_cpu_ms_per_pod']:.1f} "
                   f"| {r['load_start'].split()[0]} / {r['load_end'].split()[0]} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kube-bin", metavar="DIR", help="kube-apiserver and kube-scheduler (default: "
                    "$GHOST_GUARD_KUBE_BIN, $KUBEBUILDER_ASSETS)")
    ap.add_argument("--pods", type=int, default=500, help="pods per case")
    ap.add_argument("--nodes", default="100,1000", help="node counts (comma-separated, ascending: nodes are added)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of guard and pass-through per cell")
    ap.add_argument("--phases", default="live,backlog", help="live, backlog (comma-separated)")
    ap.add_argument("--pin", action="store_true", help="give the extender the last CPU, and the control plane and "
                    "this harness the others (default: no pinning, everyone shares every core)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for a case's pods to be bound")
    ap.add_argument("--json", metavar="FILE", help="also write every case's result to FILE")
    ap.add_argument("--baseline", metavar="TREE", help="also run the guard of another source tree (e.g. "
                    "`git archive main | tar -x -C TREE`) as a third extender, `guard-baseline`, after the guard in "
                    "each round: before and after a change in one run (its cases in the per-case table)")
    ap.add_argument("--floor", action="store_true", help="also run `floor`, the pass-through plus one quorum GET of "
                    "each pending pod ahead of the call (benchmarks/passthrough_extender.py:floor_app), after the guard "
                    "in each round: what keeping a quorum GET per pod costs any extender (its cases in the per-case "
                    "table, its ratio to the pass-through in the cell table)")
    ap.add_argument("guard_flags", nargs="*", help="extra flags for ghost-guard serve (after --)")
    args = ap.parse_args()
    phases = [p.strip() for p in args.phases.split(",")]
    if any(p not in ("live", "backlog") for p in phases):
        ap.error("--phases: live, backlog")
    counts = sorted(int(x) for x in args.nodes.split(","))
    if args.pin:
        pin_harness()  # before the lab starts: its processes inherit the harness's CPUs
    rows: list[tuple[int, str, dict[str, list[dict[str, Any]]]]] = []
    results: list[dict[str, Any]] = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as tmp:
        lab = RealLab(replicas=2, kube_bin=args.kube_bin, proxies=False, out_dir=f"{tmp}/lab")
        try:
            lab.start()
            have, n = 0, 0
            for nodes in counts:
                add_nodes(lab, have, nodes)
                have = nodes
                for phase in phases:
                    extenders = ["guard", *(["guard-baseline"] if args.baseline else []),
                                 *(["floor"] if args.floor else []), "pass-through"]
                    agg: dict[str, list[dict[str, Any]]] = {w: [] for w in extenders}
                    for _ in range(args.rounds):
                        for which in extenders:
                            n += 1
                            res = run_case(lab, which, phase, args.pods, n, tmp, args.guard_flags, args.timeout,
                                           baseline=args.baseline)
                            res.update(nodes=nodes, n=n)
                            agg[which].append(res)
                            results.append(res)
                            print(json.dumps(res), file=sys.stderr, flush=True)
                    rows.append((nodes, phase, agg))
        finally:
            lab.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    version = subprocess.run([str(lab.binaries.require("kube-scheduler")), "--version"], capture_output=True,
                             text=True).stdout.strip()
    print(f"{filter_latency.machine()}; started {started}; {version}; 2 kube-apiserver replicas; "
          f"{args.pods} pods per case, {args.rounds} rounds per cell (means)\n")
    print(table(rows))
    print()
    print(cases_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
