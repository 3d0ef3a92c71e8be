"""CPU of one quorum GET in the guard's process: ``Kube.quorum_get`` against the kubernetes client's own call.

The lab runs in its own process (benchmarks/soak_lab.py); this process makes the GETs of one
live pod, one at a time, and reads its *thread's* CPU time (``time.thread_time``), so the lab's
work and the machine's other load stay out of the figure. Blocks of GETs alternate between:

- ``client``: ``CoreV1Api.read_namespaced_pod(_preload_content=False)`` plus ``orjson.loads``
  (what ``Kube.quorum_get`` did before issue 15);
- ``urllib3``: the same GET through the client's urllib3 pool with its auth settings, no per-call
  validation or wrapping (what ``Kube.quorum_get`` did from issue 15's first cut until its own
  transport, and what it still does through a proxy);
- ``guard``: ``Kube.quorum_get`` (guard/kube/transport.py: kept-alive connections opened by urllib3 with
  the client's TLS settings, the reply parsed by httptools).

Run from the repository root: ``python -m benchmarks.quorum_get_cpu [--gets 2000]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import orjson
import urllib3

from benchmarks.soak_lab import LabProcess
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.lab.harness import pod_manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gets", type=int, default=2000, help="GETs per variant")
    ap.add_argument("--block", type=int, default=100, help="GETs per alternation block")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lab = LabProcess(f"{tmp}/lab", timeout=60)
        try:
            lab.core_v1(0).create_namespaced_pod("default", pod_manifest("p"), _request_timeout=10)
            kube = Kube(load_configuration(lab.kubeconfig(0)), timeout=5.0, pool_size=2)

            def client_get() -> None:
                resp = kube.core.read_namespaced_pod("p", "default", _preload_content=False, _request_timeout=5.0)
                orjson.loads(resp.data)

            def urllib3_get() -> None:
                resp = kube._pool.request("GET", kube._auth.host + kube._pod_path("default", "p"),
                                          headers=kube._headers(), timeout=urllib3.Timeout(total=5.0), retries=False,
                                          redirect=False, preload_content=True)
                assert orjson.loads(resp.data)["metadata"]["uid"]

            def guard_get() -> None:
                assert kube.quorum_get("default", "p").uid

            variants = {"client": client_get, "urllib3": urllib3_get, "guard": guard_get}
            cpu: dict[str, list[float]] = {k: [] for k in variants}
            wall: dict[str, list[float]] = {k: [] for k in variants}
            for fn in variants.values():  # warm both up: connections, imports
                for _ in range(20):
                    fn()
            for _ in range(args.gets // args.block):
                for name, fn in variants.items():
                    c0, w0 = time.thread_time(), time.perf_counter()
                    for _ in range(args.block):
                        fn()
                    cpu[name].append((time.thread_time() - c0) / args.block)
                    wall[name].append((time.perf_counter() - w0) / args.block)
            kube.close()
        finally:
            lab.close()
    print(f"{args.gets} GETs per variant, blocks of {args.block}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    print("| variant | CPU us per GET (median of blocks) | wall ms per GET (median of blocks) |\n|---|---:|---:|")
    for name in variants:
        print(f"| {name} | {statistics.median(cpu[name]) * 1e6:.0f} | {statistics.median(wall[name]) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
