"""The lab's lost creation (Faults.drop_creates): one replica's cache misses a pod's creation and
its watch flows on; the next write to the pod reaches it as the real watch cache would take it
(stored; a watcher that never saw the pod gets ADDED)."""

from __future__ import annotations

from kubernetes import watch

from fixtures_lab import raw

from guard.lab.harness import cached_names, pod_manifest


def events(lab, replica: int, ns: str, **kw) -> list[tuple[str, str]]:
    out = []
    for ev in watch.Watch().stream(lab.core_v1(replica).list_namespaced_pod, ns, timeout_seconds=1,
                                   _request_timeout=10, **kw):
        out.append((ev["type"], ev["raw_object"]["metadata"]["name"]))
    return out


def test_a_lost_creation_leaves_the_pod_out_of_one_cache_until_it_is_written_again(lab):
    api = lab.core_v1(0)
    start = api.list_namespaced_pod("default", _request_timeout=5).metadata.resource_version
    rule = lab.replicas[1].faults.drop_creates(namespace="default", name="lost")
    created = api.create_namespaced_pod("default", pod_manifest("lost"), _request_timeout=5)
    api.create_namespaced_pod("default", pod_manifest("kept"), _request_timeout=5)
    assert lab.wait_synced()  # every cache, replica 2's too, is past both creations: its watch flows on
    assert cached_names(lab, 1, "default") == ["kept"]
    assert cached_names(lab, 0, "default") == ["kept", "lost"]
    assert [(d.type, d.name, d.uid) for d in lab.replicas[1].faults.dropped] == [("ADDED", "lost", created.metadata.uid)]
    assert rule.dropped == 1
    status, _ = raw(lab, 1, "GET", "/api/v1/namespaces/default/pods/lost?resourceVersion=0")
    assert status == 404
    assert events(lab, 1, "default", resource_version=start) == [("ADDED", "kept")]

    # a later write (a touch) is no creation: the cache stores it, a watcher sees the pod ADDED
    api.patch_namespaced_pod("lost", "default", {"metadata": {"annotations": {"touched": "1"}}}, _request_timeout=5)
    assert lab.wait_synced()
    assert cached_names(lab, 1, "default") == ["kept", "lost"]
    assert events(lab, 1, "default", resource_version=start) == [("ADDED", "kept"), ("ADDED", "lost")]
    assert events(lab, 0, "default", resource_version=start) == [("ADDED", "lost"), ("ADDED", "kept"), ("MODIFIED", "lost")]


def test_drop_creates_through_the_admin_endpoint(lab):
    status, rule = raw(lab, 1, "POST", "/lab/faults", body={"action": "drop-creates", "namespace": "default", "count": 1})
    assert status == 201 and rule["namespace"] == "default" and rule["count"] == 1
    status, snap = raw(lab, 1, "GET", "/lab/faults")
    assert (snap["dropCreates"], snap["dropDeletes"]) == ([rule], [])
    api = lab.core_v1(0)
    api.create_namespaced_pod("default", pod_manifest("a"), _request_timeout=5)
    api.create_namespaced_pod("default", pod_manifest("b"), _request_timeout=5)  # count 1: only "a" is lost
    assert lab.wait_synced()
    assert cached_names(lab, 1, "default") == ["b"]
    assert raw(lab, 1, "GET", "/lab/faults")[1]["dropCreates"] == []
