"""The verdict state under every interleaving that matters, in process and deterministic.

The law (docs/ARCHITECTURE.md): a verdict belongs to one pod identity (namespace, name, UID), and
a ghost is only condemned by a quorum read that began after the guard knew that UID. Each test
scripts one interleaving: which read is in flight, what etcd answers and as of when, which watch
event arrives before which.
"""

from __future__ import annotations

import itertools
import threading

import pytest
from scripted import (Call, Etcd, EtcdKube, FakeClock, NS, Pool, ReplicaModel, ScriptedGets, answer_prepared, check,
    pod, settings)

from guard.audit.sqlite import AuditStore
from guard.engine.checker import Checker, CheckerEvents, Events
from guard.engine.incident import PROBE_RETRIES, PROBE_RETRY_DELAY, IncidentRecorder
from guard.engine.prepare import Preparer
from guard.engine.replica_views import ReplicaView
from guard.core.verdict import Decision, Verdict


class Relay:
    """The checker's events, for a test that builds what hears them after the checker (the running guard
    gives them at construction, guard.engine.wiring): each forwarded to ``to``."""

    def __init__(self) -> None:
        self.to: CheckerEvents = Events()

    def called(self) -> None:
        self.to.called()

    def record_block(self, *args) -> None:
        self.to.record_block(*args)

    def new_ghost(self, *args) -> None:
        self.to.new_ghost(*args)

    def sighting(self, *args) -> None:
        self.to.sighting(*args)

    def tier(self, pod):
        return self.to.tier(pod)


@pytest.fixture
def world():
    etcd = Etcd()
    gets = ScriptedGets(etcd)
    clock = FakeClock()
    checker = Checker(settings(), gets, events=Relay(), timer=clock, background=False)
    return etcd, gets, clock, checker


def watch(checker: Checker, etcd: Etcd) -> tuple[Preparer, ReplicaView, ReplicaModel]:
    """A Preparer with one replica's view, fed by hand (apply_event), its queue run by hand. A
    scheduler call has just arrived (``called``): it verifies ahead (--prepare-idle-after)."""
    replica = ReplicaModel("10.0.0.1:6443", etcd)
    pv = Preparer(checker.settings, Pool([replica]), checker)
    pv.called()
    return pv, ReplicaView(replica), replica


# -- the StatefulSet recreate (issue 11, finding 1) -------------------------------------------------


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_recreate_inside_the_burst_window_never_condemns_the_new_pod(world, how):
    etcd, gets, clock, checker = world
    a = etcd.create("web-0")
    if how == "deleted":
        etcd.delete("web-0")
        late = check(checker, pod("web-0", a))  # the scheduler's last, late call for A: 404, cached by name
        assert late.verdict is Verdict.GHOST_DELETED
    else:
        first = check(checker, pod("web-0", a))  # A's generation is read and cached by name
        assert first.verdict is Verdict.ALIVE
        etcd.delete("web-0")
    b = etcd.create("web-0")  # the controller recreates the name within the read cache's 0.5 s
    assert check(checker, pod("web-0", b)).verdict is Verdict.ALIVE
    # One extra GET, past the cache, before anything is condemned.
    assert gets.count == 2
    assert checker.cache.ghost(pod("web-0", b)) is None


def test_background_verification_of_the_recreated_pod_rereads_past_the_cached_404(world):
    etcd, gets, clock, checker = world
    pv, view, replica = watch(checker, etcd)
    a = etcd.create("web-0")
    etcd.delete("web-0")
    assert check(checker, pod("web-0", a)).verdict is Verdict.GHOST_DELETED
    b = etcd.create("web-0")
    # This view lost A's events and B's ADDED (nothing invalidated the cached 404); it learns B
    # from a later MODIFIED.
    replica.drop(), replica.drop(), replica.drop()
    pv.views.apply_event(view, {"type": "MODIFIED", "object": etcd.pods["web-0"].obj("web-0", etcd.revision)})
    assert pv.verify_next()
    assert gets.count == 2  # the cached 404 began before B was known: read again
    assert checker.cache.ghost(pod("web-0", b)) is None
    assert check(checker, pod("web-0", b)).verdict is Verdict.ALIVE
    assert gets.count == 2  # B's first call: the prepared verdict


def test_a_shared_in_flight_read_across_a_recreate_passes_but_never_condemns(world):
    etcd, gets, clock, checker = world
    a = etcd.create("web-0")
    gets.hold = True
    call_a = Call(lambda: check(checker, pod("web-0", a)), "A")
    (get_a,) = gets.held
    etcd.delete("web-0")
    b = etcd.create("web-0")
    call_b = Call(lambda: check(checker, pod("web-0", b)), "B")  # joins A's GET, in flight since before B
    assert gets.held == [get_a]
    etcd.delete("web-0")  # B goes too: only a read that began after B was known may say so
    b2 = etcd.create("web-0")
    gets.release(get_a, as_of_start=True)  # A's read answers with A's generation: B is "replaced"
    (reread,) = gets.held  # B's call reads again, past the shared read, before condemning
    gets.release(reread, as_of_start=True)
    assert call_a.result().verdict is Verdict.ALIVE
    assert call_b.result().verdict is Verdict.GHOST_REPLACED  # by b2, seen by a read that began after B
    assert checker.cache.ghost(pod("web-0", b)) is not None
    assert check(checker, pod("web-0", b2)).verdict is Verdict.ALIVE


ORDERS = list(itertools.permutations(["ADDED", "DELETED", "answer"]))


@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_watch_events_in_every_order_against_a_read_in_flight(world, order):
    """A's read is in flight; the watch shows A DELETED (on one replica) and B ADDED (on another,
    which lost the delete), and the read answers, in every order."""
    etcd, gets, clock, checker = world
    pv, view, replica = watch(checker, etcd)
    other = ReplicaModel("10.0.0.2:6443", etcd)
    other_view = ReplicaView(other)
    a = etcd.create("web-0")
    pv.views.apply_event(view, replica.deliver())
    pv.views.apply_event(other_view, other.deliver())
    gets.hold = True
    call_a = Call(lambda: check(checker, pod("web-0", a)), "A")
    (get_a,) = gets.held
    etcd.delete("web-0")
    b = etcd.create("web-0")
    for step in order:
        if step == "answer":
            gets.release(get_a, as_of_start=True)  # as of its start: A pending
        elif step == "DELETED":
            assert replica.events[0]["type"] == "DELETED"
            pv.views.apply_event(view, replica.deliver())
        else:
            assert other.drop()["type"] == "DELETED"  # this replica lost A's delete
            pv.views.apply_event(other_view, other.deliver())
            assert set(other_view.pods) == {a, b}
    gets.hold = False
    for get in list(gets.held):  # A's call read again (the watch had shown A gone): etcd now has B
        gets.release(get, as_of_start=True)
    answered_first = order.index("answer") < order.index("DELETED")
    # A read from before the delete may pass A; once the watch showed A gone, A is condemned
    # only by a read that began after: "replaced" (etcd has B under the name).
    assert call_a.result().verdict is (Verdict.ALIVE if answered_first else Verdict.GHOST_REPLACED)
    # Whatever the order, B is never judged by a read of A's generation.
    assert check(checker, pod("web-0", b)).verdict is Verdict.ALIVE
    assert check(checker, pod("web-0", a)).verdict is Verdict.GHOST_REPLACED
    assert checker.cache.ghost(pod("web-0", b)) is None
    # GETs: A's, and one more unless A's re-read came after both events (then it serves B too).
    both_before = order.index("answer") == 2
    assert gets.count == (2 if both_before else 3)


def test_an_invalidated_read_in_flight_is_not_stored(world):
    etcd, gets, clock, checker = world
    a = etcd.create("web-0")
    gets.hold = True
    call = Call(lambda: check(checker, pod("web-0", a)), "A")
    (get,) = gets.held
    checker.cache.invalidate_name(NS, "web-0")  # the watch showed the name ADDED or DELETED
    gets.release(get)
    assert call.result().verdict is Verdict.ALIVE
    gets.hold = False
    read = checker.cache.read(NS, "web-0", timeout=1.0)
    assert read.own  # nothing stored: a GET of its own


def test_a_read_started_before_a_delete_passes_and_the_next_call_condemns_with_its_own_read(world):
    etcd, gets, clock, checker = world
    pv, view, replica = watch(checker, etcd)
    a = etcd.create("web-0")
    pv.views.apply_event(view, replica.deliver())
    gets.hold = True
    call = Call(lambda: check(checker, pod("web-0", a)), "A")
    (get,) = gets.held
    etcd.delete("web-0")
    pv.views.apply_event(view, replica.deliver())  # DELETED(A): the identity is gone
    gets.release(get, as_of_start=True)  # as of its start: A pending
    # The read says pending, the watch says gone: the call reads again past the cache, and
    # that read (begun after A was known) condemns A.
    (again,) = gets.held
    gets.release(again, as_of_start=True)
    assert call.result().verdict is Verdict.GHOST_DELETED
    assert gets.count == 2


# -- one identity, one verdict (issue 11, finding 2) -------------------------------------------------


def test_the_same_uid_under_another_name_never_reuses_its_verdict(world):
    etcd, gets, clock, checker = world
    live = etcd.create("web-0")
    forged = check(checker, pod("does-not-exist", live))
    assert forged.verdict is Verdict.GHOST_DELETED
    assert check(checker, pod("web-0", live)).verdict is Verdict.ALIVE
    assert checker.cache.ghost(pod("web-0", live)) is None


def test_a_prepared_verdict_is_never_reached_by_another_name(world):
    etcd, gets, clock, checker = world
    pv, view, replica = watch(checker, etcd)
    live = etcd.create("web-0")
    pv.views.apply_event(view, replica.deliver())
    assert pv.verify_next()
    assert gets.count == 1
    other = check(checker, pod("other", live))  # not web-0's prepared alive verdict: a read of "other"
    assert other.verdict is Verdict.GHOST_DELETED
    assert gets.count == 2
    assert check(checker, pod("web-0", live)).verdict is Verdict.ALIVE
    assert gets.count == 2  # web-0's own prepared verdict, untouched


# -- dry runs (issue 11, finding 3) ------------------------------------------------------------------


def test_a_dry_run_records_nothing_and_the_next_real_call_records_once(world):
    etcd, gets, clock, checker = world
    seen = []
    checker.events.to = Events(new_ghost=lambda p, d, r: seen.append(p))
    a = etcd.create("web-0")
    etcd.delete("web-0")
    assert check(checker, pod("web-0", a), record=False).is_ghost
    assert check(checker, pod("web-0", a), record=False).is_ghost
    assert seen == []
    assert check(checker, pod("web-0", a)).is_ghost
    assert check(checker, pod("web-0", a)).is_ghost
    assert seen == [pod("web-0", a)]


# -- the request budget (issue 12) -----------------------------------------------------------------


def test_a_call_past_its_budget_fails_open_without_a_get(world):
    etcd, gets, clock, checker = world
    a = etcd.create("web-0")
    arrived = clock()
    clock.advance(checker.settings.request_budget + 0.01)  # e.g. the body took the whole budget
    decision = check(checker, pod("web-0", a), deadline=checker.deadline(arrived))
    assert decision.verdict is Verdict.UNKNOWN and "budget" in decision.reason
    assert gets.count == 0
    assert not checker.blocks(decision)


def test_the_get_is_given_what_is_left_of_the_budget():
    etcd, clock, asked = Etcd(), FakeClock(), []

    def timed(namespace, name, timeout):
        asked.append(round(timeout, 6))
        return etcd.read(name)

    checker = Checker(settings(), timed, timer=clock, background=False)
    a = etcd.create("web-0")
    arrived = clock()
    clock.advance(0.75)
    check(checker, pod("web-0", a), deadline=checker.deadline(arrived))
    assert asked == [round(checker.settings.request_budget - 0.75, 6)]


# -- attribution (issue 11, finding 1, second half) -------------------------------------------------


def recorder(checker: Checker, etcd: Etcd, replicas: list[ReplicaModel], audit: AuditStore):
    """The incident recorder on the checker, etcd, these replicas and a real audit store; its
    timers only record the delay asked for (the test runs them)."""
    delays = []
    rec = IncidentRecorder(checker.settings, EtcdKube(etcd), Pool(replicas), audit, retract=checker.retract,
                           later=lambda delay, fn, *args: delays.append((delay, fn, args)))
    checker.events.to = Events(new_ghost=rec.new_ghost)
    return rec, delays


@pytest.fixture
def audit(tmp_path):
    with AuditStore(tmp_path / "audit.db") as store:
        yield store


def test_a_replica_serving_the_live_pod_is_never_blamed(world, audit):
    etcd, gets, clock, checker = world
    stale, healthy = ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)
    a = etcd.create("web-0")
    etcd.delete("web-0")
    b = etcd.create("web-0")
    healthy.deliver(), healthy.deliver(), healthy.deliver()  # ADDED A, DELETED A, ADDED B
    stale.deliver(), stale.drop(), stale.drop()  # ADDED A only: it still serves A
    rec, delays = recorder(checker, etcd, [stale, healthy], audit)
    ghost = pod("web-0", a)
    assert check(checker, ghost).verdict is Verdict.GHOST_REPLACED  # new_ghost: record, etcd, probes
    ((delay, fn, args),) = delays
    assert delay == checker.settings.stale_confirm_delay
    fn(*args)  # the confirmation round
    (record,) = audit.records()
    assert (record.uid, record.stale_replicas) == (a, ["10.0.0.1:6443"])
    # the evidence is what the quorum GET answered: the other UID etcd has under that name
    assert record.evidence["quorum_get"] == {"outcome": "found", "http_status": 200, "uid": b, "node_name": None,
                                             "deletion_timestamp": None, "resource_version": str(etcd.revision)}
    assert check(checker, pod("web-0", b)).verdict is Verdict.ALIVE


def run_due(delays: list) -> list[str]:
    """Run the timers asked for so far, in order (and any they ask for); the names of what ran."""
    ran = []
    while delays:
        _, fn, args = delays.pop(0)
        ran.append(args[0].__name__ if fn.__name__ == "_run_safely" else fn.__name__)
        fn(*args)
    return ran


@pytest.mark.parametrize("unanswered,at", [(1, "round"), (3, "round"), (1, "confirmation"), (3, "confirmation")])
def test_a_probe_with_no_answer_is_asked_again_and_the_stale_replica_named(world, audit, unanswered, at):
    """A probe that times out (a loaded machine) does not leave the ghost unattributed until its next sighting
    past --reprobe-interval: the replica is asked again, PROBE_RETRIES times at most."""
    etcd, gets, clock, checker = world
    stale, healthy = ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)
    a = etcd.create("web-0")
    stale.deliver(), healthy.deliver()
    etcd.delete("web-0")
    healthy.deliver()  # the stale replica lost the DELETE
    rec, delays = recorder(checker, etcd, [stale, healthy], audit)
    if at == "round":
        stale.unanswered = unanswered
        assert check(checker, pod("web-0", a)).verdict is Verdict.GHOST_DELETED
    else:
        assert check(checker, pod("web-0", a)).verdict is Verdict.GHOST_DELETED
        stale.unanswered = unanswered
    assert delays and all(d in (checker.settings.stale_confirm_delay, PROBE_RETRY_DELAY) for d, _, _ in delays)
    ran = run_due(delays)
    assert ran.count("_retry_round" if at == "round" else "_confirm") == unanswered + (at == "confirmation")
    (record,) = audit.records()
    assert record.stale_replicas == ["10.0.0.1:6443"]


def test_a_replica_that_never_answers_is_asked_a_bounded_number_of_times_and_never_named(world, audit):
    etcd, gets, clock, checker = world
    stale, silent = ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)
    a = etcd.create("web-0")
    stale.deliver(), silent.deliver()
    etcd.delete("web-0")
    silent.deliver()
    silent.unanswered = 100
    rec, delays = recorder(checker, etcd, [stale, silent], audit)
    assert check(checker, pod("web-0", a)).verdict is Verdict.GHOST_DELETED
    ran = run_due(delays)
    assert ran.count("_retry_round") == PROBE_RETRIES and silent.unanswered == 100 - 1 - PROBE_RETRIES
    (record,) = audit.records()
    assert record.stale_replicas == ["10.0.0.1:6443"]  # the silent one is not blamed


def test_a_probe_round_that_runs_into_the_close_is_skipped_quietly(world, audit, caplog):
    """A follow-up still queued at SIGTERM probes after the recorder closed its probe pool: no error line
    (log-based alerting on a rollout), no record, nobody blamed."""
    etcd, gets, clock, checker = world
    stale = ReplicaModel("10.0.0.1:6443", etcd)
    a = etcd.create("web-0")
    stale.deliver()
    etcd.delete("web-0")
    rec, delays = recorder(checker, etcd, [stale], audit)
    rec.close()
    with caplog.at_level("DEBUG"):
        assert rec.probe(pod("web-0", a)) == []
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.text
    assert delays == [] and audit.records() == []


def test_a_probe_round_whose_probes_the_close_cancels_is_skipped_quietly(world, audit, caplog):
    """At the worker's exit the recorder is closed while a round is in flight: its probe pool's queued probes are
    cancelled (CancelledError in the round): no error line, nobody blamed. More replicas than the pool's 8
    threads, each probe held until the close, so some probes are still queued when it comes."""
    etcd, gets, clock, checker = world
    a = etcd.create("web-0")
    held, started = threading.Event(), threading.Semaphore(0)

    class Held(ReplicaModel):
        def probe(self, namespace, name, uid, *, at):
            started.release()
            held.wait(10)
            return super().probe(namespace, name, uid, at=at)

    replicas = [Held(f"10.0.0.{i}:6443", etcd) for i in range(1, 11)]
    for r in replicas:
        r.deliver()
    etcd.delete("web-0")
    rec, delays = recorder(checker, etcd, replicas, audit)
    out: list = []
    with caplog.at_level("DEBUG"):
        t = threading.Thread(target=lambda: out.append(rec.probe(pod("web-0", a))))
        t.start()
        for _ in range(8):  # every pool thread holds a probe; the other two wait in the queue
            assert started.acquire(timeout=10)
        rec.close()
        held.set()
        t.join(10)
    assert out == [[]]
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.text
    assert delays == [] and [rec_.stale_replicas for rec_ in audit.records()] == []


def test_a_ghost_verdict_contradicted_by_etcd_is_withdrawn_and_nobody_is_blamed(world, audit):
    etcd, gets, clock, checker = world
    r1, r2 = ReplicaModel("10.0.0.1:6443", etcd), ReplicaModel("10.0.0.2:6443", etcd)
    a = etcd.create("web-0")
    r1.deliver(), r2.deliver()  # both serve A, which etcd has pending: the truth
    ghost = pod("web-0", a)
    # A verdict that should never have been made (stored by hand, as a bug would): a 404 of
    # another name, taken as A's.
    read = checker.cache.read(NS, "another-name", timeout=1.0)
    assert checker.cache.remember_ghost(ghost, Decision(Verdict.GHOST_DELETED, "bug"), read, known_at=0)
    rec, delays = recorder(checker, etcd, [r1, r2], audit)
    assert check(checker, ghost).is_ghost  # the cached verdict answers once; its follow-up asks etcd
    assert checker.cache.ghost(ghost) is None  # withdrawn at once
    assert delays == []  # no confirmation round: nobody is blamed
    assert audit.records() == []
    (retracted,) = audit.records(retracted=True)
    assert retracted.retracted_at is not None and retracted.stale_replicas == []
    assert check(checker, ghost).verdict is Verdict.ALIVE


def test_remember_ghost_refuses_a_read_older_than_the_uid(world):
    etcd, gets, clock, checker = world
    read = checker.cache.read(NS, "web-0", timeout=1.0)
    known_at = checker.cache.tick()
    assert not checker.cache.remember_ghost(pod("web-0", "u"), Decision(Verdict.GHOST_DELETED, "x"), read, known_at)
    assert checker.cache.ghost(pod("web-0", "u")) is None


# -- answered without waiting (the worker's event loop: Checker.answer, now) ------------------------


def test_only_a_prepared_alive_verdict_is_answered_without_waiting_and_nothing_else_is_consumed(world):
    etcd, gets, clock, checker = world
    pv, view, replica = watch(checker, etcd)
    live = etcd.create("web-0")
    gone = etcd.create("web-1")
    pv.views.apply_event(view, replica.deliver())
    pv.views.apply_event(view, replica.deliver())
    assert pv.verify_next() and pv.verify_next()
    assert gets.count == 2
    # Not prepared (another UID under the name, an unknown pod): None, no GET, nothing taken.
    assert answer_prepared(checker, pod("web-0", "other-uid")) is None
    assert answer_prepared(checker, pod("nope", "u")) is None
    assert gets.count == 2
    # A ghost, even one with a prepared verdict from before its delete, is never answered here.
    etcd.delete("web-1")
    assert check(checker, pod("web-1", gone), deadline=clock() + 5).is_ghost is False  # prepared: first attempt
    clock.advance(1.0)  # past the grace: a later attempt reads etcd again
    assert check(checker, pod("web-1", gone)).is_ghost
    assert answer_prepared(checker, pod("web-1", gone)) is None
    # The prepared alive verdict is answered, as check() would, once per first attempt (and its grace).
    decision = answer_prepared(checker, pod("web-0", live))
    assert decision is not None and decision.verdict is Verdict.ALIVE
    assert gets.count == 3
    clock.advance(1.0)
    assert answer_prepared(checker, pod("web-0", live)) is None  # a later attempt: check() reads etcd
    assert check(checker, pod("web-0", live)).verdict is Verdict.ALIVE
    assert gets.count == 4
