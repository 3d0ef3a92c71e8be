"""The hot path: a live pod's cache-hit names-mode ``/filter``, guard vs the orjson pass-through.

One kept-alive HTTP/1.1 connection per server, one call at a time, as kube-scheduler calls an
extender inside its serial scheduling cycle. The pod is a real pending pod of a real
kube-apiserver (:class:`guard.lab.real.controlplane.RealLab`, one replica, no scheduler), sent as
kube-scheduler sends it (the apiserver's own JSON of the pod without apiVersion/kind, then
``"Nodes":null,"NodeNames":[...]``); the guard has verified it ahead (its watch of unscheduled
pods), so every call is answered from its prepared verdict: the cost measured is the guard's own
wire work (framing, decode, verdict lookup, encode), not a read.

The pass-through is ``benchmarks/passthrough_extender.py:orjson_app`` (Flask + orjson under
gunicorn gthread, 1 worker, 16 threads: decode the body, encode the names back). Rounds alternate
(guard, pass-through, guard, ...), ``--calls`` calls each; per round the client's median latency
and the server process tree's CPU per call (``/proc``). The extender runs on its own CPU (the
last), the lab and the client on the others, unless ``--no-pin``.

Run from the repository root: ``python -m benchmarks.filter_hotpath [--kube-bin DIR] [--nodes 100,5000]
[--rounds 8] [--calls 300] [--json FILE]``. Prints a Markdown table (medians over the rounds).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from benchmarks import filter_latency
from benchmarks.cpu_per_pod import tree_cpu
from benchmarks.cpu_per_pod_real import loadavg
from benchmarks.filter_latency import machine, pin_harness, start_passthrough
from guard.lab.harness import eventually, pod_manifest, stop_group
from guard.lab.real.controlplane import RealLab


def scheduler_body(pod_json: bytes, names: list[str]) -> bytes:
    """The body kube-scheduler sends in names mode (Go's encoding/json: fields in struct order)."""
    pod = orjson.loads(pod_json)
    pod.pop("apiVersion", None)
    pod.pop("kind", None)
    return b'{"Pod":' + orjson.dumps(pod) + b',"Nodes":null,"NodeNames":' + orjson.dumps(names) + b"}"


def one_round(port: int, body: bytes, calls: int, pid: int) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json", "User-Agent": "kube-scheduler/v1.36.2"}
    lat = []
    try:
        for _ in range(5):  # the connection and the server's caches warm
            conn.request("POST", "/filter", body, headers)
            conn.getresponse().read()
        cpu0 = tree_cpu(pid)
        for _ in range(calls):
            t = time.perf_counter()
            conn.request("POST", "/filter", body, headers)
            r = conn.getresponse()
            data = r.read()
            lat.append(time.perf_counter() - t)
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        cpu1 = tree_cpu(pid)
    finally:
        conn.close()
    names = orjson.loads(data)["NodeNames"]
    return {"p50_ms": statistics.median(lat) * 1000, "mean_ms": statistics.fmean(lat) * 1000,
            "cpu_ms_per_call": (cpu1 - cpu0) * 1000 / calls, "names_back": len(names)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kube-bin", default=None)
    ap.add_argument("--nodes", default="100,5000")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per server and node count (alternating)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--json", default=None, help="write every round here as it ends")
    args = ap.parse_args()
    if not args.no_pin:
        pin_harness()
    rows: list[dict] = []
    header = f"{machine()}; load at start {loadavg()}"
    with RealLab(replicas=1, kube_bin=args.kube_bin, proxies=False) as lab, tempfile.TemporaryDirectory() as tmp:
        api = lab.core_v1(0)
        lab.ensure_namespace("hot")
        api.create_namespaced_pod("hot", pod_manifest("live"))
        _, pod_json = lab.raw_get(0, "/api/v1/namespaces/hot/pods/live")
        pt, pt_url = start_passthrough("benchmarks.passthrough_extender:orjson_app")
        guard = filter_latency.start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", f"{tmp}/a.db"])
        try:
            guard.wait("/readyz", timeout=30)
            gport, pport = guard.port, int(pt_url.rsplit(":", 1)[1])
            for n in (int(x) for x in args.nodes.split(",")):
                body = scheduler_body(pod_json.encode(), [f"node-{i:05d}" for i in range(n)])
                # the pod verified ahead: its call is answered from the prepared verdict
                eventually(lambda: one_round(gport, body, 1, guard.proc.pid)["names_back"] == n, 30,
                           what="the guard answering", interval=0.2)
                for r in range(args.rounds):
                    for which, port, pid in (("guard", gport, guard.proc.pid), ("pass-through", pport, pt.pid)):
                        res = one_round(port, body, args.calls, pid)
                        res.update(extender=which, nodes=n, round=r, body_bytes=len(body), load=loadavg())
                        if res["names_back"] != n:
                            raise RuntimeError(f"{which}: {res['names_back']} names back of {n}")
                        rows.append(res)
                        print(json.dumps(res), file=sys.stderr)
                        if args.json:
                            Path(args.json).write_text(json.dumps({"header": header, "rows": rows}, indent=1))
            prepared = filter_latency_metric(guard.base, "ghost_guard_verdicts_prepared_total")
        finally:
            guard.stop()
            stop_group(pt)
    print(header + f"; load at end {loadavg()}; {args.rounds} rounds x {args.calls} calls per server and node count; "
          f"guard calls answered from a prepared verdict: {prepared:.0f}\n")
    print("| nodes | body bytes | guard p50 ms | pass-through p50 ms | p50 ratio | guard CPU ms/call | "
          "pass-through CPU ms/call | CPU ratio | per-round p50 ratios |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for n in sorted({r["nodes"] for r in rows}):
        g = [r for r in rows if r["nodes"] == n and r["extender"] == "guard"]
        p = [r for r in rows if r["nodes"] == n and r["extender"] == "pass-through"]
        gp, pp = statistics.median(r["p50_ms"] for r in g), statistics.median(r["p50_ms"] for r in p)
        gc, pc = statistics.median(r["cpu_ms_per_call"] for r in g), statistics.median(r["cpu_ms_per_call"] for r in p)
        per = ", ".join(f"{a['p50_ms'] / b['p50_ms']:.2f}" for a, b in zip(g, p))
        print(f"| {n} | {g[0]['body_bytes']} | {gp:.3f} | {pp:.3f} | **{gp / pp:.2f}** | {gc:.3f} | {pc:.3f} | "
              f"{gc / pc:.2f} | {per} |")
    return 0


def filter_latency_metric(base: str, name: str) -> float:
    from benchmarks.prepared_burst import metric

    return metric(base, name)


if __name__ == "__main__":
    sys.exit(main())
