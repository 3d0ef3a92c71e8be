"""How long ``ghost-guard heal`` takes on the lab, and how many writes it makes.

On a lab (real etcd, 3 apiserver replicas): for each round, a *deleted* ghost (replica 1 lost the pod's
delete, its watch flows on) and a *replaced* ghost (replica 1 lost the delete and the re-creation under
the same name) are made, then healed in-process by :class:`guard.engine.healer.Healer` with the CLI's clients
(one ``Kube`` on replica 0, one client per replica). Reported per kind: the heal's own time (first read
to the last replica agreeing; what the CLI prints), the time from the first write until the stale
replica agreed, the writes per heal (from replica 0's request log: POST, PATCH, DELETE on pods) and the
outcomes. The CLI's process start (importing the kubernetes client) is not included.

Run from the repository root: ``python -m benchmarks.heal_time [--rounds 20]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()

    from guard.engine.healer import Healer
    from guard.kube.config import load_configuration
    from guard.kube.reads import Kube
    from guard.lab import Lab
    from guard.lab.harness import pod_manifest
    from guard.engine.replicas import ReplicaPool
    from guard.core.settings import Settings

    results: dict[str, list] = {"deleted": [], "replaced": []}
    with Lab(replicas=3) as lab:
        api = lab.core_v1(2)
        kube = Kube(load_configuration(lab.kubeconfig(0)), timeout=2.0, pool_size=8)
        pool = ReplicaPool(Settings(probe_timeout=2.0), kube)
        healer = Healer(kube, pool.clients, timeout=10.0)
        stale = lab.replicas[1]
        for i in range(args.rounds):
            for kind in ("deleted", "replaced"):
                name = f"{kind}-{i}"
                api.create_namespaced_pod("default", pod_manifest(name), _request_timeout=5)
                assert lab.wait_synced()
                stale.faults.drop_deletes(namespace="default", name=name, count=1)
                if kind == "replaced":
                    stale.faults.drop_creates(namespace="default", name=name, count=1)
                api.delete_namespaced_pod(name, "default", _request_timeout=5)
                if kind == "replaced":
                    api.create_namespaced_pod("default", pod_manifest(name, node_name="node-a"), _request_timeout=5)
                assert lab.wait_synced()
                stale.faults.clear()
                lab.replicas[0].clear_requests()
                r = healer.heal("default", name)
                writes = [q for q in lab.replicas[0].requests() if q.method in ("POST", "PATCH", "DELETE")
                          and q.path.startswith("/api/v1/namespaces/default/pods")]
                row = next(x for x in r.replicas if x.replica == f"{stale.ip}:{stale.port}")
                results[kind].append((r.outcome.value, r.action.value, r.seconds, row.seconds, len(writes)))
        healer.close()
        pool.close()
        kube.close()

    print(f"# heal on the lab: {args.rounds} rounds, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    print(f"{'kind':9} {'outcomes':22} {'writes':7} {'heal p50':>9} {'heal max':>9} {'stale replica agreed p50/max':>30}")
    for kind, rows in results.items():
        outcomes = {f"{o}/{a}": sum(1 for r in rows if (r[0], r[1]) == (o, a)) for o, a, *_ in rows}
        heal = [r[2] for r in rows]
        agreed = [r[3] for r in rows if r[3] is not None]
        writes = sorted({r[4] for r in rows})
        print(f"{kind:9} {','.join(f'{k}={v}' for k, v in outcomes.items()):22} {'/'.join(map(str, writes)):7} "
              f"{statistics.median(heal):8.3f}s {max(heal):8.3f}s "
              f"{statistics.median(agreed):14.3f}s / {max(agreed):.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
