"""The lab scheduler's queue (guard/lab/scheduler/queue.py) under a fake clock: backoff, the pool, the flushes.

Mirrors pkg/scheduler/backend/queue/scheduling_queue.go: errors wait out their backoff
(initial, doubled per attempt, capped); an unschedulable pod waits in the pool until a
cluster event or the leftover flush; an event during a pod's own cycle sends it to
backoffQ instead of the pool. No thread sleeps: time is the fake clock's.
"""

from __future__ import annotations

import threading

import pytest

from guard.lab.harness import pod_manifest
from guard.lab.scheduler import Scheduler, Timings
from guard.lab.scheduler.queue import SchedulingQueue

TIMINGS = Timings(pod_initial_backoff=1.0, pod_max_backoff=4.0, backoff_flush_period=1.0,
                  pod_max_in_unschedulable=300.0, unschedulable_flush_period=30.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def queue(clock):
    """A queue whose condition the test holds throughout (as the scheduler does around ``*_locked`` calls)."""
    cond = threading.Condition(threading.RLock())
    with cond:
        yield SchedulingQueue(TIMINGS, cond, threading.Event(), clock=clock)


def no_priority(_key: str) -> int:
    return 0


def cycle(queue: SchedulingQueue, clock: Clock):
    """Flush as the scheduling loop does now, then take the next active pod (None if none is active)."""
    queue.flush_locked(clock.now)
    return queue.take_locked(no_priority)


@pytest.mark.parametrize("attempts,backoff", [(1, 1.0), (2, 2.0), (3, 4.0), (4, 4.0), (9, 4.0)],
                         ids=["first", "doubled", "doubled-again", "capped", "still-capped"])
def test_backoff_doubles_from_initial_to_max(attempts, backoff):
    assert TIMINGS.backoff(attempts) == backoff


def test_an_error_waits_out_its_backoff_in_backoffq(queue, clock):
    queue.add_locked("ns/a", "uid-a")
    assert queue.where_locked() == {"ns/a": "active"}
    first = cycle(queue, clock)
    assert (first.key, first.attempts, queue.where_locked()) == ("ns/a", 1, {"ns/a": "inflight"})
    queue.add_unschedulable_if_not_present(first, unschedulable=False)  # a scheduling error
    assert queue.where_locked() == {"ns/a": "backoff"}
    clock.now += 0.99
    assert cycle(queue, clock) is None  # the flush ticker ran at +0; the next one is due at +1
    clock.now += 0.01  # 1 s after the failure: the first backoff is over, and the ticker is due
    again = cycle(queue, clock)
    assert again is first and again.attempts == 2
    queue.add_unschedulable_if_not_present(again, unschedulable=False)
    clock.now += 1.5
    assert cycle(queue, clock) is None and queue.where_locked() == {"ns/a": "backoff"}  # 2 s this time
    clock.now += 0.5  # backoff over, but backoffQ is only flushed on the ticker (next run 1 s after the last)
    assert cycle(queue, clock) is None
    clock.now += 0.5
    assert cycle(queue, clock) is again


def test_an_unschedulable_pod_waits_in_the_pool_for_a_cluster_event(queue, clock):
    queue.add_locked("ns/a", "uid-a")
    queued = cycle(queue, clock)
    queue.add_unschedulable_if_not_present(queued, unschedulable=True)
    assert queue.where_locked() == {"ns/a": "unschedulable"}
    clock.now += 120
    assert cycle(queue, clock) is None  # no event, no flush before pod_max_in_unschedulable
    queue.move_all_locked()  # a node or pod event
    assert queue.where_locked() == {"ns/a": "active"}  # its 1 s backoff is long over
    assert cycle(queue, clock) is queued


def test_a_cluster_event_right_after_the_failure_moves_it_to_backoffq(queue, clock):
    queue.add_locked("ns/a", "uid-a")
    queued = cycle(queue, clock)
    queue.add_unschedulable_if_not_present(queued, unschedulable=True)
    clock.now += 0.2
    queue.move_all_locked()
    assert queue.where_locked() == {"ns/a": "backoff"}  # backoff not over: backoffQ, not activeQ


def test_an_event_during_the_pods_own_cycle_sends_it_to_backoffq_not_the_pool(queue, clock):
    queue.add_locked("ns/a", "uid-a")
    queued = cycle(queue, clock)
    queue.move_all_locked()  # while the cycle runs (moveRequestCycle >= the pod's cycle)
    queue.add_unschedulable_if_not_present(queued, unschedulable=True)
    assert queue.where_locked() == {"ns/a": "backoff"}


def test_pool_leftovers_are_flushed_after_pod_max_in_unschedulable(queue, clock):
    queue.add_locked("ns/a", "uid-a")
    queued = cycle(queue, clock)
    queue.add_unschedulable_if_not_present(queued, unschedulable=True)
    clock.now += 290
    assert cycle(queue, clock) is None  # 290 s in the pool: the ticker ran, nothing to flush; next run at +320
    clock.now += 29
    assert cycle(queue, clock) is None and queue.where_locked() == {"ns/a": "unschedulable"}  # ticker not due
    clock.now += 1  # the ticker runs: 320 s in the pool, past pod_max_in_unschedulable
    assert cycle(queue, clock) is queued


def test_activeq_takes_the_highest_priority_then_the_oldest(queue, clock):
    for key in ("ns/low", "ns/high-old", "ns/high-new"):
        queue.add_locked(key, key)
        clock.now += 1
    priorities = {"ns/low": 0, "ns/high-old": 100, "ns/high-new": 100}
    taken = [queue.take_locked(priorities.__getitem__).key for _ in range(3)]
    assert taken == ["ns/high-old", "ns/high-new", "ns/low"]
    assert queue.take_locked(priorities.__getitem__) is None


def test_a_pod_in_flight_is_only_dropped_by_its_cycle(queue, clock):
    queue.add_locked("ns/a", "uid-a")
    queued = cycle(queue, clock)
    queue.discard_locked("ns/a")  # deleted or bound while its cycle runs
    assert queue.where_locked() == {"ns/a": "inflight"}
    queue.done(queued)
    assert queue.where_locked() == {}
    queue.add_unschedulable_if_not_present(queued, unschedulable=False)  # a late failure of a forgotten pod
    assert queue.where_locked() == {}


def _pod(uid: str, node: str = "") -> dict:
    pod = pod_manifest("a", namespace="ns", node_name=node)
    pod["metadata"].update(uid=uid, resourceVersion="1")
    return pod


def test_a_pod_recreated_while_the_old_ones_bind_is_in_flight_gets_its_own_entry():
    """The race of tests/e2e/test_recreate.py (a CI failure: the new pod never filtered). The informer shows
    the old pod bound before the bind's answer reaches its cycle; the pod is deleted and recreated under
    the same name at once. The real queue moved the popped pod to inFlightPods by UID (scheduling_queue.go
    Pop, Done), so the new pod goes to activeQ, and the old cycle's end does not drop it. Events are fed
    as the informer delivers them; no thread runs."""
    sched = Scheduler("unused-kubeconfig")
    sched._pod_event("ADDED", _pod("uid-old"))
    cycle_of_old = sched._queue.pop(no_priority)
    assert (cycle_of_old.uid, sched.queue()) == ("uid-old", {"ns/a": "inflight"})
    sched._pod_event("MODIFIED", _pod("uid-old", node="node-a"))  # the bind, seen through the watch
    sched._pod_event("DELETED", _pod("uid-old", node="node-a"))
    sched._pod_event("ADDED", _pod("uid-new"))
    sched._queue.done(cycle_of_old)  # the bind's answer: the old cycle ends
    assert sched.queue() == {"ns/a": "active"}
    assert sched._queue.pop(no_priority).uid == "uid-new"
    assert cycle_of_old.uid == "uid-old"  # the old cycle's entry still names the pod it binds
