"""POST pods/NAME/binding: an etcd transaction with the apiserver's exact Status bodies
(BindingREST, pkg/registry/core/pod/storage/storage.go).

The official client's ``create_namespaced_pod_binding`` can't decode the
Success ``Status`` a real apiserver answers (it expects a Binding), so the
successful binds here go through ``_preload_content=False``, like real callers.
"""

from __future__ import annotations

import json

import pytest
from kubernetes.client import ApiException

from fixtures_lab import raw

from guard.lab.harness import make_ghost, pod_manifest


def binding(name: str, node: str, uid: str | None = None) -> dict:
    meta: dict = {"name": name}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "v1", "kind": "Binding", "metadata": meta, "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


def bind(api, ns: str, name: str, node: str, uid: str | None = None):
    return api.create_namespaced_pod_binding(name, ns, binding(name, node, uid), _preload_content=False, _request_timeout=5)


def status_of(excinfo) -> dict:
    return json.loads(excinfo.value.body)


def test_bind_sets_node_and_pod_scheduled(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    uid = api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5).metadata.uid
    resp = bind(api, lab_namespace, "p", "node-a", uid)
    assert resp.status == 201
    assert json.loads(resp.data) == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
    pod = api.read_namespaced_pod("p", lab_namespace, _request_timeout=5)
    assert pod.spec.node_name == "node-a"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "True")]


def test_bind_missing_pod_is_404(shared_lab, lab_namespace):
    with pytest.raises(ApiException) as e:
        bind(shared_lab.core_v1(1), lab_namespace, "nope", "node-a")
    assert e.value.status == 404
    assert status_of(e) == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": 'pods "nope" not found', "reason": "NotFound",
                            "details": {"name": "nope", "kind": "pods"}, "code": 404}


def test_bind_a_ghost_is_404_on_the_stale_replica_too(lab):
    make_ghost(lab, "default", "web-1", stale=1)
    with pytest.raises(ApiException) as e:
        bind(lab.core_v1(1), "default", "web-1", "node-a")
    assert e.value.status == 404
    assert status_of(e)["message"] == 'pods "web-1" not found'


def test_bind_uid_precondition_mismatch_is_409(shared_lab, lab_namespace):
    ns = lab_namespace
    api = shared_lab.core_v1(0)
    old_uid = api.create_namespaced_pod(ns, pod_manifest("p"), _request_timeout=5).metadata.uid
    api.delete_namespaced_pod("p", ns, grace_period_seconds=0, _request_timeout=5)
    new_uid = api.create_namespaced_pod(ns, pod_manifest("p"), _request_timeout=5).metadata.uid
    with pytest.raises(ApiException) as e:
        bind(api, ns, "p", "node-a", old_uid)
    assert e.value.status == 409
    assert status_of(e) == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": f'Operation cannot be fulfilled on pods "p": StorageError: invalid object, Code: 4, '
                   f"Key: /registry/pods/{ns}/p, ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: "
                   f"UID in precondition: {old_uid}, UID in object meta: {new_uid}",
        "reason": "Conflict", "details": {"name": "p", "kind": "pods"}, "code": 409}


def test_bind_already_bound_is_409(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    bind(api, lab_namespace, "p", "node-a")
    with pytest.raises(ApiException) as e:
        bind(shared_lab.core_v1(2), lab_namespace, "p", "node-b")
    assert e.value.status == 409
    assert status_of(e) == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": 'Operation cannot be fulfilled on pods/binding "p": pod p is already assigned to node "node-a"',
                            "reason": "Conflict", "details": {"name": "p", "kind": "pods/binding"}, "code": 409}


def test_bind_terminating_pod_is_409(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("p", finalizers=["lab.test/hold"]), _request_timeout=5)
    deleted = api.delete_namespaced_pod("p", lab_namespace, _request_timeout=5)
    assert deleted.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as e:
        bind(api, lab_namespace, "p", "node-a")
    assert e.value.status == 409
    assert status_of(e)["message"] == 'Operation cannot be fulfilled on pods/binding "p": pod p is being deleted, cannot be assigned to a host'
    assert status_of(e)["details"] == {"name": "p", "kind": "pods/binding"}
    # dropping the finalizer lets the deletion finish
    api.patch_namespaced_pod("p", lab_namespace, {"metadata": {"finalizers": None}},
                             _content_type="application/merge-patch+json", _request_timeout=5)
    with pytest.raises(ApiException) as e:
        api.read_namespaced_pod("p", lab_namespace, _request_timeout=5)
    assert e.value.status == 404


def test_bind_rejects_bad_input_with_4xx(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    path = f"/api/v1/namespaces/{lab_namespace}/pods/p/binding"
    assert raw(shared_lab, 0, "POST", path, body=b"{not json")[0] == 400
    assert raw(shared_lab, 0, "POST", path, body=binding("other", "node-a"))[0] == 400
    status, body = raw(shared_lab, 0, "POST", path, body={"metadata": {"name": "p"}, "target": {}})
    assert (status, body["reason"]) == (422, "Invalid")
