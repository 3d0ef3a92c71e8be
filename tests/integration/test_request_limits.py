"""Memory per request, at the default limits (one real ``ghost-guard serve``, over HTTP).

The apiserver does not answer (every check fails open), so this needs no lab. kube-scheduler's
names-mode body for 15,000 nodes fits; a body over ``--max-body-bytes``, a nodes-mode body with
more than ``--max-nodes`` items and a body built to amplify memory each get a 413 with a reason;
16 clients sending the largest accepted bodies at once keep the worker well under the
Deployment's 512 Mi memory limit. The figures are in docs/RELIABILITY.md
(``benchmarks/request_memory.py``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import orjson
import pytest
import yaml

from guard.core.settings import Settings

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
POD = {"metadata": {"name": "web-1", "namespace": "default", "uid": "0b7e-uid"}}


def container_limit_kib() -> int:
    doc = yaml.safe_load((REPO / "manifests/base/deployment.yaml").read_text())
    (container,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "ghost-guard"]
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Mi"), limit
    return int(limit[:-2]) * 1024


def vm_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


@pytest.fixture(scope="module")
def guard(tmp_path_factory, module_guard):
    tmp = tmp_path_factory.mktemp("limits")
    kubeconfig = tmp / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\nclusters:\n- name: dead\n  cluster: {server: 'http://127.0.0.1:9'}\n"
                          "users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: c\n  context: {cluster: dead, user: u}\n"
                          "current-context: c\n")
    # --fail-closed: every pod is rejected, so a names-mode reply names every node (the costliest reply)
    return module_guard(["--kubeconfig", str(kubeconfig), "--get-timeout", "0.2", "--no-prepare", "--fail-closed",
                         "--audit-db", str(tmp / "audit.db")], clean_env=True, wait="/healthz")


def go_names_body(names: list[str]) -> bytes:
    """kube-scheduler's names-mode body, in Go's field order."""
    return b'{"Pod":' + orjson.dumps(POD) + b',"Nodes":null,"NodeNames":' + orjson.dumps(names) + b"}"


def test_scheduler_body_for_15000_nodes_fits(guard):
    names = [f"node-{i:05d}-".ljust(63, "x") for i in range(15_000)]
    body = go_names_body(names)
    assert len(body) < Settings().max_body_bytes / 3
    reply = guard.post("/filter", body).json()
    assert sorted(reply["FailedAndUnresolvableNodes"]) == names  # --fail-closed: every node named


def test_longest_node_names_for_15000_nodes_fit(guard):
    names = [f"node-{i:05d}.".ljust(253, "x") for i in range(15_000)]  # 253: a DNS subdomain's most
    reply = guard.post("/filter", go_names_body(names))
    assert reply.status_code == 200, reply.text[:300]
    assert len(reply.json()["FailedAndUnresolvableNodes"]) == 15_000


def test_body_over_the_default_limit_is_413(guard):
    limit = Settings().max_body_bytes
    body = go_names_body(["n"]) + b" " * (limit - len(go_names_body(["n"])) + 1)
    assert len(body) == limit + 1
    resp = guard.post("/filter", body)
    assert resp.status_code == 413
    assert resp.json() == {"error": f"request body of {limit + 1} bytes is larger than the limit ({limit} bytes, "
                                    "--max-body-bytes)"}
    at_limit = guard.post("/filter", body[:-1])
    assert at_limit.status_code == 200, at_limit.text[:300]


def nodes_body(count: int) -> bytes:
    items = [{"metadata": {"name": f"node-{i}", "labels": {"zone": "a"}}, "status": {"capacity": {"cpu": "8"}}}
             for i in range(count)]
    return orjson.dumps({"Pod": POD, "Nodes": {"metadata": {}, "items": items}, "NodeNames": None})


def test_nodes_mode_over_the_item_limit_is_413(guard):
    limit = Settings().max_nodes
    resp = guard.post("/filter", nodes_body(limit + 1))
    assert resp.status_code == 413
    assert resp.json()["error"].startswith(f"Nodes.items has {limit + 1} nodes, more than the limit of {limit} "
                                           "(--max-nodes)")
    ok = guard.post("/filter", nodes_body(limit))
    assert ok.status_code == 200, ok.text[:300]
    assert len(ok.json()["FailedAndUnresolvableNodes"]) == limit


@pytest.mark.parametrize("path", ["/filter", "/preempt", "/validate/binding"])
def test_body_built_to_amplify_memory_is_413(guard, path):
    body = b'{"x":[' + b",".join([b"[]"] * 200_000) + b"]}"  # 600 kB: 200,000 empty lists, ~16 MB in Python
    resp = guard.post(path, body)
    assert resp.status_code == 413, resp.text[:300]
    assert resp.json() == {"error": f"request body has 200002 JSON objects or arrays in {len(body)} bytes, more than "
                                    "one per 8 bytes; no scheduler or apiserver request is shaped so"}


def test_largest_bodies_at_once_stay_under_the_container_limit(guard):
    """16 clients (the worker's threads), each the largest accepted names-mode body (--max-nodes names as
    long as --max-body-bytes allows), rejected on every node. From one address they take a pool thread
    one at a time (the others wait their turn; a 503 when it does not come within the budget)."""
    limit, count = Settings().max_body_bytes, Settings().max_nodes
    length = (limit - len(go_names_body([]))) // count - 3
    names = [f"node-{i:06d}-".ljust(length, "x") for i in range(count)]
    body = go_names_body(names)
    assert limit - count < len(body) <= limit
    (worker,) = guard.workers()
    codes: list[int] = []

    def call() -> None:
        codes.append(guard.post("/filter", body, timeout=30).status_code)

    for _ in range(2):
        threads = [threading.Thread(target=call) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    peak = vm_kib(worker, "VmHWM")
    print(f"\nworker peak RSS (VmHWM) after 32 bodies of {len(body)} bytes, 16 at a time: {peak / 1024:.1f} MiB")
    assert 200 in codes and set(codes) <= {200, 503}, codes  # 503: waited 1 s for room, with the reason
    assert peak < container_limit_kib() * 0.8, f"{peak} kB"
    # the guard still answers a small call at once
    assert guard.post("/filter", go_names_body(["a", "b"])).status_code == 200
