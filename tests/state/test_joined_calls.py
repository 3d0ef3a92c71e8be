"""Calls the worker's event loop parks on their pod's quorum GET in flight, in every interleaving
that matters (Checker.answer in the loop with a wake, asked again when the GET lands, or from a
thread when the read alone cannot answer).

The rule: a joined call gets the answer Checker.answer gives a call that waited for the same GET,
counted the same way, and a live pod is never answered as a ghost.
"""

from __future__ import annotations

import threading

import pytest
from prometheus_client import REGISTRY
from scripted import (Call, Etcd, FakeClock, Pool, ReplicaModel, ScriptedGets, answer_joined, answer_prepared, check,
    join_flight, pod, settings, settle)

from guard.engine.checker import Checker
from guard.engine.prepare import Preparer
from guard.engine.replica_views import ReplicaView
from guard.core.verdict import QuorumRead, Verdict

FAR = 60.0


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


class World:
    """etcd, the checker, one watched replica, and a pod whose background verification is in flight."""

    def __init__(self, **overrides) -> None:
        self.etcd = Etcd()
        self.gets = ScriptedGets(self.etcd)
        self.clock = FakeClock()
        self.checker = Checker(settings(**overrides), self.gets, timer=self.clock, background=False)
        self.replica = ReplicaModel("10.0.0.1:6443", self.etcd)
        self.pv = Preparer(self.checker.settings, Pool([self.replica]), self.checker)
        self.pv.called()
        self.view = ReplicaView(self.replica)
        self.woken: list[str] = []

    def deliver_all(self) -> None:
        while (event := self.replica.deliver()) is not None:
            self.pv.views.apply_event(self.view, event)

    def pod_in_flight(self, name: str = "web-0"):
        """A new pod, shown by the watch, whose background GET is held in flight."""
        p = pod(name, self.etcd.create(name))
        self.deliver_all()
        self.gets.hold = True
        Call(self.pv.verify_next, "verify")
        assert len(self.gets.held) == 1
        return p

    def wake(self) -> None:
        self.woken.append(threading.current_thread().name)


def fail(gets: ScriptedGets, reason: str = "etcdserver: request timed out") -> None:
    """Answer the (one) held GET with an apiserver error."""
    (get,) = gets.held
    gets.held.remove(get)
    get.answer = QuorumRead.failed(reason)
    get.released.set()
    settle()


CHANGES = {
    "none": lambda etcd, name: None,
    "delete": lambda etcd, name: etcd.delete(name),
    "recreate": lambda etcd, name: (etcd.delete(name), etcd.create(name)),
    "bind": lambda etcd, name: etcd.bind(name),
    "terminate": lambda etcd, name: etcd.terminate(name),
}


@pytest.mark.parametrize("as_of_start", [True, False], ids=["get-answers-as-of-start", "get-answers-as-of-now"])
@pytest.mark.parametrize("watched", [False, True], ids=["watch-late", "watch-showed-it"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_a_joined_call_gets_the_answer_of_a_call_that_waited_for_the_same_get(change, watched, as_of_start):
    w = World()
    p = w.pod_in_flight()
    joined = join_flight(w.checker, p, w.wake)
    assert joined is not None and w.checker.cache.was_asked(p)
    twin = Call(lambda: check(w.checker, p, deadline=w.clock() + FAR), "twin")  # waits for the same GET
    assert not twin.done and len(w.gets.held) == 1
    assert answer_joined(w.checker, joined, w.clock() + FAR) is None  # not landed: nothing to answer yet
    assert w.woken == []

    CHANGES[change](w.etcd, p.name)
    if watched:
        w.deliver_all()
    w.gets.hold = False  # re-reads past the shared one are answered at once
    w.gets.release(w.gets.held[0], as_of_start=as_of_start)
    settle()
    assert w.woken == ["call-verify"]  # once, on the GET's own thread, when it landed

    decision = answer_joined(w.checker, joined, w.clock() + FAR)
    handed_over = decision is None
    if handed_over:  # the worker hands the call to a pool thread: check(), the same budget
        decision = check(w.checker, p, deadline=w.clock() + FAR)
    assert decision.verdict is twin.result().verdict
    assert not (decision.is_ghost and w.etcd.pending(p.name, p.uid))
    # The read passes the pod unless it shows the change, or a watch showed the change before it landed.
    ghost = change != "none" and (not as_of_start or watched)
    assert decision.is_ghost is ghost
    assert handed_over is ghost  # the loop answers alive itself; a ghost is check()'s to decide and record


def test_a_joined_alive_answer_is_counted_as_a_shared_read_and_leaves_no_prepared_verdict():
    w = World()
    p = w.pod_in_flight()
    before = {n: sample(n) for n in ("ghost_guard_verdicts_shared_read_total", "ghost_guard_verdicts_prepared_total")}
    alive = sample("ghost_guard_verdicts_total", verdict="alive")
    joined = join_flight(w.checker, p, w.wake)
    assert joined is not None
    w.gets.hold = False
    w.gets.release(w.gets.held[0])
    decision = answer_joined(w.checker, joined, w.clock() + FAR)
    assert decision is not None and decision.verdict is Verdict.ALIVE
    assert sample("ghost_guard_verdicts_shared_read_total") == before["ghost_guard_verdicts_shared_read_total"] + 1
    assert sample("ghost_guard_verdicts_total", verdict="alive") == alive + 1
    # The background verification landed after the call asked: its alive verdict is not kept for a
    # "first attempt" that has been answered already. A later attempt reads etcd again.
    assert answer_prepared(w.checker, p) is None
    assert sample("ghost_guard_verdicts_prepared_total") == before["ghost_guard_verdicts_prepared_total"]
    gets = w.gets.count
    assert check(w.checker, p, deadline=w.clock() + FAR).verdict is Verdict.ALIVE
    assert w.gets.count == gets  # the shared read is still fresh in the read cache
    w.clock.advance(1.0)
    assert check(w.checker, p, deadline=w.clock() + FAR).verdict is Verdict.ALIVE
    assert w.gets.count == gets + 1


@pytest.mark.parametrize("fail_closed", [False, True])
def test_a_failed_get_answers_a_joined_call_unknown_counted_as_check_counts_it(fail_closed):
    w = World(fail_closed=fail_closed)
    p = w.pod_in_flight()
    counter = "ghost_guard_fail_closed_total" if fail_closed else "ghost_guard_fail_open_total"
    before = sample(counter, reason="apiserver")
    joined = join_flight(w.checker, p, w.wake)
    assert joined is not None
    fail(w.gets)
    assert w.woken == ["call-verify"]
    gets = w.gets.count
    decision = answer_joined(w.checker, joined, w.clock() + FAR)
    assert decision is not None and decision.verdict is Verdict.UNKNOWN
    assert "request timed out" in decision.reason
    assert w.checker.blocks(decision) is fail_closed
    assert sample(counter, reason="apiserver") == before + 1
    assert w.gets.count == gets  # no second GET for the same attempt


def test_a_joined_call_answered_after_its_budget_counts_the_budget():
    w = World()
    p = w.pod_in_flight()
    before = sample("ghost_guard_fail_open_total", reason="budget")
    deadline = w.clock() + 2.0
    joined = join_flight(w.checker, p, w.wake)
    assert joined is not None
    w.clock.advance(3.0)
    fail(w.gets, "request budget exhausted")
    decision = answer_joined(w.checker, joined, deadline)
    assert decision is not None and decision.verdict is Verdict.UNKNOWN
    assert sample("ghost_guard_fail_open_total", reason="budget") == before + 1


def test_nothing_is_joined_without_a_get_in_flight_or_with_a_ghost_cached():
    w = World()
    p = pod("web-0", w.etcd.create("web-0"))
    assert join_flight(w.checker, p, w.wake) is None  # no GET in flight: check() makes its own
    assert not w.checker.cache.was_asked(p)  # and nothing was done
    w.etcd.delete("web-0")
    assert check(w.checker, p, deadline=w.clock() + FAR).is_ghost
    w.gets.hold = True
    Call(lambda: check(w.checker, pod("web-0", "other-uid"), deadline=w.clock() + FAR), "other")
    assert len(w.gets.held) == 1  # a GET of the name is in flight, but this identity is a known ghost
    assert join_flight(w.checker, p, w.wake) is None
    w.gets.release(w.gets.held[0])
    assert w.woken == []


def test_a_flight_the_watch_invalidated_is_not_joined_but_still_wakes_those_that_joined_it():
    w = World()
    p = w.pod_in_flight()
    joined = join_flight(w.checker, p, w.wake)
    assert joined is not None
    w.etcd.delete(p.name)
    new = pod(p.name, w.etcd.create(p.name))
    w.deliver_all()  # DELETED, then ADDED under the name: the read in flight began before both
    assert join_flight(w.checker, new, w.wake) is None  # the new identity is checked with a read of its own
    w.gets.hold = False
    w.gets.release(w.gets.held[0])  # as of its start: shows the old pod pending
    assert w.woken == ["call-verify"]
    assert answer_joined(w.checker, joined, w.clock() + FAR) is None  # the watch showed it gone first
    assert check(w.checker, p, deadline=w.clock() + FAR).verdict is Verdict.GHOST_REPLACED  # read past the old GET
    assert check(w.checker, new, deadline=w.clock() + FAR).verdict is Verdict.ALIVE


def test_a_wake_that_raises_neither_strands_the_read_nor_the_other_joined_calls():
    w = World()
    p = w.pod_in_flight()

    def broken() -> None:
        raise OSError("the event loop's pipe is closed")

    first = join_flight(w.checker, p, broken)
    second = join_flight(w.checker, p, w.wake)
    assert first is not None and second is not None
    w.gets.release(w.gets.held[0])
    assert w.woken == ["call-verify"]
    assert answer_joined(w.checker, second, w.clock() + FAR).verdict is Verdict.ALIVE
    assert answer_joined(w.checker, first, w.clock() + FAR).verdict is Verdict.ALIVE


@pytest.mark.parametrize("as_of_start", [True, False], ids=["get-answers-as-of-start", "get-answers-as-of-now"])
def test_a_new_uid_that_joins_a_get_begun_before_it_existed_is_never_condemned(as_of_start):
    """The StatefulSet recreate: the scheduler's informer shows the new pod before the guard's watch
    does, and the call for it joins the GET the old pod's verification began. That read may pass
    the new pod; it may not condemn it (it began before the guard knew the new UID)."""
    w = World()
    old = w.pod_in_flight()
    w.etcd.delete(old.name)
    new = pod(old.name, w.etcd.create(old.name))  # the guard's watch has shown neither change yet
    joined = join_flight(w.checker, new, w.wake)
    assert joined is not None
    w.gets.hold = False
    w.gets.release(w.gets.held[0], as_of_start=as_of_start)  # the old pod pending, or the new one
    decision = answer_joined(w.checker, joined, w.clock() + FAR)
    if decision is None:
        decision = check(w.checker, new, deadline=w.clock() + FAR)
    assert decision.verdict is Verdict.ALIVE
    assert w.checker.cache.ghost(new) is None
