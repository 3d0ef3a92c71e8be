"""WATCH from a replica's cache: events, resumption from a resourceVersion, 410 Expired, bookmarks."""

from __future__ import annotations

import socket
import ssl

import pytest
from kubernetes import watch
from kubernetes.client import ApiException

from guard.lab.harness import eventually, pod_manifest


def events(lab, replica: int, ns: str, **kw) -> list[tuple[str, str, str | None]]:
    """(type, name, deletionTimestamp set?) for each event until the server's timeoutSeconds."""
    w = watch.Watch()
    out = []
    for ev in w.stream(lab.core_v1(replica).list_namespaced_pod, ns, timeout_seconds=1, _request_timeout=10, **kw):
        obj = ev["raw_object"]
        out.append((ev["type"], obj["metadata"].get("name"), "deleting" if obj["metadata"].get("deletionTimestamp") else None))
    return out


def test_watch_replays_from_a_resource_version(shared_lab, lab_namespace):
    ns = lab_namespace
    api = shared_lab.core_v1(0)
    rv = api.create_namespaced_pod(ns, pod_manifest("a"), _request_timeout=5).metadata.resource_version
    api.create_namespaced_pod(ns, pod_manifest("b"), _request_timeout=5)
    api.patch_namespaced_pod_status("b", ns, {"status": {"nominatedNodeName": "node-a"}},
                                    _content_type="application/merge-patch+json", _request_timeout=5)
    api.delete_namespaced_pod("a", ns, _request_timeout=5)
    assert shared_lab.wait_synced()
    # a graceful pod delete is two writes: deletionTimestamp set, then the object removed
    assert events(shared_lab, 1, ns, resource_version=rv) == [
        ("ADDED", "b", None), ("MODIFIED", "b", None), ("MODIFIED", "a", "deleting"), ("DELETED", "a", "deleting")]


def test_the_replica_counts_the_watch_events_it_writes(shared_lab, lab_namespace):
    """The benchmarks' per-pod watch cost: events written, by the watch's path and type."""
    api = shared_lab.core_v1(0)
    rv = api.create_namespaced_pod(lab_namespace, pod_manifest("a"), _request_timeout=5).metadata.resource_version
    api.create_namespaced_pod(lab_namespace, pod_manifest("b"), _request_timeout=5)
    api.delete_namespaced_pod("b", lab_namespace, grace_period_seconds=0, _request_timeout=5)
    assert shared_lab.wait_synced()
    path = f"/api/v1/namespaces/{lab_namespace}/pods"
    before = shared_lab.replicas[1].watch_events().get(path, {})
    assert events(shared_lab, 1, lab_namespace, resource_version=rv) == [
        ("ADDED", "b", None), ("MODIFIED", "b", "deleting"), ("DELETED", "b", "deleting")]
    after = shared_lab.replicas[1].watch_events()[path]
    assert {t: n - before.get(t, 0) for t, n in after.items() if n != before.get(t, 0)} == {
        "ADDED": 1, "MODIFIED": 1, "DELETED": 1}


def test_a_pod_delete_is_two_writes_even_with_grace_period_zero(shared_lab, lab_namespace):
    """store.go updateForGracefulDeletionAndFinalizers: deletionTimestamp first, then the delete."""
    api = shared_lab.core_v1(0)
    rv = api.create_namespaced_pod(lab_namespace, pod_manifest("a"), _request_timeout=5).metadata.resource_version
    deleted = api.delete_namespaced_pod("a", lab_namespace, grace_period_seconds=0, _request_timeout=5)
    assert deleted.metadata.deletion_grace_period_seconds == 0
    assert shared_lab.wait_synced()
    assert events(shared_lab, 2, lab_namespace, resource_version=rv) == [("MODIFIED", "a", "deleting"), ("DELETED", "a", "deleting")]


def test_watch_without_resource_version_starts_with_the_current_state(shared_lab, lab_namespace):
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("a"), _request_timeout=5)
    assert shared_lab.wait_synced()
    assert events(shared_lab, 2, lab_namespace) == [("ADDED", "a", None)]
    assert events(shared_lab, 2, lab_namespace, resource_version="0") == [("ADDED", "a", None)]


def test_watch_on_the_stale_replica_never_sees_the_deletion(lab):
    api = lab.core_v1(0)
    rv = api.create_namespaced_pod("default", pod_manifest("web-1"), _request_timeout=5).metadata.resource_version
    assert lab.wait_synced()
    lab.replicas[1].faults.drop_deletes(namespace="default", name="web-1")
    api.delete_namespaced_pod("web-1", "default", _request_timeout=5)
    api.create_namespaced_pod("default", pod_manifest("web-2"), _request_timeout=5)
    assert lab.wait_synced()
    assert events(lab, 1, "default", resource_version=rv) == [("ADDED", "web-2", None)]
    assert events(lab, 0, "default", resource_version=rv) == [
        ("MODIFIED", "web-1", "deleting"), ("DELETED", "web-1", "deleting"), ("ADDED", "web-2", None)]


def test_watch_from_before_the_cache_history_is_410_expired(lab):
    api = lab.core_v1(0)
    rv = api.create_namespaced_pod("default", pod_manifest("a"), _request_timeout=5).metadata.resource_version
    api.create_namespaced_pod("default", pod_manifest("b"), _request_timeout=5)
    lab.replicas[1].restart()  # the new cache's history starts at its initial LIST
    start = lab.replicas[1].cache.history_start
    assert start > int(rv)
    with pytest.raises(ApiException) as e:
        events(lab, 1, "default", resource_version=rv)
    assert e.value.status == 410
    assert e.value.reason == f"Expired: too old resource version: {rv} ({start})"
    # the replicas that kept their history still resume (once their caches hold both creates)
    assert lab.wait_synced()
    assert events(lab, 2, "default", resource_version=rv) == [("ADDED", "b", None)]


def test_a_watch_on_a_cache_behind_its_resource_version_sends_only_newer_events(lab):
    """A watch from resourceVersion R on a replica whose cache has not reached R yet is registered, and the
    events up to R then arrive live: only those after R are sent (cache_watcher.go process). Seen once as a
    flake: a watch from "a"'s revision on a replica that had not applied it sent ADDED a, then ADDED b."""
    import threading

    api = lab.core_v1(0)
    lab.replicas[1].faults.freeze_watch()  # replica 2's cache stops before "a"
    rv = api.create_namespaced_pod("default", pod_manifest("a"), _request_timeout=5).metadata.resource_version
    api.create_namespaced_pod("default", pod_manifest("b"), _request_timeout=5)
    got: list = []
    w = watch.Watch()

    def stream() -> None:
        for ev in w.stream(lab.core_v1(1).list_namespaced_pod, "default", resource_version=rv, timeout_seconds=30,
                           _request_timeout=40):
            got.append((ev["type"], ev["raw_object"]["metadata"]["name"]))
            if ev["raw_object"]["metadata"]["name"] == "b":
                w.stop()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    eventually(lambda: lab.replicas[1].cache.watchers > 0, 10, what="the watch registered on replica 2")
    lab.replicas[1].faults.unfreeze_watch()  # "a" and "b" reach the cache, and its watchers, now
    t.join(30)
    assert not t.is_alive()
    assert got == [("ADDED", "b")]


def test_field_selector_watch_turns_a_bind_into_deleted(shared_lab, lab_namespace):
    """cacher.go: an object leaving the selector arrives as DELETED (the scheduler's unassigned-pod informer)."""
    ns = lab_namespace
    api = shared_lab.core_v1(0)
    rv = api.create_namespaced_pod(ns, pod_manifest("p"), _request_timeout=5).metadata.resource_version
    api.create_namespaced_pod_binding("p", ns, {"metadata": {"name": "p"}, "target": {"kind": "Node", "name": "n"}},
                                      _preload_content=False, _request_timeout=5)
    assert shared_lab.wait_synced()
    assert events(shared_lab, 0, ns, resource_version=str(int(rv) - 1), field_selector="spec.nodeName=") == [
        ("ADDED", "p", None), ("DELETED", "p", None)]


def test_bookmarks_carry_the_cache_revision(lab_factory):
    lab = lab_factory(1, bookmark_interval=0.2)
    api = lab.core_v1(0)
    rv = api.create_namespaced_pod("default", pod_manifest("a"), _request_timeout=5).metadata.resource_version
    api.create_node({"metadata": {"name": "n1"}}, _request_timeout=5)  # moves the revision, no pod event
    assert lab.wait_synced()
    w = watch.Watch()
    seen = []
    for ev in w.stream(api.list_namespaced_pod, "default", resource_version=rv, allow_watch_bookmarks=True,
                       timeout_seconds=1, _request_timeout=10):
        seen.append((ev["type"], ev["raw_object"]["metadata"]["resourceVersion"]))
    assert seen[0] == ("BOOKMARK", str(lab.revision()))


def test_send_initial_events_ends_with_an_annotated_bookmark(shared_lab, lab_namespace):
    """WatchList (KEP-3157): initial ADDED events, then a BOOKMARK marked k8s.io/initial-events-end."""
    api = shared_lab.core_v1(0)
    api.create_namespaced_pod(lab_namespace, pod_manifest("a"), _request_timeout=5)
    assert shared_lab.wait_synced()
    seen = []
    for ev in watch.Watch().stream(api.list_namespaced_pod, lab_namespace, send_initial_events=True,
                                   resource_version_match="NotOlderThan", allow_watch_bookmarks=True,
                                   timeout_seconds=1, _request_timeout=10):
        meta = ev["raw_object"]["metadata"]
        seen.append((ev["type"], meta.get("name"), (meta.get("annotations") or {}).get("k8s.io/initial-events-end")))
    assert seen[:2] == [("ADDED", "a", None), ("BOOKMARK", None, "true")]


def test_a_watch_whose_client_hung_up_is_released(lab_factory):
    lab = lab_factory(1, bookmark_interval=0.1)
    cache = lab.replicas[0].cache
    ctx = ssl.create_default_context(cafile=lab.ca_path)
    raw_sock = socket.create_connection(("127.0.0.1", lab.port), timeout=5)
    conn = ctx.wrap_socket(raw_sock, server_hostname="127.0.0.1")
    conn.sendall(b"GET /api/v1/pods?watch=true HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + lab.token.encode() + b"\r\n\r\n")
    assert conn.recv(4096).startswith(b"HTTP/1.1 200 ")

    def watchers() -> int:
        with cache._cond:
            return len(cache._watchers)

    eventually(lambda: watchers() == 1, 5, what="one watcher registered")
    conn.close()
    eventually(lambda: watchers() == 0, 5, what="the watcher gone")
