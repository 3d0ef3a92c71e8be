"""kubectl works against the lab without extra flags (issue 13, part 5): create, get, annotate, delete.

kubectl (v1.25+) validates by default: it reads /openapi/v3 and the group-version's document to
learn whether the server takes ``fieldValidation``; the lab serves both, so ``kubectl create -f``
needs no ``--validate=false`` and unknown fields are refused by the server (Strict).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from fixtures_lab import raw

from guard.lab.harness import quorum_pod

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
pytestmark = pytest.mark.skipif(not shutil.which(KUBECTL), reason="kubectl is not installed")

POD = """apiVersion: v1
kind: Pod
metadata:
  name: {name}
spec:
  containers:
  - name: app
    image: registry.k8s.io/pause:3.9
"""


def kubectl(lab, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KUBECTL, "--kubeconfig", lab.kubeconfig(0), *args], input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_kubectl_create_get_annotate_delete(shared_lab, lab_namespace):
    ns = lab_namespace
    r = kubectl(shared_lab, "create", "-n", ns, "-f", "-", stdin=POD.format(name="web-0"))
    assert (r.returncode, r.stdout.strip()) == (0, "pod/web-0 created"), r.stderr
    uid = quorum_pod(shared_lab.core_v1(1), "web-0", ns)["metadata"]["uid"]

    r = kubectl(shared_lab, "get", "-n", ns, "pod", "web-0", "-o", "jsonpath={.metadata.uid}")
    assert (r.returncode, r.stdout) == (0, uid), r.stderr
    r = kubectl(shared_lab, "get", "-n", ns, "pods", "-o", "name")
    assert (r.returncode, r.stdout.strip()) == (0, "pod/web-0"), r.stderr

    r = kubectl(shared_lab, "annotate", "-n", ns, "pod", "web-0", "example.com/touched=yes")
    assert r.returncode == 0, r.stderr
    assert quorum_pod(shared_lab.core_v1(1), "web-0", ns)["metadata"]["annotations"] == {"example.com/touched": "yes"}

    r = kubectl(shared_lab, "delete", "-n", ns, "pod", "web-0")  # waits for the pod to be gone (a WATCH)
    assert (r.returncode, r.stdout.strip()) == (0, 'pod "web-0" deleted'), r.stderr
    assert quorum_pod(shared_lab.core_v1(1), "web-0", ns) is None


def test_kubectl_create_refuses_an_unknown_field_through_the_server(shared_lab, lab_namespace):
    bad = POD.format(name="web-1").replace("metadata:\n", "metadata:\n  colour: blue\n")
    r = kubectl(shared_lab, "create", "-n", lab_namespace, "-f", "-", stdin=bad)
    assert r.returncode == 1
    assert 'strict decoding error: unknown field "metadata.colour"' in r.stderr
    assert quorum_pod(shared_lab.core_v1(1), "web-1", lab_namespace) is None


def test_openapi_v3_index_points_at_documents_that_name_each_kind(shared_lab):
    status, index = raw(shared_lab, 0, "GET", "/openapi/v3")
    assert status == 200
    assert sorted(index["paths"]) == ["api/v1", "apis/coordination.k8s.io/v1", "apis/discovery.k8s.io/v1",
                                      "apis/events.k8s.io/v1", "apis/kube-ghost-guard.io/v1alpha1"]
    status, doc = raw(shared_lab, 0, "GET", index["paths"]["api/v1"]["serverRelativeURL"])
    assert status == 200
    patch = doc["paths"]["/api/v1/namespaces/{namespace}/pods/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert "fieldValidation" in [p["name"] for p in patch["parameters"]]
    assert raw(shared_lab, 0, "GET", "/openapi/v3/apis/apps/v1")[0] == 404
    status, body = raw(shared_lab, 0, "POST", "/api/v1/namespaces/default/pods?fieldValidation=Loose",
                       body={"metadata": {"name": "x"}, "spec": {"containers": [{"name": "a", "image": "b"}]}})
    assert (status, body["reason"]) == (400, "BadRequest")


def test_kubectl_raw_writes_with_a_chunked_body_reach_the_admin_endpoint(lab):
    """``kubectl create --raw -f -`` streams its body chunked (Go's net/http takes it): a fault set by hand."""
    r = subprocess.run([KUBECTL, "--kubeconfig", lab.kubeconfig(1), "create", "--raw", "/lab/faults", "-f", "-"],
                       input='{"action": "freeze-watch"}', capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert lab.replicas[1].faults.watch_frozen
    lab.replicas[1].faults.unfreeze_watch()
