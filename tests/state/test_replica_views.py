"""The per-replica views kept by listing (guard.engine.prepare): what a listing may conclude, in process.

Every replica but the watched one is *listed* (its cache's unscheduled pods, ``resourceVersion=0``)
every few seconds instead of watched. A listing replaces the view: new pods are seen (queued for
verification while active, oldest first), pods that left it are gone (their prepared verdicts
dropped), and a replica listed before the guard knew a pod never counts as disagreeing about it.
Scripted etcd and replica caches, events delivered by hand, no sleeps (one test runs the watch's
thread, and waits on what it did).
"""

from __future__ import annotations

import queue

import pytest
from scripted import Etcd, EtcdKube, FakeClock, Pool, ReplicaModel, ScriptedGets, check, pod, settings

from guard.engine.cache_health import CacheHealthMonitor
from guard.engine.checker import Checker
from guard.lab.harness import eventually
from guard.engine.prepare import Preparer
from guard.engine.replica_views import LIST_OBJECTS_PER_SECOND, ReplicaView
from guard.core.verdict import Verdict


@pytest.fixture
def world():
    etcd = Etcd()
    gets = ScriptedGets(etcd)
    clock = FakeClock()
    checker = Checker(settings(prepare_idle_after=0, sweep_interval=30.0), gets, timer=clock, background=False)
    replicas = [ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)]
    pv = Preparer(checker.settings, Pool(replicas), checker)
    views = pv.views.replicas_changed(replicas, [])  # the views, without the threads start() would run
    return etcd, gets, checker, pv, replicas, views


def catch_up(replica: ReplicaModel) -> None:
    while replica.deliver() is not None:
        pass


def drain(pv: Preparer) -> list[str]:
    order: list[str] = []
    real = pv.checker.verify

    def spy(p, known_at, **kw):
        order.append(p.name)
        return real(p, known_at, **kw)

    pv.checker.verify = spy  # type: ignore[method-assign]
    try:
        while pv.verify_next():
            pass
    finally:
        pv.checker.verify = real  # type: ignore[method-assign]
    return order


def created_at(second: int) -> dict:
    return {"creationTimestamp": f"2026-12-01T00:00:{second:02d}Z"}


def test_a_listing_queues_new_pods_oldest_first(world):
    etcd, gets, checker, pv, replicas, views = world
    for name in ("c", "a", "b"):
        etcd.create(name)
    catch_up(replicas[0])
    rv, items = replicas[0].pending_pods()
    stamps = {"a": 1, "b": 2, "c": 3}  # kube-scheduler's order for equal priorities: oldest first
    for obj in items:
        obj["metadata"].update(created_at(stamps[obj["metadata"]["name"]]))
    pv.views.apply_listing(views[0], rv, items, checker.cache.tick())
    assert sorted(p.name for p in views[0].pods.values()) == ["a", "b", "c"]
    assert drain(pv) == ["a", "b", "c"]
    assert gets.count == 3
    # Listed again: nothing new, nothing verified again.
    pv.views.list_view(views[0])
    assert drain(pv) == [] and gets.count == 3


def test_a_pod_that_leaves_a_listing_loses_its_prepared_verdict(world):
    etcd, gets, checker, pv, replicas, views = world
    uid = etcd.create("web")
    catch_up(replicas[0])
    pv.views.list_view(views[0])
    drain(pv)
    assert checker.cache.take_prepared(pod("web", uid)) is not None  # verified ahead by the listing
    other = etcd.create("other")
    catch_up(replicas[0])
    pv.views.list_view(views[0])
    drain(pv)
    assert checker.cache.gone_since(pod("other", other)) == 0
    etcd.delete("other")  # deleted: the next listing lacks it
    catch_up(replicas[0])
    assert checker.cache.gone_since(pod("other", other)) == 0
    pv.views.list_view(views[0])
    assert checker.cache.gone_since(pod("other", other)) > 0
    assert checker.cache.take_prepared(pod("other", other)) is None
    # A later call for it reads etcd again, with a read that began after it was seen gone.
    assert check(checker, pod("other", other)).verdict is Verdict.GHOST_DELETED


def test_a_replica_listed_before_the_pod_existed_does_not_disagree(world):
    etcd, gets, checker, pv, replicas, views = world
    pv.views.list_view(views[1])  # replica 2 listed: empty
    etcd.create("new")
    catch_up(replicas[0])
    catch_up(replicas[1])
    pv.views.list_view(views[0])  # replica 1 listed after the create: shows it
    assert pv.views.disagreements() == []  # replica 2's view is older than the pod
    pv.views.list_view(views[1])
    assert pv.views.disagreements() == []  # and its next listing shows it


def test_a_replica_that_lost_the_delete_disagrees_once_its_listing_is_newer_than_the_pod(world):
    etcd, gets, checker, pv, replicas, views = world
    uid = etcd.create("ghost")
    catch_up(replicas[0])
    catch_up(replicas[1])
    for v in views:
        pv.views.list_view(v)
    drain(pv)
    etcd.delete("ghost")
    catch_up(replicas[0])
    replicas[1].drop()  # replica 2's watch lost the delete: it serves the ghost forever
    for v in views:
        pv.views.list_view(v)
    assert pv.views.disagreements() == [pod("ghost", uid)]
    assert pv.sweep() == []  # the first sweep only suspects
    assert pv.sweep() == [pod("ghost", uid)]  # the second, in a row, verifies it again
    drain(pv)
    assert checker.cache.ghost(pod("ghost", uid)) is not None


class CountingKube(EtcdKube):
    def __init__(self, etcd: Etcd) -> None:
        super().__init__(etcd)
        self.gets: list[str] = []

    def quorum_get(self, namespace: str, name: str, timeout: float | None = None):
        self.gets.append(name)
        return super().quorum_get(namespace, name, timeout)


def test_a_backlog_bound_through_the_watch_costs_the_missing_pod_check_no_quorum_get(world):
    """A backlog bound while one replica is watched and another was listed before the binds (a listing
    of 10,000 pods waits 20 s for the next): past --missing-after the listed view still shows the bound
    pods that the watched one dropped. They are pending nowhere, so the missing-pod check asks etcd
    nothing about them and the sweep suspects no one; before, it confirmed 20 a second with a quorum GET apiece (10,120-10,420 GETs
    for 10,000 pods in the scale sweep, and 6 for 5 in the real tier's bench case). A pod the watched
    replica's cache never showed, and the listing shows later than the watch began, is still asked about."""
    etcd, gets, checker, pv, replicas, views = world
    clock = FakeClock()
    kube = CountingKube(etcd)
    monitor = CacheHealthMonitor(checker.settings, kube, Pool(replicas), pv.views.pending_views, clock=clock)
    clients = {r.replica.address: r for r in replicas}
    watched, listed = views
    watched.watched = True
    pv.views.list_view(watched)  # the watch's own listing, before the pods
    for i in range(5):
        etcd.create(f"p-{i}")
    for event in iter(replicas[0].deliver, None):
        pv.views.apply_event(watched, event)
    catch_up(replicas[1])
    pv.views.list_view(listed)  # replica 2 listed with the backlog pending
    monitor.check_missing(clients, clock())  # every pod first seen now
    for i in range(5):
        etcd.bind(f"p-{i}")
    for event in iter(replicas[0].deliver, None):
        pv.views.apply_event(watched, event)  # the watch drops them as they are bound
    assert watched.pods == {} and len(listed.pods) == 5  # replica 2 not listed again yet
    assert pv.views.disagreements() == []  # nor does the sweep suspect replica 2 of serving ghosts
    clock.advance(checker.settings.missing_after)
    monitor.check_missing(clients, clock())
    assert kube.gets == []

    # Control: a pod whose creation the watched replica's cache lost, listed by replica 2 after the watch began.
    etcd.create("lost")
    replicas[0].drop()
    catch_up(replicas[1])
    pv.views.list_view(listed)
    monitor.check_missing(clients, clock())
    clock.advance(checker.settings.missing_after)
    monitor.check_missing(clients, clock())
    assert kube.gets == ["lost"]
    monitor.close()


def test_the_listing_interval_is_a_few_seconds_idle_or_not_and_grows_with_the_backlog():
    etcd = Etcd()
    clock = FakeClock()
    checker = Checker(settings(prepare_idle_after=60.0, sweep_interval=30.0), ScriptedGets(etcd), timer=clock,
                      background=False)
    replica = ReplicaModel("10.0.0.1:6443", etcd)
    pv = Preparer(checker.settings, Pool([replica]), checker)
    view = ReplicaView(replica)
    assert pv.views.list_interval(view) == 3.0  # idle: the scheduler may read a replica that lost creations
    pv.called()
    assert pv.views.list_interval(view) == 3.0
    view.pods = {str(i): pod(f"p-{i}", str(i)) for i in range(20 * LIST_OBJECTS_PER_SECOND)}
    assert pv.views.list_interval(view) == 20.0  # a backlog of 10,000 pods: every 20 s
    short = Preparer(settings(sweep_interval=2.0), Pool([replica]), checker)
    assert short.views.list_interval(ReplicaView(replica)) == 1.0  # two sweeps in a row see fresh listings


class StreamingReplica(ReplicaModel):
    """A replica whose watch streams block until the test hands them an event (one queue per stream)."""

    def __init__(self, address: str, etcd: Etcd) -> None:
        super().__init__(address, etcd)
        self.streams: list[queue.Queue] = []
        self.open = 0

    def watch_pending(self, resource_version: str, *, timeout_seconds: int = 300):
        q: queue.Queue = queue.Queue()
        self.streams.append(q)
        self.open += 1
        try:
            while (event := q.get(timeout=30)) is not None:
                yield event
        finally:
            self.open -= 1


def test_a_watch_that_comes_back_to_its_replica_ends_the_old_stream():
    """Idle, then called again: the watch returns to the same replica with a new stream, and the
    stream from before (stopped while it waited for an event) ends at its next event instead of
    running on beside the new one."""
    etcd = Etcd()
    clock = FakeClock()
    checker = Checker(settings(prepare_idle_after=60.0), ScriptedGets(etcd), timer=clock, background=False)
    replica = StreamingReplica("10.0.0.1:6443", etcd)
    pv = Preparer(checker.settings, Pool([replica]), checker)
    pv.views.replicas_changed([replica], [])
    try:
        pv.called()
        pv.views.manage()  # active: the watch starts on the one replica
        eventually(lambda: replica.open == 1, 10, what="the first stream open")
        clock.advance(61)
        pv.views.manage()  # idle: the watch is told to stop; its stream waits for an event
        pv.called()
        pv.views.manage()  # active again: a new watch, a new stream, on the same replica
        eventually(lambda: len(replica.streams) == 2 and replica.open == 2, 10, what="the second stream open")
        etcd.create("web")
        event = replica.deliver()
        replica.streams[0].put(event)  # the old stream's next event
        eventually(lambda: replica.open == 1, 10, what="the old stream ended")
        replica.streams[1].put(event)
        eventually(lambda: any(p.name == "web" for v in pv.views.pending_views().pods.values() for p in v.values()), 10,
                   what="the new stream's event applied")
    finally:
        pv.close()
        for q in replica.streams:
            q.put(None)


def test_without_a_pre_verifier_every_replica_is_listed_and_nothing_is_watched_or_verified():
    """--no-prepare: the views have no listener. Every replica is listed (none watched, whatever the
    calls), the views say which pods each shows (what the missing-pod check compares), and nothing is
    verified nor any cached read dropped."""
    from guard.engine.replica_views import ReplicaViews

    etcd = Etcd()
    gets = ScriptedGets(etcd)
    checker = Checker(settings(prepare_idle_after=0), gets, timer=FakeClock(), background=False)
    replicas = [ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)]
    rv = ReplicaViews(checker.settings, Pool(replicas), checker.cache.tick)
    made = rv.replicas_changed(replicas, [])
    uid = etcd.create("lost")
    catch_up(replicas[0])
    replicas[1].drop()  # replica 2 never hears of it: its watch lost the creation
    rv.manage()
    eventually(lambda: all(v.synced and not v.listing for v in made), 10, what="both replicas listed")
    assert not any(v.watched for v in made) and rv.watch_status()["fallback"] is None
    views = rv.pending_views()
    (lost,) = views.pods["10.0.0.1:6443"].values()
    assert (lost.name, lost.uid) == ("lost", uid) and views.pods["10.0.0.2:6443"] == {}
    assert views.views["10.0.0.2:6443"].synced and not views.views["10.0.0.2:6443"].current
    assert rv.knows(lost)
    assert gets.count == 0
    rv.close()
