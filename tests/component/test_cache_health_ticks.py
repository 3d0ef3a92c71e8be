"""guard.engine.cache_health.CacheHealthMonitor driven tick by tick on a fake clock, against the real lab
(etcd, three replicas, their caches and request logs): when it asks, what it asks, and whom it names.
The replicas' views are read synchronously from their caches (LIST of pending pods, resourceVersion=0),
so no watch timing is involved."""

from __future__ import annotations

import pytest

from guard.engine.cache_health import CacheHealthMonitor
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.lab.harness import pod_manifest
from guard.core.cache_health import ViewState
from guard.engine.replica_views import PendingViews, pod_of
from guard.engine.replicas import ReplicaPool
from guard.core.settings import Settings

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.held_views: dict | None = None  # views to hand out instead of the caches' (a stale picture)

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lab(lab_factory):
    """The lab with its replicas' consistent-read wait at 0.5 s instead of the 3 s of the real cacher: a tick's
    consistent read on a frozen replica falls back to etcd all the same (ctx.source "etcd", the answer the
    monitor gets either way), only sooner. These tests run on a fake clock, so the wait is no part of what they
    assert; with 3 s each of the frozen test's ticks took 3 s of wall time. The other tests' reads never wait
    (every cache is caught up when they tick)."""
    return lab_factory(3, consistent_read_timeout=0.5)


@pytest.fixture
def monitor(lab):
    settings = Settings(missing_after=30.0, frozen_after=30.0)
    kube = Kube(load_configuration(lab.kubeconfig(0)), timeout=2.0, pool_size=4)
    pool = ReplicaPool(settings, kube)
    clock = Clock()

    def views():
        if clock.held_views is not None:
            return clock.held_views
        out = {}
        for c in pool.clients():
            _, items = c.pending_pods()
            pods = {}
            for obj in items:
                pod, pending = pod_of(obj)
                if pod and pending:
                    pods[pod.uid] = pod
            out[c.replica.address] = pods
        # Read now, all at once (no ticks): compared as the guard's watch would be.
        return PendingViews({a: ViewState(frozenset(p), current=True) for a, p in out.items()}, out)

    m = CacheHealthMonitor(settings, kube, pool, views, clock=clock)
    clock.views = views
    yield m, clock
    m.close()
    pool.close()
    kube.close()


def addr(lab, i: int) -> str:
    return f"{lab.replicas[i].ip}:{lab.replicas[i].port}"


def quorum_gets(lab, name: str) -> int:
    return sum(len(r.requests(method="GET", path=f"/api/v1/namespaces/default/pods/{name}", quorum=True))
               for r in lab.replicas)


def test_a_lost_creation_is_checked_once_after_missing_after_and_named_on_that_replica_only(lab, monitor):
    m, clock = monitor
    lab.replicas[1].faults.drop_creates(namespace="default", name="lost")
    uid = lab.core_v1(0).create_namespaced_pod("default", pod_manifest("lost"), _request_timeout=5).metadata.uid
    assert lab.wait_synced()
    m.tick()  # first seen now; every cache caught up with etcd
    assert all(v["frozen"] is False and v["seconds_behind"] == 0 for v in m.status().values())
    clock.now += 29.9
    m.tick()
    assert quorum_gets(lab, "lost") == 0 and all(v["pods_missing"] == 0 for v in m.status().values())
    clock.now += 0.1
    m.tick()  # --missing-after reached: one quorum GET, that replica's cache read, named
    assert quorum_gets(lab, "lost") == 1
    status = m.status()
    assert (status[addr(lab, 1)]["pods_missing"], status[addr(lab, 1)]["missing"]) == (1, [f"default/lost ({uid})"])
    assert status[addr(lab, 0)]["pods_missing"] == status[addr(lab, 2)]["pods_missing"] == 0
    reads = [(x.query, x.source) for x in lab.replicas[1].requests(method="GET", path="/api/v1/namespaces/default/pods")
             if x.query.get("fieldSelector") == "metadata.name=lost"]
    assert reads == [({"fieldSelector": "metadata.name=lost"}, "cache"),  # consistent read: caught up first
                     ({"fieldSelector": "metadata.name=lost", "resourceVersion": "0"}, "cache")]
    clock.now += 5
    m.tick()
    assert quorum_gets(lab, "lost") == 1  # named once; not asked again

    lab.core_v1(0).patch_namespaced_pod("lost", "default", {"metadata": {"annotations": {"touched": "1"}}},
                                        _request_timeout=5)
    assert lab.wait_synced()
    clock.now += 1
    m.tick()
    assert m.status()[addr(lab, 1)]["pods_missing"] == 0


def test_a_pod_bound_meanwhile_is_not_missing(lab, monitor):
    m, clock = monitor
    lab.replicas[1].faults.drop_creates(namespace="default", name="quick")
    lab.core_v1(0).create_namespaced_pod("default", pod_manifest("quick"), _request_timeout=5)
    assert lab.wait_synced()
    m.tick()
    clock.held_views = clock.views()  # what the replicas showed a moment ago...
    lab.core_v1(0).create_namespaced_pod_binding(
        "quick", "default", {"metadata": {"name": "quick"}, "target": {"kind": "Node", "name": "n1"}},
        _request_timeout=5, _preload_content=False)
    assert lab.wait_synced()
    # ...still claims it pending: the quorum GET says bound
    clock.now += 30
    m.tick()
    assert quorum_gets(lab, "quick") == 1
    assert all(v["pods_missing"] == 0 for v in m.status().values())


def test_a_frozen_replica_is_named_after_frozen_after_and_its_pods_are_not_checked_one_by_one(lab, monitor):
    m, clock = monitor
    m.tick()  # round 1: all caught up
    lab.replicas[2].faults.freeze_watch()
    lab.core_v1(0).create_namespaced_pod("default", pod_manifest("after"), _request_timeout=5)  # etcd moves on
    states = []
    for _ in range(5):  # rounds every 10 s (--frozen-after 30 / 3)
        clock.now += 10
        m.tick()
        s = m.status()[addr(lab, 2)]
        states.append((s["frozen"], s["seconds_behind"]))
    assert states == [(False, 0.0), (False, 10.0), (False, 20.0), (True, 30.0), (True, 40.0)]
    assert all(m.status()[addr(lab, i)]["frozen"] is False for i in (0, 1))
    # each round's consistent read on the frozen replica waited for its cache, then fell back to etcd
    consistent = [x.source for x in lab.replicas[2].requests(method="GET", path="/api/v1/namespaces/default/pods")
                  if x.query.get("fieldSelector") == "metadata.name=ghost-guard-revision-probe"
                  and "resourceVersion" not in x.query]
    assert consistent[-5:] == ["etcd"] * 5, consistent
    # "after" is pending on replicas 1 and 2, absent on the frozen one for 40 s: never checked there
    assert quorum_gets(lab, "after") == 0
    assert m.status()[addr(lab, 2)]["pods_missing"] == 0

    lab.replicas[2].faults.unfreeze_watch()
    assert lab.wait_synced()
    clock.now += 10
    m.tick()
    assert m.status()[addr(lab, 2)]["frozen"] is False and m.status()[addr(lab, 2)]["seconds_behind"] == 0
