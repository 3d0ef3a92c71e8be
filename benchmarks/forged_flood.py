"""What a flood of forged /filter calls costs a real ghost (issue 25, hole 8), on the lab.

    python -m benchmarks.forged_flood [--seconds 30] [--threads 8] [--namespaces 20]   # from the repository root

A fresh lab (real etcd, 3 replicas) and `ghost-guard serve` with its DEFAULT settings (SQLite audit).
A real ghost is made on replica 2 (it drops the delete). Then ``--threads`` kept-alive connections send
forged /filter calls, each for a pod that never existed (a new name and UID), spread over
``--namespaces`` namespaces, at full speed for ``--seconds``; meanwhile the real ghost is asked every
0.5 s, as kube-scheduler's backoff would. Prints one JSON line: forged calls sent, GhostPodBlocked
Events and audit records written for the forged pods (counted 20 s after the flood), follow-ups
dropped and coalesced, calls shed, and the seconds from the real ghost's first call until its audit
record names the stale replica and until its Event exists (null: not within the run).

The guard under test is whatever ``python -m guard`` imports (PYTHONPATH): run it from two checkouts
to compare.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import threading
import time
import uuid

import orjson
import requests

from guard.lab import Lab
from guard.lab.harness import GuardProcess, eventually, make_ghost


def body(namespace: str, name: str, uid: str) -> bytes:
    return orjson.dumps({"Pod": {"metadata": {"name": name, "namespace": namespace, "uid": uid}},
                         "Nodes": None, "NodeNames": ["n1"]})


def run(seconds: float, threads: int, namespaces: int) -> dict:
    names = [f"flood-{i}" for i in range(namespaces)]
    with Lab(replicas=3) as lab, tempfile.TemporaryDirectory() as tmp:
        for ns in names:
            lab.core_v1(0).create_namespace({"metadata": {"name": ns}}, _request_timeout=10)
        db = f"{tmp}/a.db"
        g = GuardProcess(["--kubeconfig", lab.kubeconfig(0), "--audit-db", db, "--no-access-log",
                          "--discovery-interval", "5"])
        try:
            g.wait(timeout=60)
            eventually(lambda: len([v for v in g.get("/readyz", timeout=5).json()["details"]["replicas"].values()
                                    if v["watch"] and v["watch"]["state"] == "synced"]) == 3, 30, interval=0.2)
            real = make_ghost(lab, "default", "real-ghost", stale=1)
            stale = f"{lab.replicas[1].ip}:{lab.replicas[1].port}"
            eventually(lambda: g.get("/readyz", timeout=5).json()["details"]["replicas"][stale]["watch"]["pods"] >= 1,
                       30, interval=0.2)
            stop = threading.Event()
            sent = [0] * threads
            forged_uids: set[str] = set()
            lock = threading.Lock()

            def flood(k: int) -> None:
                with requests.Session() as s:
                    s.trust_env = False
                    i = 0
                    while not stop.is_set():
                        uid = str(uuid.uuid4())
                        with lock:
                            forged_uids.add(uid)
                        s.post(g.url("/filter"), data=body(names[i % namespaces], f"forged-{k}-{i}", uid),
                               headers={"Content-Type": "application/json"}, timeout=10)
                        i += 1
                        sent[k] += 1

            workers = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(threads)]
            for w in workers:
                w.start()
            time.sleep(2)  # the flood is under way when the scheduler first asks about the real ghost
            first = time.monotonic()
            attributed = evented = None
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
            while time.monotonic() - first < seconds + 30:
                now = time.monotonic() - first
                if now < seconds:
                    g.post("/filter", body("default", "real-ghost", real), timeout=10)
                else:
                    stop.set()
                if attributed is None and conn.execute(
                        "SELECT 1 FROM replica_observations WHERE uid = ? AND first_seen_serving IS NOT NULL",
                        (real,)).fetchone():
                    attributed = round(now, 2)
                if evented is None and any(e.reason == "GhostPodBlocked" and e.involved_object.uid == real for e in
                                           lab.core_v1(0).list_namespaced_event("default", _request_timeout=10).items):
                    evented = round(now, 2)
                if now > seconds + 20 and attributed is not None and evented is not None:
                    break
                time.sleep(0.5)
            stop.set()
            for w in workers:
                w.join(15)
            events = sum(1 for ns in names for e in lab.core_v1(0).list_namespaced_event(ns, _request_timeout=30).items
                         if e.reason == "GhostPodBlocked")
            records = conn.execute("SELECT count(*) FROM ghosts WHERE namespace != 'default'").fetchone()[0]
            conn.close()
            shed = {r: g.metric("ghost_guard_flood_shed_total", reason=r)
                    for r in ("namespace-budget", "global-budget", "queue-full")}
            return {"seconds": seconds, "threads": threads, "namespaces": namespaces, "forged_calls": sum(sent),
                    "forged_events": events, "forged_records": records,
                    "followups_dropped": g.metric("ghost_guard_followups_dropped_total"),
                    "followups_coalesced": g.metric("ghost_guard_followups_coalesced_total"),
                    "shed": shed, "real_attributed_after_s": attributed, "real_event_after_s": evented}
        finally:
            g.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--namespaces", type=int, default=20)
    a = p.parse_args()
    print(json.dumps(run(a.seconds, a.threads, a.namespaces)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
