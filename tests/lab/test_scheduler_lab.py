"""Scheduler simulator against the lab, no guard: the ghost loop, live pods, preemption.

Real etcd, real replicas, the official client; fast timings (backoff 0.05 s -> 0.2 s).
"""

from __future__ import annotations

import functools

import pytest

from guard.lab.harness import create, eventually, make_ghost, node_manifest, pod_manifest, quorum_pod
from guard.lab.scheduler import PodStats, Timings

FAST = Timings(
    pod_initial_backoff=0.05,
    pod_max_backoff=0.2,
    backoff_flush_period=0.02,
    pod_max_in_unschedulable=60.0,
    unschedulable_flush_period=5.0,
    request_timeout=5.0,
    retry_period=0.1,
    sync_timeout=10.0,
)
WAIT = 20.0


def pod_scheduled(api, name):
    """The PodScheduled condition etcd holds for a pod, or None."""
    pod = quorum_pod(api, name) or {}
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"), None)


def stat(stats, key):
    return stats.get(key, PodStats())


@pytest.fixture
def lab(lab_factory, request):
    """A fresh lab per test with as many replicas as the test reads (``replicas(n)``; default 3): a replica
    that no request and no ghost reaches would only cost its start and stop."""
    return lab_factory(replicas=getattr(request, "param", 3))


def replicas(n: int):
    """The test's lab has ``n`` replicas (replica 0 writes; a ghost's stale replica and the scheduler's are < n)."""
    return pytest.mark.parametrize("lab", [n], indirect=True, ids=[f"{n}-replica" + "s" * (n > 1)])


@pytest.fixture
def scheduler_on(lab_scheduler):
    return functools.partial(lab_scheduler, timings=FAST)


@replicas(2)
def test_ghost_loops_on_bind_404_while_live_pods_schedule(lab, scheduler_on):
    api = lab.core_v1(0)
    for name in ("node-a", "node-b"):
        create(api, node_manifest(name))
    uid = make_ghost(lab, "default", "web-1", stale=1)

    sched = scheduler_on(lab.kubeconfig(1))
    live = create(api, pod_manifest("web-2"))

    assert sched.wait_for(lambda s: stat(s, "default/web-1").bind_failures.get(404, 0) >= 4
                          and stat(s, "default/web-2").bound_node, WAIT)
    stats = sched.stats()
    ghost = stats["default/web-1"]
    assert ghost.uid == uid
    assert set(ghost.bind_failures) == {404}
    assert ghost.bound_node == ""
    assert ghost.evictions == []
    assert set(ghost.status_patch_failures) == {404}  # PodScheduled=False patch 404s too
    assert ghost.last_message == 'running Bind plugin "DefaultBinder": pods "web-1" not found'
    # The ghost is still in the informer, so it is still queued: the loop goes on.
    assert "default/web-1" in sched.informer_pods()
    assert sched.queue()["default/web-1"] in {"active", "backoff", "inflight"}
    # Every bind really reached the replica (and etcd) and came back 404.
    binds = lab.replicas[1].requests(method="POST", path="/api/v1/namespaces/default/pods/web-1/binding")
    assert len(binds) >= ghost.bind_failures[404]
    assert {r.status for r in binds} == {404}

    web2 = stats["default/web-2"]
    assert web2.uid == live["metadata"]["uid"]
    assert web2.bind_failures == {}
    assert web2.bound_node in {"node-a", "node-b"}
    assert quorum_pod(api, "web-2")["spec"]["nodeName"] == web2.bound_node


def test_scheduler_on_a_healthy_replica_never_sees_the_ghost(lab, scheduler_on):
    api = lab.core_v1(0)
    create(api, node_manifest("node-a"))
    make_ghost(lab, "default", "web-1", stale=1)

    sched = scheduler_on(lab.kubeconfig(2))
    create(api, pod_manifest("web-2"))
    assert sched.wait_for(lambda s: stat(s, "default/web-2").bound_node == "node-a", WAIT)
    assert "default/web-1" not in sched.stats()
    assert "default/web-1" not in sched.informer_pods()


@replicas(1)
def test_unschedulable_pod_waits_then_requeues_on_node_add(lab, scheduler_on):
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", cpu="2"))
    sched = scheduler_on(lab.kubeconfig(0))
    create(api, pod_manifest("big", cpu="8"))

    assert sched.wait_for(lambda s: stat(s, "default/big").unschedulable >= 1, WAIT)
    # In the unschedulable queue, after at most a pass through backoff: an event that reaches the scheduler
    # while the pod's attempt runs (node-a's ADD, on a loaded machine) sends it to backoff first, as
    # kube-scheduler does (moveRequestCycle); it fails again there and then waits.
    eventually(lambda: sched.queue().get("default/big") == "unschedulable", WAIT, what="big in the unschedulable queue")
    assert stat(sched.stats(), "default/big").bind_attempts == 0
    cond = eventually(lambda: pod_scheduled(api, "big"), WAIT, what="a PodScheduled condition for big")
    assert (cond["status"], cond["reason"]) == ("False", "Unschedulable")
    assert cond["message"].startswith("0/1 nodes are available: 1 Insufficient cpu.")

    create(api, node_manifest("node-big", cpu="16"))
    assert sched.wait_for(lambda s: stat(s, "default/big").bound_node == "node-big", WAIT)
    assert quorum_pod(api, "big")["spec"]["nodeName"] == "node-big"


@replicas(1)
def test_node_selector_and_requests_pick_the_node(lab, scheduler_on):
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", cpu="2", labels={"disk": "ssd"}))
    create(api, node_manifest("node-b", cpu="8"))
    create(api, pod_manifest("filler", cpu="1500m", node_name="node-a"))
    sched = scheduler_on(lab.kubeconfig(0))
    create(api, pod_manifest("ssd-ok", cpu="500m", node_selector={"disk": "ssd"}))
    create(api, pod_manifest("ssd-full", cpu="1", node_selector={"disk": "ssd"}))

    assert sched.wait_for(lambda s: stat(s, "default/ssd-ok").bound_node == "node-a"
                          and stat(s, "default/ssd-full").unschedulable >= 1, WAIT)
    message = stat(sched.stats(), "default/ssd-full").last_message
    assert message.startswith("0/2 nodes are available: 1 Insufficient cpu, "
                              "1 node(s) didn't match Pod's node affinity/selector.")


@replicas(2)
def test_ghost_that_only_fits_by_eviction_evicts_a_real_lower_priority_pod(lab, scheduler_on):
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", cpu="2"))
    victim = create(api, pod_manifest("batch-1", cpu="1500m", priority=0, node_name="node-a"))
    make_ghost(lab, "default", "web-1", stale=1, cpu="1", priority=1000)

    sched = scheduler_on(lab.kubeconfig(1))
    assert sched.wait_for(lambda s: stat(s, "default/web-1").evictions == ["default/batch-1"], WAIT)
    assert quorum_pod(api, "batch-1") is None  # a real pod evicted for a pod that does not exist
    stats = sched.stats()
    assert stats["default/batch-1"].evicted_by == "default/web-1"
    assert stats["default/web-1"].nominated_node == "node-a"
    # The victim was marked like DefaultPreemption does before the DELETE.
    patches = lab.replicas[1].requests(method="PATCH", path="/api/v1/namespaces/default/pods/batch-1/status")
    assert [r.status for r in patches] == [200]
    deletes = lab.replicas[1].requests(method="DELETE", path="/api/v1/namespaces/default/pods/batch-1")
    assert [r.status for r in deletes] == [200]
    assert victim["metadata"]["uid"] == stats["default/batch-1"].uid
    # Room made, the ghost now "fits" and loops on 404 binds.
    assert sched.wait_for(lambda s: stat(s, "default/web-1").bind_failures.get(404, 0) >= 2, WAIT)
    assert stat(sched.stats(), "default/web-1").evictions == ["default/batch-1"]


@replicas(1)
def test_live_high_priority_pod_preempts_and_binds(lab, scheduler_on):
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", cpu="2"))
    create(api, pod_manifest("low", cpu="1", priority=1, node_name="node-a"))
    create(api, pod_manifest("lowest", cpu="1", priority=0, node_name="node-a"))
    create(api, pod_manifest("noop", priority=0))  # no lower-priority pod to evict
    sched = scheduler_on(lab.kubeconfig(0))
    assert sched.wait_for(lambda s: stat(s, "default/noop").unschedulable >= 1, WAIT)

    create(api, pod_manifest("urgent", cpu="1", priority=100))
    assert sched.wait_for(lambda s: stat(s, "default/urgent").bound_node == "node-a", WAIT)
    stats = sched.stats()
    # Only the least important pod goes: "low" is reprieved once "lowest" makes room.
    assert stats["default/urgent"].evictions == ["default/lowest"]
    assert quorum_pod(api, "lowest") is None
    assert quorum_pod(api, "low")["spec"]["nodeName"] == "node-a"
    # A pod of equal priority never preempts.
    assert stats["default/noop"].evictions == []


@replicas(2)
def test_ghost_leaves_the_informer_only_when_it_relists(lab, scheduler_on):
    api = lab.core_v1(0)
    create(api, node_manifest("node-a"))
    make_ghost(lab, "default", "web-1", stale=1)
    sched = scheduler_on(lab.kubeconfig(1))
    assert sched.wait_for(lambda s: stat(s, "default/web-1").bind_failures.get(404, 0) >= 2, WAIT)
    assert sched.informer_stats()["pods"]["lists"] == 1

    # The replica goes down, etcd moves on, the replica comes back with a cache rebuilt from
    # etcd (no ghost). The scheduler's WATCH resumes from a resourceVersion older than that
    # cache's history: 410 Gone, and only the re-LIST drops the ghost from the informer.
    lab.replicas[1].stop()
    create(api, pod_manifest("web-2"))
    lab.replicas[1].start()
    assert eventually(lambda: "default/web-1" not in sched.informer_pods(), WAIT, what="web-1 gone from the informer")
    assert sched.informer_stats()["pods"]["lists"] >= 2
    assert sched.wait_for(lambda s: stat(s, "default/web-2").bound_node == "node-a", WAIT)
    assert "default/web-1" not in sched.queue()  # the loop is over
