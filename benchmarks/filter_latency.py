"""/filter latency and throughput: the guard against a minimal pass-through Flask extender.

Side by side in one run, on one machine: both served by gunicorn (gthread, 1 worker,
16 threads), called by one serial client over keep-alive HTTP, like kube-scheduler
(one pod at a time). Calls alternate in blocks between the two servers so drift
hits both alike. The guard reads a lab apiserver replica (real etcd).

Cases, at 100 and 5,000 node names:

- ``hit-alive``: a live pod whose verdict is cached (the guard runs with
  ``--alive-ttl 0.99`` so the burst cache covers the whole block);
- ``hit-ghost``: a ghost, rejected from the ghost cache (every node gets a reason);
- ``miss-alive``: a new pod per call: the quorum GET runs inline (``--no-prepare``).

Run from the repository root: ``python -m benchmarks.filter_latency [--calls 400]``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import requests

from guard.lab import Lab
from guard.lab.harness import GuardProcess, NotReached, eventually, free_port, make_ghost, pod_manifest, stop_group

REPO = Path(__file__).resolve().parent.parent

# The extender under test (guard or pass-through) runs on its own CPU, as it would in its own pod;
# the lab (etcd, apiserver replicas) and the client share the other. Same for both extenders.
EXTENDER_CPUS: set[int] | None = None


def pin_harness() -> None:
    """Put this process (and the lab it starts) on CPU 0, leaving the last CPU to the extender."""
    global EXTENDER_CPUS
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, set(cpus[:-1]))
        EXTENDER_CPUS = {cpus[-1]}


def machine() -> str:
    """A report's first words: cores, CPU model, Python, date, and where the extender runs."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    pinning = f"extender pinned to CPU {sorted(EXTENDER_CPUS)}" if EXTENDER_CPUS else "no CPU pinning"
    return (f"Machine: {os.cpu_count()} cores, {cpu}; Python {platform.python_version()}; "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {pinning}")


def start_passthrough(app: str = "benchmarks.passthrough_extender:app") -> tuple[subprocess.Popen, str]:
    """The minimal pass-through extender (benchmarks/passthrough_extender.py; ``app``: another of its apps) under
    gunicorn like the guard (gthread, 1 worker, 16 threads), on the extender's CPU; returns it once /healthz answers."""
    port = free_port()
    pin = (lambda: os.sched_setaffinity(0, EXTENDER_CPUS)) if EXTENDER_CPUS else None
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "16", "-w", "1",
                             "--no-control-socket", "--log-level", "warning", "-b", f"127.0.0.1:{port}",
                             app],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO,
                            preexec_fn=pin)
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: requests.get(url + "/healthz", timeout=1).status_code == 200, 30,
                   what="the pass-through extender up", interval=0.1, ignore=(requests.RequestException,))
    except NotReached:
        stop_group(proc)
        raise
    return proc, url


def start_guard(args: list[str], *, tree: str | None = None) -> GuardProcess:
    """``ghost-guard serve`` over HTTP on the extender's CPU, quiet (no access log, no Events, warnings only),
    from this checkout or from another source tree ``tree`` (its code, same flags); once /healthz answers."""
    env = {"PYTHONPATH": tree} if tree else None  # ``python -m`` puts the working directory first on sys.path
    g = GuardProcess(["--no-access-log", "--no-events", "--log-level", "warning", *args], cwd=tree or REPO, env=env,
                     cpus=EXTENDER_CPUS)
    try:
        g.wait("/healthz", timeout=30)
    except RuntimeError:
        g.stop()
        raise
    return g


def body(ns: str, name: str, uid: str, nodes: list[str]) -> bytes:
    pod = {"metadata": {"name": name, "namespace": ns, "uid": uid}, "spec": {"containers": [{"name": "a", "image": "p"}]},
           "status": {"phase": "Pending"}}
    return orjson.dumps({"Pod": pod, "Nodes": None, "NodeNames": nodes})


def timed(session: requests.Session, url: str, payload: bytes) -> float:
    t = time.perf_counter()
    r = session.post(url, data=payload, headers={"Content-Type": "application/json"}, timeout=10)
    elapsed = time.perf_counter() - t
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code} {r.text[:200]}")
    return elapsed


def summary(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"p50_ms": statistics.median(s) * 1000, "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1000,
            "per_s": len(s) / sum(s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400, help="calls per case and server")
    ap.add_argument("--block", type=int, default=50, help="calls per block before switching server")
    ap.add_argument("--no-pin", action="store_true", help="don't give the extender its own CPU")
    args = ap.parse_args()
    if not args.no_pin:
        pin_harness()

    results = []
    with Lab(replicas=1) as lab, tempfile.TemporaryDirectory() as tmp:
        api = lab.core_v1(0)
        ns = "bench"
        api.create_namespace({"metadata": {"name": ns}})
        live_uid = api.create_namespaced_pod(ns, pod_manifest("live")).metadata.uid
        ghost_uid = make_ghost(lab, ns, "ghost", stale=0)
        fresh = [(f"fresh-{i}", api.create_namespaced_pod(ns, pod_manifest(f"fresh-{i}")).metadata.uid)
                 for i in range(args.calls * 2)]

        passthrough, pt_url = start_passthrough()
        common = ["--kubeconfig", lab.kubeconfig(0)]
        guard_hit = start_guard(["--alive-ttl", "0.99", "--audit-db", f"{tmp}/a.db", *common])
        guard_miss = start_guard(["--no-prepare", "--audit-db", f"{tmp}/b.db", *common])
        try:
            for n in (100, 5000):
                nodes = [f"node-{i:05d}" for i in range(n)]
                cases = {
                    "hit-alive": (guard_hit.url("/filter"), lambda i: body(ns, "live", live_uid, nodes)),
                    "hit-ghost": (guard_hit.url("/filter"), lambda i: body(ns, "ghost", ghost_uid, nodes)),
                    "miss-alive": (guard_miss.url("/filter"),
                                   lambda i: body(ns, fresh[i][0], fresh[i][1], nodes)),
                }
                offset = 0 if n == 100 else args.calls
                for case, (url, make) in cases.items():
                    payloads = [make(offset + i if case == "miss-alive" else i) for i in range(args.calls)]
                    pt_payload = payloads[0]
                    g, p = [], []
                    with requests.Session() as gs, requests.Session() as ps:
                        gs.trust_env = ps.trust_env = False
                        for _ in range(5):  # warm both connections and caches
                            timed(ps, f"{pt_url}/filter", pt_payload)
                        if case != "miss-alive":
                            for _ in range(5):
                                timed(gs, url, payloads[0])
                        for start_i in range(0, args.calls, args.block):
                            for i in range(start_i, min(start_i + args.block, args.calls)):
                                g.append(timed(gs, url, payloads[i]))
                            for i in range(start_i, min(start_i + args.block, args.calls)):
                                p.append(timed(ps, f"{pt_url}/filter", pt_payload))
                    results.append((n, case, summary(g), summary(p)))
        finally:
            stop_group(passthrough)
            guard_hit.stop()
            guard_miss.stop()

    print(f"{machine()}; {args.calls} calls per cell\n")
    print("| nodes | case | guard p50 ms | guard p99 ms | guard calls/s | pass-through p50 ms | pass-through p99 ms "
          "| pass-through calls/s | p50 ratio (guard / pass-through) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, case, g, p in results:
        print(f"| {n} | {case} | {g['p50_ms']:.3f} | {g['p99_ms']:.3f} | {g['per_s']:.0f} | {p['p50_ms']:.3f} | "
              f"{p['p99_ms']:.3f} | {p['per_s']:.0f} | {g['p50_ms'] / p['p50_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
