"""The real backend starts: N real kube-apiservers on one etcd, one port, 127.0.0.1..N, kubeconfigs shaped
like the Python lab's, caches that reach etcd's revision, and the Node taint the harness lifts."""

from __future__ import annotations

import json
import subprocess

from guard.lab.harness import create, eventually, node_manifest, pod_manifest


def test_replicas_serve_one_etcd(real_lab, real_namespace):
    lab = real_lab
    assert lab.urls == [f"https://127.0.0.1:{lab.port}", f"https://127.0.0.2:{lab.port}"]
    version = json.loads(lab.raw_get(1, "/version")[1])
    assert version["gitVersion"].startswith("v1.")
    pod = create(lab.core_v1(0), pod_manifest("smoke", namespace=real_namespace))
    assert lab.wait_synced(20)
    cached = lab.cached_pod(1, real_namespace, "smoke")
    assert cached is not None and cached["metadata"]["uid"] == pod["metadata"]["uid"]
    # The real apiserver refuses what the Python lab once accepted: a comma in a pod name.
    from kubernetes.client.exceptions import ApiException

    try:
        create(lab.core_v1(0), pod_manifest("a,b", namespace=real_namespace))
        raise AssertionError("a pod name with a comma was accepted")
    except ApiException as e:
        assert e.status == 422


def test_kubeconfig_works_with_kubectl(real_lab, real_namespace):
    out = subprocess.run(["kubectl", "--kubeconfig", real_lab.kubeconfig(1), "get", "namespace", real_namespace, "-o", "name"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"namespace/{real_namespace}"


def test_created_node_is_ready_and_untainted(real_lab):
    node = create(real_lab.core_v1(0), node_manifest("smoke-node"))
    assert not (node["spec"].get("taints") or [])
    got = eventually(lambda: real_lab.core_v1(1).read_node("smoke-node", _request_timeout=5), 20, what="node on replica 1")
    assert not got.spec.taints


def test_replica_stop_and_start(real_lab):
    r = real_lab.replicas[1]
    r.stop()
    assert not r.running
    assert real_lab.wait_synced(10)  # a stopped replica is not waited for
    r.start()
    assert r.running and real_lab.wait_synced(30)


def test_pods_need_their_namespace_and_its_default_service_account(real_lab):
    """Why ``ensure_namespace`` exists: the real admission chain refuses both (the Python lab accepts both)."""
    from kubernetes.client.exceptions import ApiException

    api = real_lab.core_v1(0)
    for namespace, status, message in (("smoke-none", 404, 'namespaces "smoke-none" not found'),
                                       ("smoke-nosa", 403, 'serviceaccount "default" not found')):
        if status == 403:
            api.create_namespace({"metadata": {"name": namespace}}, _request_timeout=10)
        try:
            create(api, pod_manifest("p", namespace=namespace))
            raise AssertionError(f"a pod in {namespace} was accepted")
        except ApiException as e:
            assert (e.status, message in json.loads(e.body)["message"]) == (status, True), e.body
    real_lab.ensure_namespace("smoke-nosa")
    assert create(api, pod_manifest("p", namespace="smoke-nosa"))["metadata"]["namespace"] == "smoke-nosa"
