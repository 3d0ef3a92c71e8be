"""The seed incident end to end: lab + scheduler simulator + the real guard process.

A ghost (deleted in etcd, still served by replica 2's watch cache) makes the
scheduler loop on 404 binds; with the guard registered as extender over HTTPS
(filter + preempt verbs) it causes at most one failed bind and evicts nobody,
while live pods still schedule.
"""

from __future__ import annotations

import functools
import io
import re

import pytest

from guard.lab.demo import run_demo
from guard.lab.harness import create, eventually, make_ghost, node_manifest, pod_manifest, quorum_pod
from guard.lab.scheduler import PodStats, Timings

pytestmark = pytest.mark.e2e

WAIT = 20.0
# kube-scheduler's timings scaled down 20x (1 s -> 10 s backoff becomes 0.05 s -> 0.5 s).
FAST = Timings(pod_initial_backoff=0.05, pod_max_backoff=0.5, backoff_flush_period=0.05,
               pod_max_in_unschedulable=60.0, unschedulable_flush_period=5.0, request_timeout=5.0,
               retry_period=0.1, sync_timeout=10.0)


def stat(stats, key):
    return stats.get(key, PodStats())


@pytest.fixture
def scheduler_on(lab_scheduler):
    return functools.partial(lab_scheduler, timings=FAST)


@pytest.mark.parametrize("guard_first", [True, False], ids=["guard-watching", "guard-started-later"])
@pytest.mark.parametrize("node_cache_capable", [True, False], ids=["node-names", "node-list"])
def test_ghost_causes_at_most_one_failed_bind_with_the_guard(lab, https_guard, scheduler_on, node_cache_capable,
                                                             guard_first):
    api = lab.core_v1(0)
    for name in ("node-a", "node-b", "node-c"):
        create(api, node_manifest(name))
    guard = https_guard() if guard_first else None  # it sees web-1 created and deleted
    make_ghost(lab, "default", "web-1", stale=1)
    guard = guard or https_guard()

    sched = scheduler_on(lab.kubeconfig(1), extenders=[guard.extender(node_cache_capable=node_cache_capable)])
    create(api, pod_manifest("web-2"))
    assert sched.wait_for(lambda s: stat(s, "default/web-2").bound_node
                          and stat(s, "default/web-1").unschedulable >= 1, WAIT)
    # Each cluster event (here: a live pod bound) requeues the parked ghost; the guard rejects it again.
    for i in range(3):
        seen = stat(sched.stats(), "default/web-1").filter_calls
        create(api, pod_manifest(f"live-{i}"))
        assert sched.wait_for(lambda s: stat(s, f"default/live-{i}").bound_node
                              and stat(s, "default/web-1").filter_calls > seen, WAIT)

    stats = sched.stats()
    ghost = stats["default/web-1"]
    assert ghost.bind_failures_total <= 1
    assert ghost.bind_attempts == ghost.bind_failures_total
    assert ghost.bound_node == ""
    assert ghost.evictions == []
    # Rejected on every node as unresolvable: preemption does not even try. One short reason per node, the
    # verdict (terminating when the guard's read fell between the delete's two writes).
    assert re.fullmatch(r"0/3 nodes are available: 3 ghost pod: [a-z-]+ \(see kube-ghost-guard log/record\)\. "
                        r"preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling\.",
                        ghost.last_message), ghost.last_message
    assert ghost.preempt_calls == 0
    for key in ("default/web-2", "default/live-0", "default/live-1", "default/live-2"):
        assert stats[key].bind_failures == {}
        assert stats[key].filter_calls >= 1
        assert quorum_pod(api, key.split("/")[1])["spec"]["nodeName"] == stats[key].bound_node
    binds = lab.replicas[1].requests(method="POST", path="/api/v1/namespaces/default/pods/web-1/binding")
    assert len(binds) <= 1
    # ghost-deleted, or terminating when the guard's read fell between the delete's two writes (deletionTimestamp set)
    assert sum(guard.process.metric("ghost_guard_verdicts_total", verdict=v) for v in ("ghost-deleted", "terminating")) >= 1
    # ... and the guard names the stale replica (replica 2 of 3).
    stale = lab.replicas[1].url.removeprefix("https://")
    assert eventually(lambda: guard.process.metric("ghost_guard_stale_replica_detections_total", replica=stale) >= 1,
                      WAIT, what="a stale-replica detection")


@pytest.mark.parametrize("guard_first", [
    pytest.param(True, id="guard-watching"),
    pytest.param(False, id="guard-started-later"),
])
def test_ghost_evicts_a_real_pod_without_the_guard_and_nobody_with_it(lab, https_guard, scheduler_on, guard_first):
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", cpu="2"))
    create(api, pod_manifest("batch-1", cpu="1500m", priority=0, node_name="node-a"))
    guard = https_guard() if guard_first else None  # it sees web-1 created and deleted
    make_ghost(lab, "default", "web-1", stale=1, cpu="1", priority=1000)

    # Without the guard: DefaultPreemption evicts the real pod for the ghost.
    plain = scheduler_on(lab.kubeconfig(1))
    assert plain.wait_for(lambda s: stat(s, "default/web-1").evictions == ["default/batch-1"], WAIT)
    assert quorum_pod(api, "batch-1") is None
    plain.stop()

    # With the guard (filter + preempt): the preempt verb vetoes every candidate.
    victim = create(api, pod_manifest("batch-2", cpu="1500m", priority=0, node_name="node-a"))
    # The guarded scheduler lists through replica 1: until replica 1's cache holds batch-2, node-a looks free
    # for the ghost and the filter verb is called. Start it once that replica serves the victim.
    eventually(lambda: lab.cached_pod(1, "default", "batch-2") is not None, WAIT, what="batch-2 in replica 1's cache")
    guard = guard or https_guard()
    guarded = scheduler_on(lab.kubeconfig(1), extenders=[guard.extender()])
    assert guarded.wait_for(lambda s: stat(s, "default/web-1").preempt_calls >= 1
                            and stat(s, "default/web-1").unschedulable >= 1, WAIT)
    create(api, pod_manifest("live", cpu="100m", priority=0))  # an event: the ghost is tried again
    assert guarded.wait_for(lambda s: stat(s, "default/web-1").preempt_calls >= 2, WAIT)
    ghost = guarded.stats()["default/web-1"]
    assert ghost.evictions == []
    assert ghost.filter_calls == 0  # built-in NodeResourcesFit failed the only node: only the preempt verb helps
    assert ghost.bind_attempts == 0
    assert ghost.last_message == ("0/1 nodes are available: 1 Insufficient cpu. "
                                  "preemption: no candidate node for preemption")
    assert quorum_pod(api, "batch-2")["metadata"]["uid"] == victim["metadata"]["uid"]
    assert lab.replicas[1].requests(method="DELETE", path="/api/v1/namespaces/default/pods/batch-2") == []


def test_demo_breaks_the_loop():
    # 2.5 s a phase (the command's --seconds): without the guard the ghost's binds fail at about 0, 0.1, 0.3,
    # 0.7 and 1.5 s (DEMO_TIMINGS' backoff), 2 of them needed; with it at most 1 of its 4-5 attempts may fail.
    out = io.StringIO()
    assert run_demo(out, seconds=2.5) == 0, out.getvalue()
    text = out.getvalue()
    assert "The guard broke the loop" in text
    assert re.search(r"ghost failed binds \(404\)\s+(\d+)\s+([01])\n", text), text
    assert "after heal: replica 1 serves default/web-1: no; replica 1 restarted: no" in text, text  # ends with heal
