"""What the etcd fault proxy adds to one etcd call: a Range through ``EtcdProxy`` against the same Range direct.

Real etcd (guard/lab/etcd.py); the proxy runs in a child process, as in the lab (the apiserver
replica's calls cross it, not this client's process). Blocks of Ranges of one small key alternate
between ``direct`` and ``proxy`` (one at a time, then ``--parallel`` client threads), so the
machine's other load falls on both alike. Prints the median and p90 latency per call and the
proxy process's CPU per call.

Run from the repository root: ``python -m benchmarks.etcd_proxy_overhead [--calls 2000]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import threading
import time
from typing import Any

from guard.lab.etcd import Etcd
from guard.lab.real import etcdwire as w
from guard.lab.real.etcdproxy import EtcdProxy  # first: it imports grpc without fork handlers

import grpc  # noqa: E402  (after etcdproxy, above)

KEY = b"/registry/pods/default/bench"


def _serve(upstream: str, ready: Any, stop: Any) -> None:
    with EtcdProxy(upstream) as proxy:
        ready.put(proxy.url)
        stop.wait()


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _block(call: Any, n: int, threads: int) -> list[float]:
    out: list[float] = []
    lock = threading.Lock()

    def run(k: int) -> None:
        mine = []
        for _ in range(k):
            t = time.perf_counter()
            call(w.encode_field(1, KEY), timeout=10)
            mine.append(time.perf_counter() - t)
        with lock:
            out.extend(mine)

    workers = [threading.Thread(target=run, args=(n // threads,)) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="Ranges per variant and concurrency")
    ap.add_argument("--block", type=int, default=200, help="Ranges per alternation block")
    ap.add_argument("--parallel", type=int, default=8, help="client threads of the concurrent run")
    args = ap.parse_args()
    ctx = multiprocessing.get_context("spawn")
    with Etcd() as etcd:
        upstream = f"127.0.0.1:{etcd.client_port}"
        ready, stop = ctx.Queue(), ctx.Event()
        child = ctx.Process(target=_serve, args=(upstream, ready, stop), daemon=True)
        child.start()
        try:
            url = ready.get(timeout=30)
            chans = {"direct": grpc.insecure_channel(upstream), "proxy": grpc.insecure_channel(url.removeprefix("http://"))}
            calls = {k: ch.unary_unary("/etcdserverpb.KV/Range") for k, ch in chans.items()}
            chans["direct"].unary_unary("/etcdserverpb.KV/Put")(w.encode_field(1, KEY) + w.encode_field(2, b"x" * 200))
            for threads in (1, args.parallel):
                lat: dict[str, list[float]] = {"direct": [], "proxy": []}
                cpu = 0.0
                for k in calls:  # warm up
                    _block(calls[k], 100, threads)
                done = 0
                while done < args.calls:
                    for k in ("direct", "proxy"):
                        before = _cpu(child.pid) if k == "proxy" else 0.0  # type: ignore[arg-type]
                        t0 = time.perf_counter()
                        got = _block(calls[k], args.block, threads)
                        wall = time.perf_counter() - t0
                        lat[k] += got
                        if k == "proxy":
                            cpu += _cpu(child.pid) - before  # type: ignore[arg-type]
                        lat.setdefault(k + "_wall", []).append(wall / len(got))
                    done += args.block
                print(f"client threads: {threads}")
                for k in ("direct", "proxy"):
                    xs = sorted(lat[k])
                    print(f"  {k:6}  median {statistics.median(xs) * 1e6:7.0f} us   p90 {xs[int(len(xs) * 0.9)] * 1e6:7.0f} us"
                          f"   calls/s {1 / statistics.mean(lat[k + '_wall']):7.0f}")
                added = statistics.median(lat["proxy"]) - statistics.median(lat["direct"])
                print(f"  added by the proxy: median {added * 1e6:.0f} us per call; proxy CPU "
                      f"{cpu / len(lat['proxy']) * 1e6:.0f} us per call")
        finally:
            stop.set()
            child.join(10)
            if child.is_alive():
                child.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
