"""Writes through a replica: create, patch, update, delete, nodes, events (core and events.k8s.io)."""

from __future__ import annotations

import json

import pytest
from kubernetes.client import ApiException

from fixtures_lab import raw

from guard.lab.harness import pod_manifest


def test_create_fills_metadata_and_defaults(shared_lab, lab_namespace):
    pod = shared_lab.core_v1(1).create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    assert pod.metadata.namespace == lab_namespace
    assert pod.metadata.uid and pod.metadata.creation_timestamp is not None
    assert int(pod.metadata.resource_version) > 0
    assert (pod.status.phase, pod.spec.scheduler_name, pod.spec.priority) == ("Pending", "default-scheduler", 0)
    generated = shared_lab.core_v1(1).create_namespaced_pod(
        lab_namespace, {"metadata": {"generateName": "gen-"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        _request_timeout=5)
    assert generated.metadata.name.startswith("gen-") and len(generated.metadata.name) == 9


def test_create_errors(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    with pytest.raises(ApiException) as e:
        api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    assert e.value.status == 409
    assert '"reason":"AlreadyExists"' in e.value.body and 'pods \\"p\\" already exists' in e.value.body
    path = f"/api/v1/namespaces/{lab_namespace}/pods"
    status, body = raw(shared_lab, 0, "POST", path, body={"metadata": {"name": "x"}, "spec": {}})
    assert (status, body["reason"], body["message"]) == (422, "Invalid", 'Pod "x" is invalid: spec.containers: Required value: ')
    status, body = raw(shared_lab, 0, "POST", path, body={"metadata": {"name": "x", "namespace": "elsewhere"},
                                                          "spec": {"containers": [{"name": "c"}]}})
    assert (status, body["reason"]) == (400, "BadRequest")
    assert raw(shared_lab, 0, "POST", path, body=b"[1,2")[0] == 400


def test_status_patches_merge_and_strategic(shared_lab, lab_namespace):
    ns = lab_namespace
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(ns, pod_manifest("p"), _request_timeout=5)
    cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
    api.patch_namespaced_pod_status("p", ns, {"status": {"conditions": [cond]}},
                                    _content_type="application/strategic-merge-patch+json", _request_timeout=5)
    api.patch_namespaced_pod_status("p", ns, {"status": {"conditions": [{"type": "Ready", "status": "False"}],
                                                         "nominatedNodeName": "n1"}, "spec": {"nodeName": "sneaky"}},
                                    _content_type="application/strategic-merge-patch+json", _request_timeout=5)
    pod = api.read_namespaced_pod("p", ns, _request_timeout=5)
    assert [(c.type, c.status) for c in pod.status.conditions] == [("PodScheduled", "False"), ("Ready", "False")]
    assert pod.status.nominated_node_name == "n1"
    assert pod.spec.node_name is None  # a status patch changes only the status
    api.patch_namespaced_pod_status("p", ns, {"status": {"nominatedNodeName": None}},
                                    _content_type="application/merge-patch+json", _request_timeout=5)
    assert api.read_namespaced_pod("p", ns, _request_timeout=5).status.nominated_node_name is None


def test_patch_content_types(shared_lab, lab_namespace):
    ns = lab_namespace
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(ns, pod_manifest("p", labels={"a": "1"}), _request_timeout=5)
    api.patch_namespaced_pod("p", ns, [{"op": "add", "path": "/metadata/labels/b", "value": "2"}], _request_timeout=5)
    assert api.read_namespaced_pod("p", ns, _request_timeout=5).metadata.labels == {"a": "1", "b": "2"}
    # The client sends a dict body as a strategic merge patch (a list as JSON patch).
    api.patch_namespaced_pod("p", ns, {"metadata": {"labels": {"c": "3"}}}, _request_timeout=5)
    assert api.read_namespaced_pod("p", ns, _request_timeout=5).metadata.labels == {"a": "1", "b": "2", "c": "3"}
    status, body = raw(shared_lab, 0, "PATCH", f"/api/v1/namespaces/{ns}/pods/p", body={"metadata": {}},
                       headers={"Content-Type": "application/json-patch+json"})
    assert (status, body["reason"]) == (400, "BadRequest")
    status, body = raw(shared_lab, 0, "PATCH", f"/api/v1/namespaces/{ns}/pods/p", body={"metadata": {}},
                       headers={"Content-Type": "text/plain"})
    assert (status, body["reason"]) == (415, "UnsupportedMediaType")
    status, body = raw(shared_lab, 0, "PATCH", f"/api/v1/namespaces/{ns}/pods/nope/status", body={"status": {}},
                       headers={"Content-Type": "application/merge-patch+json"})
    assert (status, body["message"]) == (404, 'pods "nope" not found')


def test_update_uses_optimistic_concurrency(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    node = api.create_node({"metadata": {"name": f"{lab_namespace}-n", "labels": {"zone": "a"}}}, _request_timeout=5)
    node.metadata.labels = {"zone": "b"}
    updated = api.replace_node(node.metadata.name, node, _request_timeout=5)
    assert updated.metadata.labels == {"zone": "b"}
    with pytest.raises(ApiException) as e:
        api.replace_node(node.metadata.name, node, _request_timeout=5)  # stale resourceVersion
    assert e.value.status == 409
    assert "the object has been modified; please apply your changes to the latest version and try again" in e.value.body


def test_delete_with_uid_precondition(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    with pytest.raises(ApiException) as e:
        api.delete_namespaced_pod("p", lab_namespace, body={"preconditions": {"uid": "not-it"}}, _request_timeout=5)
    assert e.value.status == 409
    # rest.BeforeDelete's message, as the real v1.36 apiserver answers (docs/LAB.md "Lab fidelity")
    uid = api.read_namespaced_pod("p", lab_namespace, _request_timeout=5).metadata.uid
    assert json.loads(e.value.body)["message"] == (
        f'Operation cannot be fulfilled on Pod "p": the UID in the precondition (not-it) does not match the UID in '
        f"record ({uid}). The object might have been deleted and then recreated")
    assert json.loads(e.value.body)["details"] == {"name": "p", "kind": "Pod"}
    deleted = api.delete_namespaced_pod("p", lab_namespace, grace_period_seconds=0, _request_timeout=5)
    assert deleted.metadata.name == "p"
    with pytest.raises(ApiException) as e:
        api.delete_namespaced_pod("p", lab_namespace, _request_timeout=5)
    assert e.value.status == 404


def test_nodes_create_get_list(shared_lab, lab_namespace):
    api = shared_lab.core_v1(2)
    name = f"{lab_namespace}-node"
    api.create_node({"metadata": {"name": name, "labels": {"t": lab_namespace}},
                     "status": {"allocatable": {"cpu": "4", "memory": "8Gi", "pods": "110"}}}, _request_timeout=5)
    assert api.read_node(name, _request_timeout=5).status.allocatable == {"cpu": "4", "memory": "8Gi", "pods": "110"}
    listed = api.list_node(label_selector=f"t={lab_namespace}", _request_timeout=5)
    assert [n.metadata.name for n in listed.items] == [name]
    status = api.delete_node(name, _request_timeout=5)  # a Status (this client version hands back the dict)
    status = status if isinstance(status, dict) else status.to_dict()
    assert (status["status"], status["details"]["name"], status["details"]["kind"]) == ("Success", name, "nodes")


def test_events_core_and_events_k8s_io_share_storage(shared_lab, lab_namespace):
    ns = lab_namespace
    core = shared_lab.core_v1(0)
    core.create_namespaced_event(ns, {
        "metadata": {"name": "e1"}, "involvedObject": {"kind": "Pod", "namespace": ns, "name": "p", "uid": "u1"},
        "reason": "FailedScheduling", "message": "0/3 nodes are available", "type": "Warning",
        "source": {"component": "default-scheduler"},
        # events.k8s.io/v1 requires eventTime: the official client can't decode an old-style event without it
        "eventTime": "2026-01-01T00:00:00.000000Z"}, _request_timeout=5)
    shared_lab.events_v1(1).create_namespaced_event(ns, {
        "metadata": {"name": "e2"}, "eventTime": "2026-01-01T00:00:00.000000Z", "reportingController": "default-scheduler",
        "reportingInstance": "default-scheduler-lab", "action": "Scheduling", "reason": "FailedScheduling",
        "regarding": {"kind": "Pod", "namespace": ns, "name": "p", "uid": "u1"}, "note": "ghost", "type": "Warning"},
        _request_timeout=5)
    listed = core.list_namespaced_event(ns, field_selector="involvedObject.name=p,reason=FailedScheduling", _request_timeout=5)
    assert sorted((e.metadata.name, e.message) for e in listed.items) == [("e1", "0/3 nodes are available"), ("e2", "ghost")]
    new = shared_lab.events_v1(2).list_namespaced_event(ns, field_selector="regarding.name=p", _request_timeout=5)
    assert sorted((e.metadata.name, e.note, e.regarding.uid) for e in new.items) == [
        ("e1", "0/3 nodes are available", "u1"), ("e2", "ghost", "u1")]


@pytest.mark.parametrize("body", [
    {"gracePeriodSeconds": "soon"},
    {"preconditions": "uid"},
    {"preconditions": {"uid": 7}},
    [1],
], ids=["grace-not-int", "preconditions-not-object", "uid-not-string", "not-an-object"])
def test_bad_delete_options_are_400(shared_lab, lab_namespace, body):
    shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    status, out = raw(shared_lab, 0, "DELETE", f"/api/v1/namespaces/{lab_namespace}/pods/p", body=body)
    assert (status, out["reason"]) == (400, "BadRequest")


@pytest.mark.parametrize(("method", "suffix", "body", "message"), [
    ("POST", "", {"metadata": {"name": 5}, "spec": {"containers": [{"name": "c"}]}},
     "json: cannot unmarshal number into Go struct field ObjectMeta.metadata.name of type string"),
    ("POST", "", {"metadata": {"name": "x", "labels": [1]}, "spec": {"containers": [{"name": "c"}]}},
     "json: cannot unmarshal array into Go struct field ObjectMeta.metadata.labels of type map[string]string"),
    ("PUT", "/p", {"metadata": "x"}, "json: cannot unmarshal string into Go struct field .metadata of type v1.ObjectMeta"),
    ("PUT", "/p/status", {"status": [1]}, "json: cannot unmarshal array into Go struct field .status of type struct"),
    ("POST", "/p/binding", {"metadata": {"name": "p"}, "target": "n"},
     "json: cannot unmarshal string into Go struct field Binding.target of type v1.ObjectReference"),
    ("POST", "/p/binding", {"metadata": {"name": "p", "annotations": [1]}, "target": {"name": "n"}},
     "json: cannot unmarshal array into Go struct field ObjectMeta.metadata.annotations of type map[string]string"),
], ids=["name-not-string", "labels-not-map", "metadata-not-object", "status-not-object", "target-not-object",
        "annotations-not-map"])
def test_wrongly_typed_fields_are_400(shared_lab, lab_namespace, method, suffix, body, message):
    shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    status, out = raw(shared_lab, 0, method, f"/api/v1/namespaces/{lab_namespace}/pods{suffix}", body=body)
    assert (status, out["reason"], out["message"]) == (400, "BadRequest", message)


@pytest.mark.parametrize(("resources", "qos"), [
    (None, "BestEffort"),
    ({"requests": {"cpu": "100m"}}, "Burstable"),
    ({"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}, "Guaranteed"),
    ({"limits": {"cpu": "1", "memory": "1Gi"}}, "Guaranteed"),
], ids=["no-resources", "requests-only", "requests-equal-limits", "limits-only"])
def test_create_replaces_the_status_and_sets_qos(shared_lab, lab_namespace, resources, qos):
    pod = pod_manifest("p", cpu=None, memory=None)
    if resources:
        pod["spec"]["containers"][0]["resources"] = resources
    pod["status"] = {"phase": "Running", "nominatedNodeName": "n"}
    created = shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod, _request_timeout=5)
    assert (created.status.phase, created.status.qos_class, created.status.nominated_node_name) == ("Pending", qos, None)
