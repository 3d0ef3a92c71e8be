"""How fast the guard names a missing pod and a frozen replica with its DEFAULT settings
(--missing-after 30, --frozen-after 30), and what its checks cost each replica, on the lab.

    python -m benchmarks.cache_health [--runs N]        # from the repository root

Each run: a fresh lab (real etcd, 3 replicas) and `ghost-guard serve`. (1) replica 2 loses a pod's
creation: seconds from the create call until ghost_guard_replica_pods_missing{replica 2} is 1;
(2) replica 3's watch freezes while pods keep being created (one every 5 s): seconds until
ghost_guard_replica_frozen{replica 3} is 1; (3) the requests the checks made to replica 1 over the
run (from the lab's request log), per minute. Prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from guard.lab import Lab
from guard.lab.harness import GuardProcess, eventually, pod_manifest


def one_run() -> dict:
    with Lab(replicas=3) as lab, tempfile.TemporaryDirectory() as tmp:
        g = GuardProcess(["--kubeconfig", lab.kubeconfig(0), "--audit-db", f"{tmp}/a.db", "--no-access-log",
                          "--discovery-interval", "5"])
        try:
            g.wait()
            eventually(lambda: len([v for v in g.get("/readyz", timeout=5).json()["details"]["replicas"].values()
                                    if v["watch"] and v["watch"]["state"] == "synced"]) == 3, 30, interval=0.2)
            since = time.time()
            addr = [f"{r.ip}:{r.port}" for r in lab.replicas]
            api = lab.core_v1(0)
            lab.replicas[1].faults.drop_creates(namespace="default", name="lost")
            t0 = time.monotonic()
            api.create_namespaced_pod("default", pod_manifest("lost"), _request_timeout=5)
            eventually(lambda: g.metric("ghost_guard_replica_pods_missing", replica=addr[1]) == 1, 90, interval=0.2)
            missing = time.monotonic() - t0

            lab.replicas[2].faults.freeze_watch()
            t0 = time.monotonic()
            i = 0

            def frozen() -> bool:
                nonlocal i
                if time.monotonic() - t0 >= 5 * i:
                    api.create_namespaced_pod("default", pod_manifest(f"after-{i}"), _request_timeout=5)
                    i += 1
                return g.metric("ghost_guard_replica_frozen", replica=addr[2]) == 1

            eventually(frozen, 120, interval=0.2)
            named = time.monotonic() - t0
            minutes = (time.time() - since) / 60
            # replica 1 is healthy and never a suspect: only the revision reads reach it
            reads = [x for x in lab.replicas[0].requests(since=since)
                     if x.query.get("fieldSelector", "").startswith("metadata.name=")]
            other_false = [g.metric("ghost_guard_replica_frozen", replica=addr[0]),
                           g.metric("ghost_guard_replica_pods_missing", replica=addr[0]),
                           g.metric("ghost_guard_replica_pods_missing", replica=addr[2])]
            return {"missing_reported_after_s": round(missing, 2), "frozen_named_after_s": round(named, 2),
                    "requests_per_minute_healthy_replica": round(len(reads) / minutes, 1),
                    "run_minutes": round(minutes, 2), "false_reports": sum(other_false)}
        finally:
            g.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.runs):
        print(json.dumps(one_run()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
