"""The project's first law as a hypothesis state machine: never block a live pod, never blame a
healthy replica.

Random sequences of: create / delete / recreate-same-name / bind pods in etcd; scheduler calls
(/filter, /preempt and binding reviews all call ``Checker.answer``; dry-run reviews with
``record=False``) for any UID a name ever had, or a UID of another name; the same calls as the
worker's event loop takes them (a prepared verdict, or parked on the pod's GET in flight and
answered when it lands, or handed to ``Checker.answer`` then or when the budget nearly runs out); background
verifications (and the takeover of the backlog after an idle spell); quorum GETs held in flight
and answered as of their start or as of now; watch events delivered late, or dropped, per replica;
replica restarts; the incident recorder's confirmation rounds; clock steps; idle spells (no call
for --prepare-idle-after).

Invariants, after every step:

- a pod pending in etcd as (namespace, name, U) is never answered, nor cached, as a ghost for
  (namespace, name, U);
- no replica is reported stale for a UID that etcd holds pending (a replica serving it serves the
  truth), and every replica reported stale served the ghost's UID when it was blamed.

CI runs 200 examples of up to 80 steps; the last test checks that at least 10,000 steps were taken.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings as hsettings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scripted import (Call, Etcd, EtcdKube, FakeClock, Pool, ReplicaModel, ScriptedGets, answer_joined,
    answer_prepared, check, join_flight, pod, settings, settle)

from guard.audit.sqlite import AuditStore
from guard.engine.checker import Checker, Events
from guard.engine.incident import IncidentRecorder
from guard.engine.prepare import Preparer

NAMES = ("web-0", "web-1")
# Rule steps taken by every example, in this process; loop calls parked on a GET in flight, and those
# the loop answered itself when it landed.
STEPS = {"run": 0, "parked": 0, "landed": 0}
FAR = 3600.0  # the machine is about verdicts, not budgets: calls get a deadline far away


class Blame(ReplicaModel):
    """A replica whose probe answers are remembered, to check each blame against what it served."""

    def __init__(self, address: str, etcd: Etcd) -> None:
        super().__init__(address, etcd)
        self.served: set[tuple[str, str]] = set()  # (name, uid) it was seen serving as pending

    def probe(self, namespace, name, uid, *, at):
        obs = super().probe(namespace, name, uid, at=at)
        if obs.serves_ghost:
            self.served.add((name, uid))
        return obs


class VerdictMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.etcd = Etcd()
        self.gets = ScriptedGets(self.etcd)
        self.gets.hold = True
        self.clock = FakeClock()
        self.replicas = [Blame(f"10.0.0.{i}:6443", self.etcd) for i in (1, 2)]
        self.tmp = tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        self.audit = AuditStore(Path(self.tmp.name) / "audit.db")
        self.confirms: list[tuple] = []
        self.checker = Checker(settings(), self.gets, events=self._events, timer=self.clock, background=False)
        self.pv.called()  # starts active; idle_spell makes it idle, the next scheduler call takes over
        self.views = self.pv.views.replicas_changed(self.replicas, [])  # the views (start() also runs the threads)
        self.calls: list[tuple[Call, object]] = []
        self.parked: list[tuple[object, list, object]] = []  # (the joined Call, landed flag, pod): loop calls waiting
        self.answers = 0

    def _events(self, checker: Checker) -> Events:
        """The checker's events, as guard.engine.wiring gives them: the pre-verifier hears its calls, the
        incident recorder its ghosts."""
        self.pv = Preparer(checker.settings, Pool(self.replicas), checker)
        self.recorder = IncidentRecorder(checker.settings, EtcdKube(self.etcd), Pool(self.replicas), self.audit,
                                         retract=checker.retract,
                                         later=lambda delay, fn, *args: self.confirms.append((fn, args)))
        return self.recorder.events(called=self.pv.called)

    # -- etcd ------------------------------------------------------------------------------------

    @rule(name=st.sampled_from(NAMES))
    def create(self, name):
        if name not in self.etcd.pods:
            self.etcd.create(name)

    @rule(name=st.sampled_from(NAMES))
    def delete(self, name):
        self.etcd.delete(name)

    @rule(name=st.sampled_from(NAMES))
    def recreate_same_name(self, name):
        self.etcd.delete(name)
        self.etcd.create(name)

    @rule(name=st.sampled_from(NAMES))
    def recreate_while_read_in_flight(self, name):
        """The StatefulSet race in one step (issue 11): a scheduler call's GET of the name is in flight
        when the controller deletes the pod and creates it again under the same name. A call for the
        new UID may then share or join a read that began before the UID existed."""
        if name not in self.etcd.pods:
            self.etcd.create(name)
        self.gets.hold = True
        self._check_on_thread(pod(name, self.etcd.pods[name].uid))
        self.recreate_same_name(name)

    @rule(name=st.sampled_from(NAMES))
    def bind(self, name):
        self.etcd.bind(name)

    # -- callers ---------------------------------------------------------------------------------

    # Draws never depend on what threads did (held GETs, pending confirmations): hypothesis replays
    # an example by its draws, and two threads woken together may take their turns in either order.
    @precondition(lambda self: self.etcd.history)
    @rule(data=st.data(), dry_run=st.booleans(), cross=st.booleans(), held=st.booleans())
    def scheduler_call(self, data, dry_run, cross, held):
        """A /filter, /preempt or binding review (dry run or not) for a UID the scheduler may hold."""
        p = self._draw_pod(data, cross)
        self.gets.hold = held  # a GET it makes stays in flight until answer_get, or is answered at once
        self._check_on_thread(p, record=not dry_run)
        self.gets.hold = True

    def _draw_pod(self, data, cross):
        """A name etcd has had, and a UID it had, or with ``cross`` a UID of another name (a forged call)."""
        name = data.draw(st.sampled_from(sorted(self.etcd.history)))
        uids = self.etcd.history[name]
        if cross:
            others = [u for n, us in self.etcd.history.items() if n != name for u in us]
            uids = others or uids
        return pod(name, data.draw(st.sampled_from(uids)))

    def _check_on_thread(self, p, *, record=True):
        """Checker.answer for ``p`` on its own thread (a pool thread's call), its answer checked once done."""
        self.calls.append((Call(lambda: check(self.checker, p, deadline=self.clock() + FAR, record=record),
                                f"{p}:{p.uid}"), p))

    def _take_over(self, joined, p):
        """A pool thread takes over the loop's joined call as it is (the worker hands the decoded call on:
        guard.http.filter.DirectLane.answer_taken): Checker.answer with the same Call."""
        joined.deadline = self.clock() + FAR
        self.calls.append((Call(lambda: self.checker.answer(joined), f"{p}:{p.uid}"), p))

    @precondition(lambda self: self.etcd.history)
    @rule(data=st.data(), cross=st.booleans())
    def loop_call(self, data, cross):
        """A /filter or /preempt as the worker's event loop takes it (guard.serving.connection.ConnectionLoop._answer_now): a
        prepared verdict at once; else parked on the pod's GET in flight (answered when it lands,
        see ``land``); else handed to a pool thread, which calls ``Checker.answer``."""
        p = self._draw_pod(data, cross)
        decision = answer_prepared(self.checker, p)
        if decision is not None:
            self._answered(decision, p)
            return
        landed: list = []
        joined = join_flight(self.checker, p, lambda: landed.append(True))
        if joined is None:
            self._check_on_thread(p)
        else:
            STEPS["parked"] += 1
            self.parked.append((joined, landed, p))

    @rule(pick=st.integers(0, 7))
    def budget_nearly_out(self, pick):
        """A parked call's GET has not landed with PARK_MARGIN of its budget left: a pool thread takes it."""
        waiting = [entry for entry in self.parked if not entry[1]]
        if waiting:
            entry = waiting[pick % len(waiting)]
            self.parked.remove(entry)
            self._take_over(entry[0], entry[2])

    def land(self):
        """The loop's side of a landed GET (guard.serving.connection.ConnectionLoop._landed): answer, or hand to a pool thread."""
        for entry in [e for e in self.parked if e[1]]:
            self.parked.remove(entry)
            joined, _, p = entry
            decision = answer_joined(self.checker, joined, self.clock() + FAR)
            if decision is None:
                self._take_over(joined, p)
            else:
                STEPS["landed"] += 1
                self._answered(decision, p)

    def _answered(self, decision, p):
        self.answers += 1
        if decision.is_ghost:
            assert not self.etcd.pending(p.name, p.uid), f"live pod {p} uid {p.uid} answered {decision} by the loop"

    @rule(held=st.booleans())
    def background_verification(self, held):
        self.gets.hold = held
        Call(self.pv.verify_next, "verify")
        self.gets.hold = True

    @rule(pick=st.integers(0, 7), as_of_start=st.booleans())
    def answer_get(self, pick, as_of_start):
        if not self.gets.held:
            return
        held = sorted(self.gets.held, key=lambda g: (g.name, repr(g.snapshot)))
        self.gets.release(held[pick % len(held)], as_of_start=as_of_start)

    # -- replicas --------------------------------------------------------------------------------

    @rule(i=st.sampled_from((0, 1)))
    def deliver_event(self, i):
        event = self.replicas[i].deliver()
        if event is not None:
            self.pv.views.apply_event(self.views[i], event)

    @rule(i=st.sampled_from((0, 1)))
    def list_replica(self, i):
        """The guard lists the replica's cache into its view (every replica it does not watch)."""
        self.pv.views.list_view(self.views[i])

    @rule()
    def sweep(self):
        """The views compared: pods one replica still shows and another does not are verified again."""
        self.pv.sweep()

    @rule(i=st.sampled_from((0, 1)))
    def drop_event(self, i):
        self.replicas[i].drop()

    @rule(i=st.sampled_from((0, 1)))
    def restart_replica(self, i):
        r = self.replicas[i]
        r.events.clear()
        r.cache = {n: p.obj(n, self.etcd.revision) for n, p in self.etcd.pods.items()}

    @rule()
    def stale_confirmation(self):
        if self.confirms:
            fn, args = self.confirms.pop(0)
            fn(*args)

    @rule(seconds=st.sampled_from((0.1, 0.3, 0.6, 1.5)))
    def clock_step(self, seconds):
        self.clock.advance(seconds)

    @rule()
    def idle_spell(self):
        """No scheduler call for --prepare-idle-after: new pods wait in the backlog until a call takes over."""
        self.clock.advance(self.checker.settings.prepare_idle_after)

    # -- the laws --------------------------------------------------------------------------------

    @invariant()
    def no_live_pod_is_answered_as_a_ghost(self):
        STEPS["run"] += 1
        settle()
        self.land()
        settle()
        still = []
        for call, p in self.calls:
            if not call.done:
                still.append((call, p))
                continue
            decision = call.result()
            self.answers += 1
            if decision.is_ghost:
                assert not self.etcd.pending(p.name, p.uid), f"live pod {p} uid {p.uid} answered {decision}"
        self.calls = still

    @invariant()
    def no_live_pod_is_cached_as_a_ghost(self):
        for name, uids in self.etcd.history.items():
            for n in self.etcd.history:
                for uid in uids:
                    if self.checker.cache.ghost(pod(n, uid)) is not None:
                        assert not self.etcd.pending(n, uid), f"live pod {n} uid {uid} cached as a ghost"

    @invariant()
    def no_healthy_replica_is_blamed(self):
        for record in self.audit.records():
            for replica in record.stale_replicas:
                assert not self.etcd.pending(record.name, record.uid), \
                    f"{replica} blamed for {record.name} uid {record.uid}, which etcd has pending"
                model = next(r for r in self.replicas if r.replica.address == replica)
                assert (record.name, record.uid) in model.served

    def teardown(self):
        self.gets.hold = False
        for _ in range(20):
            for get in list(self.gets.held):
                self.gets.release(get)
            settle()
            self.land()
            settle()
            if not self.gets.held:
                break
        self.no_live_pod_is_answered_as_a_ghost()
        assert not self.parked, "a parked call was never woken"
        self.recorder.close()
        self.pv.close()
        self.audit.close()
        self.tmp.cleanup()


VerdictMachine.TestCase.settings = hsettings(max_examples=200, stateful_step_count=80, deadline=None,
                                             derandomize=True, database=None,
                                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_verdict_machine = VerdictMachine.TestCase


def test_the_machine_took_at_least_ten_thousand_steps():
    """Runs after the machine (file order): the issue asks for at least 10,000 steps in CI."""
    if STEPS["run"] == 0:
        pytest.skip("the state machine did not run in this session (deselected)")
    assert STEPS["run"] >= 10_000, STEPS["run"]
    # The loop's path was taken, both ways: answered where the GET landed, and handed over.
    assert STEPS["parked"] >= 100 and 5 <= STEPS["landed"] < STEPS["parked"], STEPS
