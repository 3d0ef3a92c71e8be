"""Which reads a replica serves from etcd and which from its watch cache, through the official client.

A GET without resourceVersion is served by etcd; GET and LIST with
resourceVersion=0, WATCH and (since 1.31) LIST without resourceVersion by the
watch cache (apiserver/pkg/storage/cacher: cacher.go 1.31-1.32, delegator.go 1.33+).
"""

from __future__ import annotations

import json
import time

import pytest
from kubernetes.client import ApiException

from fixtures_lab import raw

from guard.lab.harness import cached_names, make_ghost, pod_manifest


def test_quorum_get_404s_while_the_stale_cache_still_serves_the_ghost(lab):
    uid = make_ghost(lab, "default", "web-1", stale=1)
    stale = lab.core_v1(1)
    lab.replicas[1].clear_requests()

    with pytest.raises(ApiException) as e:
        stale.read_namespaced_pod("web-1", "default", _request_timeout=5)
    assert e.value.status == 404
    assert e.value.body is not None and '"reason":"NotFound"' in e.value.body
    assert '"message":"pods \\"web-1\\" not found"' in e.value.body

    status, cached = raw(lab, 1, "GET", "/api/v1/namespaces/default/pods/web-1?resourceVersion=0")
    assert status == 200
    assert cached["metadata"]["uid"] == uid
    assert "deletionTimestamp" not in cached["metadata"]
    assert cached["status"]["phase"] == "Pending"

    assert cached_names(lab, 1, "default") == ["web-1"]
    assert cached_names(lab, 0, "default") == []
    assert cached_names(lab, 2, "default") == []

    # A LIST without resourceVersion is a consistent read *from the cache*: still the ghost.
    consistent = stale.list_namespaced_pod("default", _request_timeout=5)
    assert [p.metadata.name for p in consistent.items] == ["web-1"]
    assert [p.metadata.name for p in lab.core_v1(0).list_namespaced_pod("default", _request_timeout=5).items] == []

    log = lab.replicas[1].requests(method="GET", path="/api/v1/namespaces/default/pods/web-1")
    assert [(r.status, r.source, r.quorum) for r in log] == [(404, "etcd", True), (200, "cache", False)]
    assert len(lab.replicas[1].requests(quorum=True)) == 1

    dropped = [(d.type, d.name, d.uid) for d in lab.replicas[1].faults.dropped]
    assert dropped == [("MODIFIED", "web-1", uid), ("DELETED", "web-1", uid)]


def test_cache_resource_version_advances_past_the_dropped_delete(lab):
    make_ghost(lab, "default", "web-1", stale=1)
    api = lab.core_v1(0)
    api.create_namespaced_pod("default", pod_manifest("web-2"), _request_timeout=5)
    assert lab.wait_synced()
    listed = lab.core_v1(1).list_namespaced_pod("default", resource_version="0", _request_timeout=5)
    assert int(listed.metadata.resource_version) == lab.revision()
    assert sorted(p.metadata.name for p in listed.items) == ["web-1", "web-2"]


def test_list_items_carry_no_kind_and_the_list_carries_the_cache_revision(shared_lab, lab_namespace):
    api = shared_lab.core_v1(2)
    created = api.create_namespaced_pod(lab_namespace, pod_manifest("a"), _request_timeout=5)
    raw = api.list_namespaced_pod(lab_namespace, _preload_content=False, _request_timeout=5)
    body = json.loads(raw.data)
    assert body["kind"] == "PodList" and body["apiVersion"] == "v1"
    assert int(body["metadata"]["resourceVersion"]) >= int(created.metadata.resource_version)
    assert [set(i) >= {"metadata", "spec", "status"} and "kind" not in i and "apiVersion" not in i for i in body["items"]] == [True]


def test_field_and_label_selectors(shared_lab, lab_namespace):
    ns = lab_namespace
    api = shared_lab.core_v1(0)
    api.create_node({"metadata": {"name": f"{ns}-node"}}, _request_timeout=5)
    api.create_namespaced_pod(ns, pod_manifest("bound", labels={"app": "web", "tier": "front"}, node_name=f"{ns}-node"), _request_timeout=5)
    api.create_namespaced_pod(ns, pod_manifest("pending", labels={"app": "web"}), _request_timeout=5)
    api.create_namespaced_pod(ns, pod_manifest("other", labels={"app": "db"}), _request_timeout=5)

    def names(**kw):
        return sorted(p.metadata.name for p in api.list_namespaced_pod(ns, _request_timeout=5, **kw).items)

    assert names(field_selector="spec.nodeName=") == ["other", "pending"]
    assert names(field_selector=f"spec.nodeName!=") == ["bound"]
    assert names(field_selector="metadata.name=pending") == ["pending"]
    assert names(field_selector="metadata.name!=pending,spec.nodeName=") == ["other"]
    assert names(label_selector="app=web") == ["bound", "pending"]
    assert names(label_selector="app!=web") == ["other"]
    assert names(label_selector="app in (db,web),tier") == ["bound"]
    assert names(label_selector="!tier", resource_version="0") == ["other", "pending"]
    everywhere = api.list_pod_for_all_namespaces(field_selector=f"metadata.namespace={ns},spec.nodeName=", _request_timeout=5)
    assert sorted(p.metadata.name for p in everywhere.items) == ["other", "pending"]

    with pytest.raises(ApiException) as e:
        api.list_namespaced_pod(ns, field_selector="spec.bogus=x", _request_timeout=5)
    assert e.value.status == 400
    assert "field label not supported: spec.bogus" in e.value.body


def test_get_with_resource_version_zero_is_served_by_the_cache(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    assert shared_lab.wait_synced()
    r = shared_lab.replicas[0]
    since = time.time()
    assert raw(shared_lab, 0, "GET", f"/api/v1/namespaces/{lab_namespace}/pods/p?resourceVersion=0")[0] == 200
    api.read_namespaced_pod("p", lab_namespace, _request_timeout=5)
    recs = r.requests(method="GET", path=f"/api/v1/namespaces/{lab_namespace}/pods/p", since=since)
    assert [(x.query.get("resourceVersion"), x.source) for x in recs] == [("0", "cache"), (None, "etcd")]
