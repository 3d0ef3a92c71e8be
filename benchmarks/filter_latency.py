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

``--ghost-nodes-ab ROUNDS``: the cost of ghost-Node checking instead. Two guards on one lab, one with
``--ghost-nodes`` (the default) and one with ``--no-ghost-nodes``, and the pass-through, called in
alternating blocks (the order turned each block) for ROUNDS rounds of ``--calls`` calls per server and
case (hit-alive, hit-ghost; 100 and 5,000 node names; the lab holds the 100 Nodes, so the guard's Node
watches have something to watch). Prints each round's p50s and ratios, then the medians.
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


def start_passthrough(app: str = "benchmarks.passthrough_extender:app",
                      env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """The minimal pass-through extender (benchmarks/passthrough_extender.py; ``app``: another of its apps) under
    gunicorn like the guard (gthread, 1 worker, 16 threads), on the extender's CPU; returns it once /healthz answers.
    ``env``: added to the environment (``floor_app``'s apiserver)."""
    port = free_port()
    pin = (lambda: os.sched_setaffinity(0, EXTENDER_CPUS)) if EXTENDER_CPUS else None
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "-k", "gthread", "--threads", "16", "-w", "1",
                             "--no-control-socket", "--log-level", "warning", "-b", f"127.0.0.1:{port}",
                             app],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO,
                            preexec_fn=pin, env={**os.environ, **env} if env else None)
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


def ghost_nodes_ab(rounds: int, calls: int, block: int) -> int:
    """``--ghost-nodes-ab``: guard with and without ghost-Node checking, side by side (module docstring)."""
    from guard.lab.harness import node_manifest

    rows: list[tuple[int, int, str, float, float, float]] = []  # round, nodes, case, with, without, pass-through
    with Lab(replicas=1) as lab, tempfile.TemporaryDirectory() as tmp:
        api = lab.core_v1(0)
        ns = "bench"
        api.create_namespace({"metadata": {"name": ns}})
        for i in range(100):
            api.create_node(node_manifest(f"node-{i:05d}"))
        live_uid = api.create_namespaced_pod(ns, pod_manifest("live")).metadata.uid
        ghost_uid = make_ghost(lab, ns, "ghost", stale=0)
        passthrough, pt_url = start_passthrough()
        common = ["--alive-ttl", "0.99", "--kubeconfig", lab.kubeconfig(0)]
        with_nodes = start_guard(["--ghost-nodes", "--audit-db", f"{tmp}/a.db", *common])
        without = start_guard(["--no-ghost-nodes", "--audit-db", f"{tmp}/b.db", *common])
        try:
            eventually(lambda: with_nodes.metric("ghost_guard_node_watch_up") == 1, 30, what="the Node watch up")
            servers = [with_nodes.url("/filter"), without.url("/filter"), f"{pt_url}/filter"]
            for r in range(rounds):
                for n in (100, 5000):
                    nodes = [f"node-{i:05d}" for i in range(n)]
                    for case, (name, uid) in {"hit-alive": ("live", live_uid), "hit-ghost": ("ghost", ghost_uid)}.items():
                        payload = body(ns, name, uid, nodes)
                        samples: list[list[float]] = [[], [], []]
                        sessions = [requests.Session() for _ in servers]
                        try:
                            for s in sessions:
                                s.trust_env = False
                            for s, url in zip(sessions, servers):
                                for _ in range(5):  # warm the connection and the caches
                                    timed(s, url, payload)
                            for b, start_i in enumerate(range(0, calls, block)):
                                order = [(b + k) % 3 for k in range(3)]  # who goes first turns each block
                                for k in order:
                                    samples[k] += [timed(sessions[k], servers[k], payload)
                                                   for _ in range(start_i, min(start_i + block, calls))]
                        finally:
                            for s in sessions:
                                s.close()
                        p50 = [statistics.median(x) * 1000 for x in samples]
                        rows.append((r + 1, n, case, *p50))
        finally:
            stop_group(passthrough)
            with_nodes.stop()
            without.stop()
    print(f"{machine()}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end; "
          f"{rounds} rounds of {calls} calls per server and case\n")
    print("| round | nodes | case | --ghost-nodes p50 ms | --no-ghost-nodes p50 ms | pass-through p50 ms "
          "| ratio with | ratio without | with / without |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r, n, case, w, wo, pt in rows:
        print(f"| {r} | {n} | {case} | {w:.3f} | {wo:.3f} | {pt:.3f} | {w / pt:.2f} | {wo / pt:.2f} | {w / wo:.2f} |")
    print("\nMedians over the rounds:\n")
    print("| nodes | case | ratio with | ratio without | with / without |")
    print("|---:|---|---:|---:|---:|")
    for n in (100, 5000):
        for case in ("hit-alive", "hit-ghost"):
            mine = [row for row in rows if row[1] == n and row[2] == case]
            print(f"| {n} | {case} | {statistics.median(w / pt for *_, w, _, pt in mine):.2f} | "
                  f"{statistics.median(wo / pt for *_, wo, pt in mine):.2f} | "
                  f"{statistics.median(w / wo for *_, w, wo, _ in mine):.2f} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400, help="calls per case and server")
    ap.add_argument("--block", type=int, default=50, help="calls per block before switching server")
    ap.add_argument("--no-pin", action="store_true", help="don't give the extender its own CPU")
    ap.add_argument("--ghost-nodes-ab", type=int, metavar="ROUNDS", default=0,
                    help="measure --ghost-nodes against --no-ghost-nodes instead, in ROUNDS alternating rounds")
    args = ap.parse_args()
    if not args.no_pin:
        pin_harness()
    if args.ghost_nodes_ab:
        return ghost_nodes_ab(args.ghost_nodes_ab, args.calls, args.block)

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
