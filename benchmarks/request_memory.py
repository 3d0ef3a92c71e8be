"""Peak memory of one guard worker for the largest requests it accepts.

For each shape, a fresh ``ghost-guard serve`` (defaults: ``--max-body-bytes``,
``--max-nodes``; an apiserver that does not answer, so every check fails open,
or with ``--fail-closed`` the reject path, which decodes every node name) gets
the request ``--repeat`` times; the worker's ``VmHWM`` (peak resident set,
/proc/PID/status) is read before and after. With ``--concurrent N`` the same
body is sent by N clients at once (the worker has 16 threads).

Run from the repository root: ``python -m benchmarks.request_memory [--concurrent 16]``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import threading
from pathlib import Path

import orjson

from guard.lab.harness import GuardProcess
from guard.core.settings import Settings

CAP = Settings().max_body_bytes
MAX_NODES = Settings().max_nodes


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {key} for {pid}")


def realistic_pod() -> dict:
    return {"metadata": {"name": "web-7d4b9c8f6d-x2x9q", "namespace": "default", "uid": "5d0e8a52-2f4e-4f8e-9c2a-7b1d2e3f4a5b",
                         "labels": {"app": "web", "pod-template-hash": "7d4b9c8f6d"}, "resourceVersion": "884213"},
            "spec": {"containers": [{"name": "web", "image": "registry.example.com/web:1.2.3",
                                     "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}}}],
                     "schedulerName": "default-scheduler", "priority": 0},
            "status": {"phase": "Pending", "qosClass": "Burstable"}}


def go_names_body(names: list[str]) -> bytes:
    """kube-scheduler's names-mode body, as Go's encoding/json writes it."""
    return b'{"Pod":' + orjson.dumps(realistic_pod()) + b',"Nodes":null,"NodeNames":' + orjson.dumps(names) + b"}"


def names_to_fill(limit: int, length: int = 63) -> list[str]:
    """As many distinct ``length``-character node names as fit in a names-mode body of ``limit`` bytes."""
    n = (limit - len(go_names_body([])) + 1) // (length + 3)
    return [f"node-{i:06d}-".ljust(length, "x") for i in range(n)]


def node(i: int, size: int) -> dict:
    item = {"metadata": {"name": f"node-{i:06d}", "labels": {"kubernetes.io/hostname": f"node-{i:06d}",
                                                            "topology.kubernetes.io/zone": "zone-a"}},
            "status": {"allocatable": {"cpu": "16", "memory": "64Gi", "pods": "110"}, "images": []}}
    pad = size - len(orjson.dumps(item))
    if pad > 0:
        item["metadata"]["annotations"] = {"pad": "p" * pad}
    return item


def shapes() -> dict[str, tuple[list[str], str, bytes]]:
    """name -> (extra serve flags, path, body); every body is within the default limits."""
    out: dict[str, tuple[list[str], str, bytes]] = {}
    n15k = [f"node-{i:06d}-".ljust(63, "x") for i in range(15_000)]
    out["names, 15,000 nodes x 63 chars (scheduler shape)"] = ([], "/filter", go_names_body(n15k))
    fill = names_to_fill(CAP)
    body = go_names_body(fill)
    out[f"names, body at the cap ({len(fill)} names)"] = ([], "/filter", body)
    out[f"names, body at the cap, --fail-closed (reject: every name decoded)"] = (["--fail-closed"], "/filter", body)
    other = orjson.dumps({"NodeNames": fill[:-2], "Nodes": None, "Pod": realistic_pod()})
    out["names, body at the cap, other key order (decoded whole)"] = ([], "/filter", other)
    per = (CAP - 2048) // MAX_NODES
    while True:  # the largest node objects that fit, MAX_NODES of them
        nodes = {"metadata": {"resourceVersion": "7"}, "items": [node(i, per) for i in range(MAX_NODES)]}
        body = orjson.dumps({"Pod": realistic_pod(), "Nodes": nodes, "NodeNames": None})
        if len(body) <= CAP:
            break
        per -= 1 + (len(body) - CAP) // MAX_NODES
    out[f"nodes, {MAX_NODES} nodes x {per} B (at both caps)"] = ([], "/filter", body)
    out[f"nodes, {MAX_NODES} nodes x {per} B, --fail-closed"] = (["--fail-closed"], "/filter", body)
    # Built to amplify memory: Python objects per JSON byte are largest for short strings
    # (4 bytes -> ~58) and empty arrays (2-3 bytes -> ~64-80), as dense as guard.core.extender.decode allows.
    head = orjson.dumps({"Pod": realistic_pod(), "Nodes": {"items": [{}] * MAX_NODES}, "NodeNames": None})[:-1]
    unit = b'[],"abc"'  # one array per 9 bytes with its separator: just within the limit (8)
    count = (CAP - len(head) - len(b',"x":[]}')) // (len(unit) + 1)
    bomb = head + b',"x":[' + b",".join([unit] * count) + b"]}"
    out["nodes mode + empty arrays and short strings at the cap (worst per byte)"] = ([], "/filter", bomb)
    unit = b"[" * 1000 + b"]" * 1000
    count = (CAP - len(head) - len(b',"x":[]}')) // (len(unit) + 1)
    bomb = head + b',"x":[' + b",".join([unit] * count) + b"]}"
    out["nodes mode + nested empty arrays at the cap (refused: 413)"] = ([], "/filter", bomb)
    victims = {f"node-{i:06d}-".ljust(63, "x"): {"Pods": [{"UID": f"{i:08d}-2f4e-4f8e-9c2a-7b1d2e3f4a5b"}],
                                                  "NumPDBViolations": 0} for i in range(40_000)}
    body = orjson.dumps({"Pod": realistic_pod(), "NodeNameToMetaVictims": victims})
    while len(body) > CAP:
        victims.popitem()
        body = orjson.dumps({"Pod": realistic_pod(), "NodeNameToMetaVictims": victims})
    out[f"preempt, {len(victims)} meta victims (at the cap)"] = ([], "/preempt", body)
    for name, (_, _, b) in out.items():
        assert len(b) <= CAP, (name, len(b))
    return out


def run(flags: list[str], path: str, body: bytes, repeat: int, concurrent: int, tmp: Path) -> dict:
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters:\n- name: dead\n  cluster: {server: 'http://127.0.0.1:9'}\n"
                          "users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: c\n  context: {cluster: dead, user: u}\n"
                          "current-context: c\n")
    with GuardProcess(["--kubeconfig", str(kubeconfig), "--get-timeout", "0.2", "--no-prepare", "--no-access-log",
                       "--audit-db", str(tmp / "audit.db"), *flags]) as g:
        g.wait("/healthz")
        (worker,) = g.workers()
        g.post("/filter", {"Pod": realistic_pod(), "NodeNames": ["warm-up"]})
        before = status_kb(worker, "VmHWM")
        codes = []

        def call() -> None:
            codes.append(g.post(path, body, timeout=30).status_code)

        for _ in range(repeat):
            threads = [threading.Thread(target=call) for _ in range(concurrent)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        after = status_kb(worker, "VmHWM")
        return {"codes": sorted(set(codes)), "before": before, "after": after, "rss": status_kb(worker, "VmRSS")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=1)
    ap.add_argument("-k", default="", help="only shapes whose name contains this")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}; --max-body-bytes {CAP}, "
          f"--max-nodes {MAX_NODES}; {args.concurrent} concurrent client(s), {args.repeat} round(s)\n")
    print("| request | body | replies | worker VmHWM before | after | peak increase |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name, (flags, path, body) in shapes().items():
            if args.k not in name:
                continue
            r = run(flags, path, body, args.repeat, args.concurrent, Path(d))
            print(f"| {name} | {len(body) / 2**20:.2f} MiB | {r['codes']} | {r['before'] / 1024:.1f} MiB | "
                  f"{r['after'] / 1024:.1f} MiB | {(r['after'] - r['before']) / 1024:.1f} MiB |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
