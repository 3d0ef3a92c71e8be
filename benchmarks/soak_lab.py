"""The soak's lab, in its own process (so the load generator and the lab's replica threads
do not share one GIL): etcd + 3 apiserver replicas (``--replicas``), live pods and real ghosts.

Run by ``benchmarks/soak.py``; by hand: ``python benchmarks/soak_lab.py OUT_DIR --live 2000 --ghosts 50``.
Writes ``OUT_DIR/state.json`` when ready (kubeconfigs, replica URLs, token, pods),
then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

NAMESPACE = "soak"


def pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "soak"}},
            "spec": {"containers": [{"name": "app", "image": "registry.k8s.io/pause:3.9"}]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--live", type=int, default=2000, help="live (pending) pods to create")
    parser.add_argument("--ghosts", type=int, default=50, help="real ghosts: deleted, still served by replica 1")
    parser.add_argument("--replicas", type=int, default=3, help="apiserver replicas (ghosts need at least 2)")
    args = parser.parse_args()

    from guard.lab import Lab

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    os.makedirs(args.out_dir, exist_ok=True)
    if args.ghosts and args.replicas < 2:
        parser.error("--ghosts needs at least 2 --replicas (one of them misses the deletes)")
    with Lab(replicas=args.replicas, out_dir=args.out_dir) as lab:
        api = lab.core_v1(0)
        api.create_namespace({"metadata": {"name": NAMESPACE}}, _request_timeout=10)
        with ThreadPoolExecutor(8) as pool:
            live = list(pool.map(lambda i: (f"live-{i}", api.create_namespaced_pod(
                NAMESPACE, pod(f"live-{i}"), _request_timeout=10).metadata.uid), range(args.live)))
            if args.ghosts:
                lab.replicas[1].faults.drop_deletes(namespace=NAMESPACE)  # replica 1 misses every delete from now on
            ghosts = list(pool.map(lambda i: (f"ghost-{i}", api.create_namespaced_pod(
                NAMESPACE, pod(f"ghost-{i}"), _request_timeout=10).metadata.uid), range(args.ghosts)))
            lab.wait_synced(timeout=30)
            list(pool.map(lambda g: api.delete_namespaced_pod(g[0], NAMESPACE, _request_timeout=10), ghosts))
        lab.wait_synced(timeout=30)
        state = {
            "namespace": NAMESPACE, "token": lab.token, "ca": lab.ca_path, "urls": lab.urls,
            "kubeconfigs": [lab.kubeconfig(i) for i in range(lab.n)], "live": live, "ghosts": ghosts,
            "pid": os.getpid(),
        }
        tmp = os.path.join(args.out_dir, "state.json.tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, os.path.join(args.out_dir, "state.json"))
        print(f"soak lab ready: {len(live)} live pods, {len(ghosts)} ghosts, replicas {', '.join(lab.urls)}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
