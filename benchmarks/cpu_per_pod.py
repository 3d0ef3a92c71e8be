"""CPU per scheduled pod: the guard's process against the pass-through extender, and its load on the lab.

The setup of ``benchmarks/prepared_burst.py`` (the lab in its own process: real etcd, 3 apiserver
replicas; a serial client with its own informer plays kube-scheduler, one ``/filter`` call per pod),
guard and pass-through alternating in one run, at several node counts. Per case it reports:

- **CPU per pod** of the extender's processes (utime + stime from ``/proc/PID/stat`` of the
  server process and every descendant: gunicorn's master and its forked workers), read just
  before the first pod is created and after the last ``/filter`` answer, divided by the pods;
- **requests per pod** the guard made to the lab (from the replicas' request logs: everything
  in the window but the client's own creates, LIST and WATCH), of which **quorum GETs per pod**;
- **watch events per pod** the replicas wrote to the guard's watches of unscheduled pods
  (``/api/v1/pods``, all replicas; the replicas count them, ``watchEvents`` of ``/lab/requests``),
  and to the client's own informer for comparison;
- **lab CPU per pod**: the lab's process tree (etcd and the apiserver replicas, which also serve
  the client's creates and informer) over the same window: the control plane's load, guard's and
  client's together, beside the same figure under the pass-through;
- the client's pods/s and ``/filter`` p50, as in prepared_burst.

Cases: ``live`` (500 pods created by 4 threads while the client runs; the client keeps pace
with creation) and ``backlog`` (the pods land before the client reaches them). The client binds
each pod after its ``/filter`` answer, as kube-scheduler's binding cycle does (4 binding threads),
and a case ends when its informer has seen every pod bound: CPU per *scheduled* pod, with the
guard's watch seeing each pod leave the unscheduled set. ``--no-bind`` leaves them unscheduled
(the figures before 2026-12-01 20:00 UTC were taken that way).

With ``--profile DIR`` each guard run is sampled by py-spy (``record --gil --nonblocking``,
raw collapsed stacks to ``DIR``; ``python3 -m pip install py-spy``); the CPU figures of a
profiled run include py-spy's small cost to the guard, so profile and measure in separate runs.
``python -m benchmarks.profile_summary DIR/*.txt --pods N`` groups the samples.

``--idle-guards N`` runs N more guards of the same source tree beside each guard run, against the
same lab, never called (the Deployment's second replica; the sidecars of the standby schedulers):
their CPU per pod is reported apart, and the quorum GETs, requests and watch events per pod are
then the whole cluster's (every guard's). ``--warm`` makes one call to each guard before its case, so
that it is the guard being asked from the start (otherwise the case's first call is its takeover).
``--replicas 1,3,5`` repeats everything on a lab with
that many apiserver replicas (a fresh lab each).

``--baseline TREE`` adds a third extender to each alternation: the guard of another source tree
(``git archive <commit> | tar -x -C TREE``), so that a change is measured before and after in
one run, side by side, on a machine whose load changes from minute to minute.

Run from the repository root: ``python -m benchmarks.cpu_per_pod [--pods 500] [--nodes 100,1000] [--rounds 2] [--replicas 3] [--idle-guards 0]
[--baseline TREE] [-- GUARD FLAGS]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import requests

from benchmarks import filter_latency, prepared_burst
from benchmarks.filter_latency import pin_harness, start_passthrough
from benchmarks.prepared_burst import metric, run_case, start_guard
from benchmarks.soak_lab import LabProcess
from guard.lab.harness import stop_group

TICK = os.sysconf("SC_CLK_TCK")
GUARD_WATCH = "/api/v1/pods"  # the guard's watches of unscheduled pods (all namespaces)


def tree_cpu(pid: int) -> float:
    """utime + stime (seconds) of ``pid`` and every live descendant, plus what reaped children used."""
    return sum(tree_usage(pid)[:2])


def proc_stats() -> dict[int, list[str]]:
    """Every process's ``/proc/PID/stat`` fields after "pid (comm) " (``[1]`` is the parent)."""
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        stats[int(entry)] = raw[raw.rindex(")") + 2:].split()
    return stats


def tree_of(pid: int, stats: dict[int, list[str]]) -> set[int]:
    """``pid`` and its live descendants, from :func:`proc_stats`."""
    parents = {p: int(fields[1]) for p, fields in stats.items()}
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p and c not in tree]
        tree.update(kids)
        frontier.extend(kids)
    return tree


def tree_usage(pid: int) -> tuple[float, float, int]:
    """(user seconds, system seconds, context switches of the live threads) of ``pid``'s process tree.

    User and system time include what reaped children used; the switches (voluntary and not, summed
    over every thread in ``/proc/PID/task``) count each handoff between threads and each wait."""
    stats = proc_stats()
    tree = tree_of(pid, stats)
    # fields[11..14] = utime, stime, cutime, cstime (stat fields 14-17)
    live = [stats[p] for p in tree if p in stats]
    user = sum(int(f[11]) + int(f[13]) for f in live) / TICK
    system = sum(int(f[12]) + int(f[14]) for f in live) / TICK
    switches = 0
    for p in tree:
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                status = Path(f"/proc/{p}/task/{t}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if "ctxt_switches:" in line:
                    switches += int(line.split()[1])
    return user, system, switches


def lab_log(lab: LabProcess) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """Every replica's request log (concatenated) and watch events, summed by path and type."""
    reqs: list[dict] = []
    events: dict[str, dict[str, int]] = {}
    for i in range(len(lab.state["urls"])):
        doc = lab.requests_log(i)
        reqs.extend(doc["requests"])
        for path, by_type in doc.get("watchEvents", {}).items():
            for typ, n in by_type.items():
                events.setdefault(path, {}).setdefault(typ, 0)
                events[path][typ] += n
    return reqs, events


def events_between(before: dict, after: dict, path: str) -> dict[str, int]:
    b, a = before.get(path, {}), after.get(path, {})
    return {t: n - b.get(t, 0) for t, n in a.items() if n - b.get(t, 0)}


def guard_requests(reqs: list[dict], namespace: str, since: float) -> list[dict]:
    """The requests in the window that the client did not make (its creates, bindings, its informer's LIST and WATCH)."""
    mine = {f"/api/v1/namespaces/{namespace}/pods", "/api/v1/namespaces", "/lab/requests"}
    bindings = f"/api/v1/namespaces/{namespace}/pods/"
    return [q for q in reqs if q["time"] >= since and q["path"] not in mine
            and not (q["path"].startswith(bindings) and q["path"].endswith("/binding"))]


def delete_namespace_pods(lab: LabProcess, namespace: str, pods: int) -> None:
    """Remove a case's pods, so that the next guard does not verify them all at its start."""
    api = lab.core_v1(0)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: api.delete_namespaced_pod(f"p-{i:04d}", namespace, grace_period_seconds=0,
                                                           _request_timeout=10), range(pods)))


def measured_case(lab: LabProcess, proc: subprocess.Popen, url: str, namespace: str, pods: int, rate: float | None,
                  profile: str | None, idle: list[subprocess.Popen] = (), warm: bool = False,
                  bind_pods: bool = True) -> dict:
    spy = None
    if profile:
        spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--subprocesses", "--gil", "--nonblocking",
                                "--rate", "1000", "--format", "raw", "--output", f"{profile}.txt"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches
    if warm:  # a scheduler call before the case: the guard is the one being asked (verifies ahead) from the start
        requests.post(url + "/filter", timeout=10, headers={"Content-Type": "application/json"},
                      data=orjson.dumps({"Pod": {"metadata": {"name": "warm-up", "namespace": "default", "uid": "warm"}},
                                         "Nodes": None, "NodeNames": ["n1"]}))
        answered0 = {k: int(metric(url, f"ghost_guard_verdicts_{k}_total")) for k in ("prepared", "shared_read", "inline")}
    _, ev_before = lab_log(lab)
    since = time.time()
    use0 = tree_usage(proc.pid)
    idle0 = [tree_cpu(p.pid) for p in idle]
    lab0 = tree_cpu(lab.proc.pid)
    res = run_case(lab, namespace, url, pods, rate, bind_pods)
    use1 = tree_usage(proc.pid)
    lab_cpu = tree_cpu(lab.proc.pid) - lab0
    user, system, switches = (b - a for a, b in zip(use0, use1))
    cpu = user + system
    idle_cpu = [tree_cpu(p.pid) - c for p, c in zip(idle, idle0)]
    reqs, ev_after = lab_log(lab)
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    try:  # how the guard's calls were answered: a prepared verdict, a shared read, a GET of their own
        answered = {k: int(metric(url, f"ghost_guard_verdicts_{k}_total")) - (answered0[k] if warm else 0)
                    for k in ("prepared", "shared_read", "inline")}
    except Exception:
        answered = {}  # the pass-through has no such metrics
    mine = guard_requests(reqs, namespace, since)
    guard_events = events_between(ev_before, ev_after, GUARD_WATCH)
    client_events = events_between(ev_before, ev_after, f"/api/v1/namespaces/{namespace}/pods")
    res.update(cpu_ms_per_pod=cpu * 1000 / pods, lab_cpu_ms_per_pod=lab_cpu * 1000 / pods,
               user_ms_per_pod=user * 1000 / pods,
               sys_ms_per_pod=system * 1000 / pods, switches_per_pod=switches / pods, requests_per_pod=len(mine) / pods,
               watch_events_per_pod=sum(guard_events.values()) / pods,
               client_watch_events_per_pod=sum(client_events.values()) / pods,
               watch_events=guard_events, answered=answered,
               idle_cpu_ms_per_pod=statistics.mean(idle_cpu) * 1000 / pods if idle_cpu else float("nan"))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=500)
    ap.add_argument("--nodes", default="100,1000", help="node names per /filter call (comma-separated counts)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of guard and pass-through per cell")
    ap.add_argument("--cases", default="live,backlog", help="live, backlog (comma-separated)")
    ap.add_argument("--no-pin", action="store_true", help="don't give the extender its own CPU")
    ap.add_argument("--profile", metavar="DIR", help="sample each guard run with py-spy into DIR (no pass-through runs)")
    ap.add_argument("--baseline", metavar="TREE", help="also run the guard of another source tree (e.g. a `git archive` "
                    "of the commit before a change), alternating with this one and the pass-through")
    ap.add_argument("--replicas", default="3", help="apiserver replicas of the lab (comma-separated: a lab each)")
    ap.add_argument("--idle-guards", type=int, default=0, help="guards of the same tree run beside each guard, "
                    "never called (their CPU reported apart; GETs and watch events per pod are the cluster's)")
    ap.add_argument("--warm", action="store_true", help="one /filter call (for a pod that does not exist) to each "
                    "guard before its case: it is the guard being asked from the start (--prepare-idle-after), "
                    "so a backlog is verified as it forms, not after the first call")
    ap.add_argument("--no-bind", action="store_true", help="leave the pods unscheduled (the client only calls "
                    "/filter; the guard lists them until the case's end) instead of binding each one")
    ap.add_argument("guard_flags", nargs="*", help="extra flags for ghost-guard serve (after --)")
    args = ap.parse_args()
    if not args.no_pin:
        pin_harness()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    all_cases = {"live": ("live (created while the client runs)", None), "backlog": ("backlog", 0.0)}
    try:
        cases = [(c.strip(), *all_cases[c.strip()]) for c in args.cases.split(",")]
    except KeyError as e:
        ap.error(f"unknown case {e}; choose from live, backlog")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        n = 0
        for replicas in [int(x) for x in args.replicas.split(",")]:
            lab = LabProcess(f"{tmp}/lab-{replicas}", replicas=replicas, timeout=60)
            try:
                for nodes in [int(x) for x in args.nodes.split(",")]:
                    prepared_burst.NODES = [f"node-{i:04d}" for i in range(nodes)]
                    for key, label, rate in cases:
                        variants = (["guard"] + (["baseline"] if args.baseline else [])
                                    + ([] if args.profile else ["pass-through"]))
                        agg: dict[str, list[dict]] = {v: [] for v in ("guard", "baseline", "pass-through")}
                        for rnd in range(args.rounds):
                            for which in variants:
                                n += 1
                                idle: list[subprocess.Popen] = []
                                tree = args.baseline if which == "baseline" else None
                                try:
                                    if which == "pass-through":
                                        proc, url = start_passthrough()
                                    else:
                                        for k in range(args.idle_guards):
                                            n += 1
                                            idle.append(start_guard(lab, tmp, n, args.guard_flags, tree).proc)
                                        guard = start_guard(lab, tmp, n, args.guard_flags, tree)
                                        proc, url = guard.proc, guard.base
                                    namespace = f"c{n}"
                                    try:
                                        profile = f"{args.profile}/{which}-{key}-{nodes}-{rnd}" if args.profile else None
                                        res = measured_case(lab, proc, url, namespace, args.pods, rate, profile, idle,
                                                            args.warm and which != "pass-through", not args.no_bind)
                                        agg[which].append(res)
                                        print(f"{replicas} replicas, {nodes} nodes, {label}, {which}: {res}",
                                              file=sys.stderr, flush=True)
                                    finally:
                                        stop_group(proc)
                                finally:
                                    for p in idle:
                                        stop_group(p)
                                delete_namespace_pods(lab, namespace, args.pods)
                        rows.append((replicas, nodes, label, agg))
            finally:
                lab.close()

    print(f"{filter_latency.machine()}; {args.pods} pods, {'left unscheduled' if args.no_bind else 'each bound'}, "
          f"{args.rounds} rounds per cell, means; {args.idle_guards} idle guard(s) beside each guard\n")
    print("| replicas | nodes | case | guard CPU ms/pod | idle guard CPU ms/pod | pass-through CPU ms/pod "
          "| difference ms/pod | guard requests/pod | quorum GETs/pod | guard watch events/pod | guard pods/s "
          "| pass-through pods/s | pods/s ratio | guard p50 ms | pass-through p50 ms "
          "| lab CPU ms/pod, guard | lab CPU ms/pod, pass-through |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def mean(rs: list[dict], k: str) -> float:
        return statistics.mean(r[k] for r in rs) if rs else float("nan")

    for replicas, nodes, label, agg in rows:
        p = agg["pass-through"]
        for which in ("baseline", "guard"):
            g = agg[which]
            if not g:
                continue
            name = label if not args.baseline else f"{label}, {'this checkout' if which == 'guard' else 'baseline'}"
            print(f"| {replicas} | {nodes} | {name} | {mean(g, 'cpu_ms_per_pod'):.2f} "
                  f"| {mean(g, 'idle_cpu_ms_per_pod'):.2f} | {mean(p, 'cpu_ms_per_pod'):.2f} "
                  f"| {mean(g, 'cpu_ms_per_pod') - mean(p, 'cpu_ms_per_pod'):.2f} | {mean(g, 'requests_per_pod'):.2f} "
                  f"| {mean(g, 'gets_per_pod'):.2f} | {mean(g, 'watch_events_per_pod'):.2f} | {mean(g, 'pods_per_s'):.0f} "
                  f"| {mean(p, 'pods_per_s'):.0f} | {mean(g, 'pods_per_s') / mean(p, 'pods_per_s'):.2f} "
                  f"| {mean(g, 'p50_ms'):.2f} | {mean(p, 'p50_ms'):.2f} "
                  f"| {mean(g, 'lab_cpu_ms_per_pod'):.2f} | {mean(p, 'lab_cpu_ms_per_pod'):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
