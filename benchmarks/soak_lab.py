"""The benchmarks' lab, in its own process (so the load generator and the lab's replica threads
do not share one GIL, as in a cluster the apiserver and kube-scheduler are separate processes):
etcd + 3 apiserver replicas (``--replicas``), live pods and real ghosts.

Started by :class:`LabProcess` (soak, prepared_burst, cpu_per_pod, quorum_get_cpu); by hand, from
the repository root: ``python -m benchmarks.soak_lab OUT_DIR --live 2000 --ghosts 50``.
Writes ``OUT_DIR/state.json`` when ready (kubeconfigs, replica URLs, token, pods),
then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson

from guard.lab.harness import NotReached, eventually, pod_manifest, stop_group

NAMESPACE = "soak"
REPO = Path(__file__).resolve().parent.parent


class LabProcess:
    """This module in a child process (its own session), seen from the parent: ``state`` (what
    ``state.json`` says), clients per replica, the replicas' request logs and faults over ``/lab/``.
    Its output goes to ``WORKDIR/lab.out``."""

    def __init__(self, workdir: str | Path, *, replicas: int = 3, live: int = 0, ghosts: int = 0,
                 timeout: float = 300.0) -> None:
        import urllib3

        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "lab.out"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.soak_lab", str(self.dir), "--live", str(live),
                                          "--ghosts", str(ghosts), "--replicas", str(replicas)],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
        state = self.dir / "state.json"
        try:
            eventually(state.exists, timeout, what="the lab process ready", interval=0.1, process=self)
        except NotReached:
            self.close()
            raise
        self.state: dict[str, Any] = json.loads(state.read_text())
        self.http = urllib3.PoolManager(ca_certs=self.state["ca"], cert_reqs="CERT_REQUIRED", retries=False)
        self._clients: list[Any] = []

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def core_v1(self, i: int) -> Any:
        from kubernetes import client, config

        if not self._clients:
            self._clients = [config.new_client_from_config(k) for k in self.state["kubeconfigs"]]
        return client.CoreV1Api(self._clients[i])

    def kubeconfig(self, i: int) -> str:
        return self.state["kubeconfigs"][i]

    def _lab(self, method: str, replica: int, path: str, body: dict | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.state['token']}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        return self.http.request(method, self.state["urls"][replica] + path, headers=headers, timeout=5,
                                 body=orjson.dumps(body) if body is not None else None)

    def requests_log(self, replica: int) -> dict[str, Any]:
        """Replica ``replica``'s ``/lab/requests`` document (its request log and watch events)."""
        return orjson.loads(self._lab("GET", replica, "/lab/requests").data)

    def quorum_gets(self, namespace: str, since: float) -> int:
        """Quorum GETs of the namespace's pods, on every replica, from the replicas' request logs."""
        return sum(1 for i in range(len(self.state["urls"])) for q in self.requests_log(i)["requests"]
                   if q["quorum"] and q["time"] >= since and q["path"].startswith(f"/api/v1/namespaces/{namespace}/pods/"))

    def add_fault(self, replica: int, fault: dict) -> None:
        r = self._lab("POST", replica, "/lab/faults", fault)
        if r.status != 201:
            raise RuntimeError(f"lab fault refused: {r.status} {r.data[:200]!r}")

    def close(self) -> None:
        stop_group(self.proc, term_timeout=20, kill_timeout=10)


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
                NAMESPACE, pod_manifest(f"live-{i}", labels={"app": "soak"}), _request_timeout=10).metadata.uid), range(args.live)))
            if args.ghosts:
                lab.replicas[1].faults.drop_deletes(namespace=NAMESPACE)  # replica 1 misses every delete from now on
            ghosts = list(pool.map(lambda i: (f"ghost-{i}", api.create_namespaced_pod(
                NAMESPACE, pod_manifest(f"ghost-{i}", labels={"app": "soak"}), _request_timeout=10).metadata.uid), range(args.ghosts)))
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
