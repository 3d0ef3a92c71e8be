"""A guard replica nobody calls does not verify ahead (--prepare-idle-after); the first call after
that takes over: answered inline, and the backlog the watch holds is verified in the background.

In process, on a fake clock (no sleeps): the checker's quorum GETs are counted by the scripted
etcd, the watch events are delivered by hand, the verification queue is run by hand.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from scripted import Etcd, FakeClock, Pool, ReplicaModel, ScriptedGets, check, pod, settings

from guard.engine.checker import Checker, Events
from guard.engine.prepare import Preparer
from guard.engine.replica_views import ReplicaView
from guard.core.verdict import Verdict

IDLE_AFTER = 60.0


@pytest.fixture
def world():
    etcd = Etcd()
    gets = ScriptedGets(etcd)
    clock = FakeClock()
    replicas = [ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)]
    built: list[Preparer] = []

    def events(checker: Checker) -> Events:  # the pre-verifier hears the calls, as guard.engine.wiring wires it
        built.append(Preparer(checker.settings, Pool(replicas), checker))
        return Events(called=built[0].called)

    checker = Checker(settings(prepare_idle_after=IDLE_AFTER), gets, events=events, timer=clock, background=False)
    (pv,) = built
    views = [ReplicaView(r) for r in replicas]
    return etcd, gets, clock, checker, pv, replicas, views


def deliver_all(pv: Preparer, replicas: list[ReplicaModel], views: list[ReplicaView]) -> None:
    for replica, view in zip(replicas, views):
        while (event := replica.deliver()) is not None:
            pv.views.apply_event(view, event)


def drain(pv: Preparer) -> int:
    n = 0
    while pv.verify_next():
        n += 1
    return n


def test_a_guard_never_called_watches_but_makes_no_quorum_get(world):
    etcd, gets, clock, checker, pv, replicas, views = world
    uids = [etcd.create(f"web-{i}") for i in range(5)]
    deliver_all(pv, replicas, views)
    assert not pv.active()
    assert drain(pv) == 0
    assert gets.count == 0
    assert pv.idle_status()["backlog"] == 5
    # The watch still does its work while idle: a delete drops the pod from the backlog and marks
    # the identity gone (a stale read of the name can no longer pass it).
    etcd.delete("web-4")
    deliver_all(pv, replicas, views)
    assert pv.idle_status()["backlog"] == 4
    assert checker.cache.gone_since(pod("web-4", uids[4]))


def test_the_takeover_call_is_answered_inline_and_queues_the_backlog_oldest_first(world):
    etcd, gets, clock, checker, pv, replicas, views = world
    uids = [etcd.create(f"web-{i}") for i in range(4)]
    deliver_all(pv, replicas, views)
    takeovers = REGISTRY.get_sample_value("ghost_guard_prepare_takeovers_total") or 0.0
    first = check(checker, pod("web-0", uids[0]))  # the first call: no prepared verdict, a GET of its own
    assert first.verdict is Verdict.ALIVE
    assert gets.count == 1
    assert pv.active()
    order = []
    real = checker.verify

    def spy(p, known_at, **kw):
        order.append(p.name)
        return real(p, known_at, **kw)

    checker.verify = spy  # type: ignore[method-assign]
    assert drain(pv) == 4  # the takeover queued the backlog: web-0 was asked already, no second GET
    assert order == ["web-0", "web-1", "web-2", "web-3"]
    assert gets.count == 4
    assert REGISTRY.get_sample_value("ghost_guard_prepare_takeovers_total") == takeovers + 1
    assert pv.idle_status()["backlog"] == 0
    for i in (1, 2, 3):  # the rest of the backlog finds its verdicts ready
        assert check(checker, pod(f"web-{i}", uids[i])).verdict is Verdict.ALIVE
    assert gets.count == 4


def test_an_active_guard_verifies_each_new_pod_once_and_goes_idle_after_the_setting(world):
    etcd, gets, clock, checker, pv, replicas, views = world
    etcd.create("a-0")
    deliver_all(pv, replicas, views)
    check(checker, pod("a-0", etcd.pods["a-0"].uid))  # takeover; inline GET
    drain(pv)
    assert gets.count == 1
    b = etcd.create("b-0")
    deliver_all(pv, replicas, views)  # both replicas show it: queued once
    assert drain(pv) == 1
    assert gets.count == 2
    clock.advance(IDLE_AFTER - 0.1)
    assert pv.active()
    clock.advance(0.1)
    assert not pv.active()
    c = etcd.create("c-0")
    deliver_all(pv, replicas, views)
    assert drain(pv) == 0 and gets.count == 2  # idle: kept for the next takeover
    # A call for a pod verified while active is answered from its prepared verdict; it is also the
    # takeover, which queues c-0.
    assert check(checker, pod("b-0", b)).verdict is Verdict.ALIVE
    assert gets.count == 2
    assert drain(pv) == 1 and gets.count == 3
    assert check(checker, pod("c-0", c)).verdict is Verdict.ALIVE
    assert gets.count == 3


def test_a_pod_deleted_while_idle_is_not_verified_at_the_takeover(world):
    etcd, gets, clock, checker, pv, replicas, views = world
    etcd.create("web-0")
    doomed = etcd.create("web-1")
    deliver_all(pv, replicas, views)
    etcd.delete("web-1")
    deliver_all(pv, replicas, views)
    check(checker, pod("web-0", etcd.pods["web-0"].uid))
    assert drain(pv) == 1  # web-0 only (asked already: no GET)
    assert gets.count == 1
    # A late call for the deleted pod still gets its verdict, inline, from a read after it was known.
    assert check(checker, pod("web-1", doomed)).verdict is Verdict.GHOST_DELETED


def test_a_pod_recreated_while_idle_is_never_condemned_by_a_read_of_its_predecessor(world):
    """The first law across an idle spell: web-0 (A) read and cached, deleted and recreated (B)
    while idle; the takeover's background verification of B reads past the cached read of A."""
    etcd, gets, clock, checker, pv, replicas, views = world
    a = etcd.create("web-0")
    deliver_all(pv, replicas, views)
    check(checker, pod("web-0", a))
    drain(pv)
    clock.advance(IDLE_AFTER)
    etcd.delete("web-0")
    replicas[0].drop()  # one replica's watch lost the delete
    pv.views.apply_event(views[1], replicas[1].deliver())
    b = etcd.create("web-0")
    deliver_all(pv, replicas, views)
    late = check(checker, pod("web-0", a))  # the takeover: a late call for A, inline, a ghost
    assert late.is_ghost
    drain(pv)
    assert checker.cache.ghost(pod("web-0", b)) is None
    assert check(checker, pod("web-0", b)).verdict is Verdict.ALIVE


def test_idle_after_zero_always_verifies_ahead():
    etcd = Etcd()
    gets = ScriptedGets(etcd)
    checker = Checker(settings(prepare_idle_after=0), gets, timer=FakeClock(), background=False)
    replica = ReplicaModel("10.0.0.1:6443", etcd)
    pv = Preparer(checker.settings, Pool([replica]), checker)
    view = ReplicaView(replica)
    etcd.create("web-0")
    pv.views.apply_event(view, replica.deliver())
    assert pv.active()
    assert drain(pv) == 1 and gets.count == 1
    assert pv.idle_status() == {"active": True, "idle_after": 0.0, "last_call_seconds_ago": None, "backlog": 0,
                                "queued": 0, "takeovers": 0}


def test_readyz_detail_says_idle_and_since_when(world):
    etcd, gets, clock, checker, pv, replicas, views = world
    assert pv.idle_status() == {"active": False, "idle_after": IDLE_AFTER, "last_call_seconds_ago": None,
                                "backlog": 0, "queued": 0, "takeovers": 0}
    pv.called()
    clock.advance(61.5)
    status = pv.idle_status()
    assert status["active"] is False and status["last_call_seconds_ago"] == 61.5
