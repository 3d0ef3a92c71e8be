"""The lab serves GhostPods (kube-ghost-guard.io/v1alpha1) on the real apiserver's paths, with the
semantics of a CRD with a status subresource (apiextensions-apiserver customresource strategy):
a create drops the status, writes to the object ignore status changes, writes to /status ignore
everything else, metadata.generation counts spec changes; LIST/WATCH rv=0 from the watch cache,
GET without resourceVersion from etcd; discovery and the Table kubectl prints."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from fixtures_lab import raw

G, V, P = "kube-ghost-guard.io", "v1alpha1", "ghostpods"
pytestmark = pytest.mark.timeout(60)


def body(name: str, **status) -> dict:
    obj = {"apiVersion": f"{G}/{V}", "kind": "GhostPod", "metadata": {"name": name},
           "spec": {"podName": "web-0", "podUID": "u-1", "verdict": "ghost-deleted", "evidence": {"quorum_get": {"http_status": 404}}}}
    if status:
        obj["status"] = status
    return obj


def path(ns: str, name: str = "", sub: str = "") -> str:
    return f"/apis/{G}/{V}/namespaces/{ns}/{P}" + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def test_create_drops_status_and_sets_generation(shared_lab, lab_namespace):
    api = client.CustomObjectsApi(shared_lab.api_client(0))
    made = api.create_namespaced_custom_object(G, V, lab_namespace, P, body("a", timesBlocked=7))
    assert "status" not in made
    assert made["metadata"]["generation"] == 1 and made["metadata"]["uid"]
    got = api.get_namespaced_custom_object(G, V, lab_namespace, P, "a")
    assert got["spec"]["podName"] == "web-0" and "status" not in got
    with pytest.raises(ApiException) as e:
        api.create_namespaced_custom_object(G, V, lab_namespace, P, body("a"))
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "AlreadyExists"


def test_status_and_main_resource_writes_ignore_each_other(shared_lab, lab_namespace):
    api = client.CustomObjectsApi(shared_lab.api_client(0))
    api.create_namespaced_custom_object(G, V, lab_namespace, P, body("b"))
    # merge patch of /status: only the status changes (the spec change in the same patch is ignored)
    out = api.patch_namespaced_custom_object_status(G, V, lab_namespace, P, "b",
                                                    {"spec": {"verdict": "terminating"}, "status": {"timesBlocked": 2}},
                                                    _content_type="application/merge-patch+json")
    assert out["status"] == {"timesBlocked": 2} and out["spec"]["verdict"] == "ghost-deleted"
    assert out["metadata"]["generation"] == 1
    # JSON patch of the object: the spec changes (generation + 1), the status change is ignored
    out = api.patch_namespaced_custom_object(G, V, lab_namespace, P, "b",
                                             [{"op": "replace", "path": "/spec/verdict", "value": "terminating"},
                                              {"op": "replace", "path": "/status/timesBlocked", "value": 99}],
                                             _content_type="application/json-patch+json")
    assert out["spec"]["verdict"] == "terminating" and out["status"] == {"timesBlocked": 2}
    assert out["metadata"]["generation"] == 2
    # update (PUT) of the object without a spec change: generation unchanged; status kept
    cur = api.get_namespaced_custom_object(G, V, lab_namespace, P, "b")
    cur["metadata"].setdefault("labels", {})["x"] = "y"
    cur.pop("status")
    out = api.replace_namespaced_custom_object(G, V, lab_namespace, P, "b", cur)
    assert out["metadata"]["generation"] == 2 and out["status"] == {"timesBlocked": 2}
    # update of /status with a stale resourceVersion: 409 Conflict
    stale = dict(cur, status={"timesBlocked": 5})
    with pytest.raises(ApiException) as e:
        api.replace_namespaced_custom_object_status(G, V, lab_namespace, P, "b", stale)
    assert e.value.status == 409 and json.loads(e.value.body)["reason"] == "Conflict"
    # a merge patch carrying the current resourceVersion applies; an old one conflicts
    rv = out["metadata"]["resourceVersion"]
    out = api.patch_namespaced_custom_object_status(G, V, lab_namespace, P, "b",
                                                    {"metadata": {"resourceVersion": rv}, "status": {"timesBlocked": 3}},
                                                    _content_type="application/merge-patch+json")
    assert out["status"]["timesBlocked"] == 3
    with pytest.raises(ApiException) as e:
        api.patch_namespaced_custom_object_status(G, V, lab_namespace, P, "b",
                                                  {"metadata": {"resourceVersion": rv}, "status": {"timesBlocked": 4}},
                                                  _content_type="application/merge-patch+json")
    assert e.value.status == 409


def test_list_watch_from_cache_get_from_etcd_delete_with_preconditions(shared_lab, lab_namespace):
    api = client.CustomObjectsApi(shared_lab.api_client(1))
    made = api.create_namespaced_custom_object(G, V, lab_namespace, P, body("c"))
    assert shared_lab.wait_synced()
    shared_lab.replicas[1].clear_requests()
    listed = api.list_cluster_custom_object(G, V, P, resource_version="0")
    assert "c" in [o["metadata"]["name"] for o in listed["items"] if o["metadata"]["namespace"] == lab_namespace]
    api.get_namespaced_custom_object(G, V, lab_namespace, P, "c")
    sources = {(r.method, r.path): r.source for r in shared_lab.replicas[1].requests()}
    assert sources[("GET", f"/apis/{G}/{V}/{P}")] == "cache"
    assert sources[("GET", path(lab_namespace, "c"))] == "etcd"
    status, doc = raw(shared_lab, 1, "GET", path(lab_namespace) + "?watch=true&resourceVersion=0&timeoutSeconds=1")
    assert status == 200
    with pytest.raises(ApiException) as e:  # a precondition on another uid: nothing deleted
        api.delete_namespaced_custom_object(G, V, lab_namespace, P, "c", body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid="other")))
    assert e.value.status == 409
    api.delete_namespaced_custom_object(G, V, lab_namespace, P, "c", body=client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=made["metadata"]["uid"])))
    with pytest.raises(ApiException) as e:
        api.get_namespaced_custom_object(G, V, lab_namespace, P, "c")
    assert e.value.status == 404 and json.loads(e.value.body)["details"]["kind"] == P


def test_watch_stream_carries_ghostpod_events(shared_lab, lab_namespace):
    from kubernetes import watch

    api = client.CustomObjectsApi(shared_lab.api_client(2))
    listed = api.list_namespaced_custom_object(G, V, lab_namespace, P, resource_version="0")
    api.create_namespaced_custom_object(G, V, lab_namespace, P, body("d"))
    w = watch.Watch()
    seen = []
    for ev in w.stream(api.list_namespaced_custom_object, G, V, lab_namespace, P,
                       resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=3):
        seen.append((ev["type"], ev["object"]["metadata"]["name"]))
        if seen:
            w.stop()
    assert seen == [("ADDED", "d")]


def test_discovery_serves_the_group_and_the_status_subresource(shared_lab):
    status, groups = raw(shared_lab, 0, "GET", "/apis")
    (group,) = [g for g in groups["groups"] if g["name"] == G]
    assert group["preferredVersion"] == {"groupVersion": f"{G}/{V}", "version": V}
    status, resources = raw(shared_lab, 0, "GET", f"/apis/{G}/{V}")
    assert status == 200
    names = {r["name"]: r for r in resources["resources"]}
    assert names[P]["namespaced"] is True and names[P]["kind"] == "GhostPod" and names[P]["shortNames"] == ["gp"]
    assert names[f"{P}/status"]["verbs"] == ["get", "patch", "update"]


def test_table_has_the_printer_columns(shared_lab, lab_namespace):
    api = client.CustomObjectsApi(shared_lab.api_client(0))
    api.create_namespaced_custom_object(G, V, lab_namespace, P, body("e"))
    api.patch_namespaced_custom_object_status(G, V, lab_namespace, P, "e",
                                              {"status": {"timesBlocked": 3, "staleReplicas": "127.0.0.2:6443"}},
                                              _content_type="application/merge-patch+json")
    status, doc = raw(shared_lab, 0, "GET", path(lab_namespace),
                      headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"})
    assert status == 200 and doc["kind"] == "Table"
    assert [c["name"] for c in doc["columnDefinitions"]] == ["Name", "Pod", "Verdict", "Stale Replicas",
                                                             "Times Blocked", "Last Seen", "Age"]
    (row,) = doc["rows"]
    assert row["cells"][:6] == ["e", "web-0", "ghost-deleted", "127.0.0.2:6443", 3, None]
    assert row["object"]["metadata"]["namespace"] == lab_namespace


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kubectl_get_ghostpods(shared_lab, lab_namespace):
    api = client.CustomObjectsApi(shared_lab.api_client(0))
    api.create_namespaced_custom_object(G, V, lab_namespace, P, body("f"))
    out = subprocess.run(["kubectl", "--kubeconfig", shared_lab.kubeconfig(0), "get", "ghostpods", "-A"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split() == ["NAMESPACE", "NAME", "POD", "VERDICT", "STALE", "REPLICAS", "TIMES", "BLOCKED",
                              "LAST", "SEEN", "AGE"]
    assert any(r.split()[:4] == [lab_namespace, "f", "web-0", "ghost-deleted"] for r in rows), out.stdout
