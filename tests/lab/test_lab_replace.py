"""The lab's watch cache applies a new write for a key it holds as the real cacher does (issue 13, part 5).

watch_cache.go processEvent: the store is keyed by the object's key, so an event for a held key
replaces the element, which becomes the event's PrevObject. cache_watcher.go convertToWatchEvent:
what a watcher receives depends on whether the new object (never for a delete) and the previous
one pass its filter: both -> MODIFIED, only the new -> ADDED, only the old -> DELETED (the old
object). These tests fail if the lab kept the ghost next to the new pod, keyed by UID, or
forwarded etcd's event type.
"""

from __future__ import annotations

import time

from kubernetes import watch

from guard.lab.harness import create, eventually, make_ghost, node_manifest, pod_manifest


GATE = {"name": "kube-ghost-guard.io/placeholder"}


def events(lab, replica: int, ns: str, rv: str, **kw) -> list[tuple[str, str, str, bool, str]]:
    """(type, name, uid, deletionTimestamp set, nodeName) for each event after ``rv`` until timeoutSeconds."""
    out = []
    for ev in watch.Watch().stream(lab.core_v1(replica).list_namespaced_pod, ns, resource_version=rv, timeout_seconds=1,
                                   _request_timeout=10, **kw):
        meta, spec = ev["raw_object"]["metadata"], ev["raw_object"].get("spec") or {}
        out.append((ev["type"], meta["name"], meta["uid"], bool(meta.get("deletionTimestamp")), spec.get("nodeName") or ""))
    return out


def cache_uids(lab, replica: int, ns: str, name: str) -> list[str]:
    items = lab.core_v1(replica).list_namespaced_pod(ns, field_selector=f"metadata.name={name}", resource_version="0",
                                                     _request_timeout=5).items
    return [p.metadata.uid for p in items]


def placeholder(name: str) -> dict:
    pod = pod_manifest(name)
    pod["spec"]["schedulingGates"] = [GATE]
    return pod


def test_a_pod_created_under_a_ghosts_name_replaces_it_and_reaches_watchers_as_modified(lab):
    ghost = make_ghost(lab, "default", "web-0", stale=1)
    lab.replicas[1].faults.clear()  # the watch lost one delete and flows on
    rv = str(lab.replicas[1].cache_revision)
    assert cache_uids(lab, 1, "default", "web-0") == [ghost]

    api = lab.core_v1(0)
    new = create(api, placeholder("web-0"))["metadata"]["uid"]
    assert lab.wait_synced()
    assert cache_uids(lab, 1, "default", "web-0") == [new]  # replaced, not kept beside it
    api.delete_namespaced_pod("web-0", "default", body={"preconditions": {"uid": new}}, _request_timeout=5)
    assert lab.wait_synced()
    assert cache_uids(lab, 1, "default", "web-0") == []

    want = [("MODIFIED", "web-0", new, False, ""), ("MODIFIED", "web-0", new, True, ""), ("DELETED", "web-0", new, True, "")]
    # the scheduler's unscheduled-pods informer and an unfiltered watch alike
    assert events(lab, 1, "default", rv, field_selector="spec.nodeName=") == want
    assert events(lab, 1, "default", rv) == want
    # a replica whose cache saw the ghost's delete sees a plain create and delete
    assert [e[0] for e in events(lab, 0, "default", rv)] == ["ADDED", "MODIFIED", "DELETED"]


def test_the_filter_decides_the_event_type_not_etcd(lab):
    """A bound ghost replaced by a pending pod: ADDED for the unscheduled selector, DELETED (the old,
    bound copy) for the assigned selector; etcd itself reports a create."""
    api = lab.core_v1(0)
    bound = create(api, pod_manifest("db-0", node_name="node-a"))["metadata"]["uid"]
    assert lab.wait_synced()
    lab.replicas[1].faults.drop_deletes(namespace="default", name="db-0", count=1)
    api.delete_namespaced_pod("db-0", "default", _request_timeout=5)
    assert lab.wait_synced()
    rv = str(lab.replicas[1].cache_revision)
    pending = create(api, pod_manifest("db-0"))["metadata"]["uid"]
    assert lab.wait_synced()

    assert events(lab, 1, "default", rv, field_selector="spec.nodeName=") == [("ADDED", "db-0", pending, False, "")]
    assert events(lab, 1, "default", rv, field_selector="spec.nodeName!=") == [("DELETED", "db-0", bound, False, "node-a")]
    assert events(lab, 1, "default", rv) == [("MODIFIED", "db-0", pending, False, "")]


def test_a_frozen_watch_keeps_the_ghost_whatever_is_written(lab):
    ghost = make_ghost(lab, "default", "web-0", stale=1)
    lab.replicas[1].faults.clear()
    lab.replicas[1].faults.freeze_watch()
    before = lab.replicas[1].cache_revision
    api = lab.core_v1(0)
    new = create(api, placeholder("web-0"))["metadata"]["uid"]
    assert lab.wait_synced(replicas=[0, 2])
    assert cache_uids(lab, 1, "default", "web-0") == [ghost]
    assert lab.replicas[1].cache_revision == before
    api.delete_namespaced_pod("web-0", "default", body={"preconditions": {"uid": new}}, _request_timeout=5)
    lab.replicas[1].faults.unfreeze_watch()
    assert lab.wait_synced()
    assert cache_uids(lab, 1, "default", "web-0") == []  # once it flows again, the delete empties the key


def test_the_scheduler_never_binds_a_gated_pod_and_drops_a_ghost_a_gated_pod_replaced(lab, lab_scheduler):
    """SchedulingGates PreEnqueue: a gated pod never enters activeQ; the ghost's loop ends with the replace."""
    from guard.lab.scheduler import Timings

    fast = Timings(pod_initial_backoff=0.05, pod_max_backoff=0.2, backoff_flush_period=0.05, request_timeout=5.0,
                   retry_period=0.1, sync_timeout=10.0)
    api = lab.core_v1(0)
    create(api, node_manifest("node-a"))
    ghost = make_ghost(lab, "default", "web-0", stale=1)
    lab.replicas[1].faults.clear()
    sched = lab_scheduler(lab.kubeconfig(1), timings=fast)
    eventually(lambda: sched.stats().get("default/web-0") and sched.stats()["default/web-0"].bind_failures.get(404, 0) >= 2,
               10, what="the ghost's bind loop")
    create(api, placeholder("web-0"))
    create(api, placeholder("gated-1"))
    create(api, pod_manifest("plain-1"))
    eventually(lambda: sched.stats().get("default/plain-1") and sched.stats()["default/plain-1"].bound_node, 10,
               what="an ungated pod bound")
    # Out of the queue (active, backoff, unschedulable or in a cycle, whose bind runs inside it) and out of the
    # informer: nothing can try the ghost again, so its failures stop.
    eventually(lambda: "default/web-0" not in sched.queue()
               and ghost not in {p["metadata"]["uid"] for p in sched.informer_pods().values()}, 10,
               what="the ghost out of the queue and the informer")
    failures = sched.stats()["default/web-0"].bind_failures_total
    assert "default/web-0" not in sched.queue()
    assert sched.stats()["default/web-0"].bind_failures_total == failures
    assert sched.stats().get("default/gated-1") is None or sched.stats()["default/gated-1"].attempts == 0
    assert ghost not in {p["metadata"]["uid"] for p in sched.informer_pods().values()}
