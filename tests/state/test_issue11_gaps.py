"""Gaps found by the lab proof of issue 11 (tests/e2e/test_recreate.py), kept as in-process,
deterministic regression tests now that they are fixed."""

from __future__ import annotations

from scripted import Call, Etcd, FakeClock, Pool, ReplicaModel, ScriptedGets, check, pod, settings

from guard.engine.checker import Checker
from guard.engine.prepare import Preparer
from guard.engine.replica_views import ReplicaView
from guard.core.verdict import Verdict


def test_a_live_pod_costs_one_quorum_get_whatever_the_number_of_watches():
    etcd = Etcd()
    gets = ScriptedGets(etcd)
    checker = Checker(settings(), gets, timer=FakeClock(), background=False)
    r1, r2 = ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)
    pv = Preparer(checker.settings, Pool([r1, r2]), checker)
    pv.called()  # this guard is the one the scheduler asks: it verifies ahead
    v1, v2 = ReplicaView(r1), ReplicaView(r2)
    a = etcd.create("web-0")
    pv.views.apply_event(v1, r1.deliver())  # the first watch shows the new pod: verified in the background
    gets.hold = True
    background = Call(lambda: pv.verify_next(), "background verification")
    (get,) = gets.held
    pv.views.apply_event(v2, r2.deliver())  # the second watch shows the same pod, same UID
    call = Call(lambda: check(checker, pod("web-0", a)), "/filter")  # the scheduler asks meanwhile
    for held in list(gets.held):  # the read in flight, and a GET of the call's own if it made one
        gets.release(held)
    assert background.result() is True
    assert call.result().verdict is Verdict.ALIVE
    assert gets.count == 1  # the call waits for the read in flight, as before issue 11
