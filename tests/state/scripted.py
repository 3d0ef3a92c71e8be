"""A scripted control plane for in-process tests of the verdict state (cache, check, prepare, incident).

No sockets, no sleeps that decide anything: a fake clock, an etcd model that is the truth, quorum
GETs that the test answers when it chooses (a read *in flight*), watch events that the test
delivers, late or never, per replica, and replica caches that the test lets go stale.

Threads are used only where the guard itself blocks (a call waiting for a GET in flight); the
test waits until every such thread has finished or is parked in a wait (:func:`settle`), so the
order of events is the test's, never the scheduler's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from guard.core.attribution import ReplicaObservation
from guard.core.settings import Replica, Settings
from guard.core.verdict import Decision, PodRef, QuorumRead, shows_pending
from guard.engine.checker import Call as CheckCall
from guard.engine.checker import Checker, Pending

NS = "default"


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class EtcdPod:
    uid: str
    node: str = ""
    deleting: bool = False

    def obj(self, name: str, rv: int) -> dict:
        meta: dict = {"name": name, "namespace": NS, "uid": self.uid, "resourceVersion": str(rv)}
        if self.deleting:
            meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
        return {"metadata": meta, "spec": {"nodeName": self.node} if self.node else {}}


class Etcd:
    """The truth: one pod (or none) per name; every write is an event for the replicas' watches."""

    def __init__(self) -> None:
        self.pods: dict[str, EtcdPod] = {}
        self.revision = 1
        self._uids = 0
        self.watchers: list[deque] = []
        self.history: dict[str, list[str]] = {}  # name -> every UID it ever had

    def _emit(self, kind: str, name: str, pod: EtcdPod) -> None:
        self.revision += 1
        for q in self.watchers:
            q.append({"type": kind, "object": pod.obj(name, self.revision)})

    def create(self, name: str) -> str:
        assert name not in self.pods
        self._uids += 1
        uid = f"uid-{self._uids:04d}"
        self.pods[name] = EtcdPod(uid)
        self.history.setdefault(name, []).append(uid)
        self._emit("ADDED", name, self.pods[name])
        return uid

    def delete(self, name: str) -> str | None:
        pod = self.pods.pop(name, None)
        if pod is not None:
            self._emit("DELETED", name, pod)
        return pod.uid if pod else None

    def bind(self, name: str, node: str = "node-1") -> None:
        pod = self.pods.get(name)
        if pod is not None and not pod.node:
            pod.node = node
            self._emit("MODIFIED", name, pod)

    def terminate(self, name: str) -> None:
        pod = self.pods.get(name)
        if pod is not None and not pod.deleting:
            pod.deleting = True
            self._emit("MODIFIED", name, pod)

    def read(self, name: str) -> QuorumRead:
        pod = self.pods.get(name)
        if pod is None:
            return QuorumRead.not_found()
        return QuorumRead.found(pod.uid, node_name=pod.node,
                                deletion_timestamp="2026-12-01T00:00:00Z" if pod.deleting else "",
                                resource_version=str(self.revision))

    def pending(self, name: str, uid: str) -> bool:
        pod = self.pods.get(name)
        return pod is not None and pod.uid == uid and not pod.node and not pod.deleting


@dataclass
class HeldGet:
    name: str
    snapshot: QuorumRead  # etcd's answer when the GET began
    answer: QuorumRead | None = None
    released: threading.Event = field(default_factory=lambda: TrackingEvent())


class ScriptedGets:
    """The checker's quorum GET. ``hold=False``: etcd answers at once. ``hold=True``: each GET waits
    until the test releases it, answering as etcd was when it began or as etcd is at release."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self.hold = False
        self.count = 0
        self.held: list[HeldGet] = []
        self._lock = threading.Lock()

    def __call__(self, namespace: str, name: str, timeout: float) -> QuorumRead:
        with self._lock:
            self.count += 1
            if not self.hold:
                return self.etcd.read(name)
            get = HeldGet(name, self.etcd.read(name))
            self.held.append(get)
        if not get.released.wait(30):
            raise AssertionError(f"held GET of {name} never released")
        assert get.answer is not None
        return get.answer

    def release(self, get: HeldGet, *, as_of_start: bool = True) -> None:
        with self._lock:
            self.held.remove(get)
        get.answer = get.snapshot if as_of_start else self.etcd.read(get.name)
        get.released.set()
        settle()


class TrackingEvent(threading.Event):
    """A ``threading.Event`` that says who waits on it: a thread waiting on an Event that is not set
    is parked; one whose Event was just set is on its way. Installed as ``threading.Event`` for the
    test's duration (:func:`tracked_events`), so the guard's own waits (a read in flight) are seen
    too, without looking into any thread's frames."""

    waiting: dict[int, "TrackingEvent"] = {}
    _guard = threading.Lock()

    def wait(self, timeout: float | None = None) -> bool:
        me = threading.get_ident()
        with TrackingEvent._guard:
            TrackingEvent.waiting[me] = self
        try:
            return super().wait(timeout)
        finally:
            with TrackingEvent._guard:
                TrackingEvent.waiting.pop(me, None)


@contextlib.contextmanager
def tracked_events():
    original = threading.Event
    threading.Event = TrackingEvent  # type: ignore[misc]
    try:
        yield
    finally:
        threading.Event = original  # type: ignore[misc]


def _parked(thread: threading.Thread) -> bool:
    with TrackingEvent._guard:
        event = TrackingEvent.waiting.get(thread.ident or -1)
    return event is not None and not event.is_set()


_calls: list["Call"] = []


def settle(timeout: float = 10.0) -> None:
    """Wait until every outstanding call has finished or is parked waiting for a held GET."""
    end = time.monotonic() + timeout
    while True:
        live = [c for c in _calls if c.thread.is_alive()]
        if all(_parked(c.thread) for c in live):
            _calls[:] = live
            return
        if time.monotonic() > end:
            raise AssertionError("calls did not settle: " + ", ".join(c.label for c in live))
        time.sleep(0.0002)


class Call:
    """``fn()`` on its own thread (a /filter, a background verification); ``result()`` once done."""

    def __init__(self, fn, label: str = "") -> None:
        self.label = label
        self.value: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name=f"call-{label}")
        _calls.append(self)
        self.thread.start()
        settle()

    def _run(self, fn) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # surfaced by result()
            self.error = e

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self):
        self.thread.join(10)
        assert self.done, f"{self.label} still running"
        if self.error is not None:
            raise self.error
        return self.value


def settings(**overrides) -> Settings:
    base = dict(insecure_http=True, bind="127.0.0.1:1", events=False, alive_ttl=0.5, prepared_grace=0.5,
                ghost_ttl=3600.0, stale_confirm_delay=2.0)
    base.update(overrides)
    return Settings(**base).validate()


class ReplicaModel:
    """One apiserver replica's watch cache: applies the events it is given, misses those dropped."""

    def __init__(self, address: str, etcd: Etcd) -> None:
        self.replica = Replica(address, f"https://{address}")
        self.events: deque = deque()
        etcd.watchers.append(self.events)
        self.cache: dict[str, dict] = {}  # name -> object as this replica serves it
        self.unanswered = 0  # the next this many cache probes get no answer (a timeout)

    def deliver(self) -> dict | None:
        if not self.events:
            return None
        event = self.events.popleft()
        name = event["object"]["metadata"]["name"]
        if event["type"] == "DELETED":
            self.cache.pop(name, None)
        else:
            self.cache[name] = event["object"]
        return event

    def drop(self) -> dict | None:
        return self.events.popleft() if self.events else None

    def serves_pending(self, name: str, uid: str) -> bool:
        obj = self.cache.get(name)
        return obj is not None and shows_pending([obj], uid)

    def pending_pods(self, *, resource_version: str = "0") -> tuple[str, list[dict]]:
        """A listing of this cache's unscheduled pods (the ReplicaClient surface the views use)."""
        items = [o for o in self.cache.values() if shows_pending([o], o["metadata"]["uid"])]
        return str(max((int(o["metadata"]["resourceVersion"]) for o in self.cache.values()), default=1)), items

    # the ReplicaClient surface the missing-pod check uses (guard.engine.cache_health.confirm_pod)
    def consistent_revision(self, namespace: str, name: str, *, timeout: float = 5.0) -> tuple[int | None, str | None]:
        return None, None  # the test delivers events itself: no catching up here

    def read_cache(self, namespace: str, name: str) -> tuple[list[dict], str | None, str | None]:
        items = [o for o in self.cache.values() if o["metadata"]["name"] == name]
        return items, str(max((int(o["metadata"]["resourceVersion"]) for o in self.cache.values()), default=1)), None

    # the ReplicaClient surface the incident recorder uses
    def probe(self, namespace: str, name: str, uid: str, *, at: float) -> ReplicaObservation:
        if self.unanswered > 0:
            self.unanswered -= 1
            return ReplicaObservation(self.replica.address, None, None, "timeout: after 0.5s", at)
        obj = self.cache.get(name)
        return ReplicaObservation(self.replica.address, shows_pending([obj] if obj else [], uid),
                                  str(len(self.cache)), None, at)


class Pool:
    """The ReplicaPool surface: a fixed set of replicas."""

    def __init__(self, replicas: list[ReplicaModel]) -> None:
        self.replicas = replicas

    def clients(self) -> list[ReplicaModel]:
        return list(self.replicas)

    def on_change(self, callback) -> None:
        pass


class EtcdKube:
    """The Kube surface the incident recorder uses: quorum GETs answered by etcd at once."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd

    def quorum_get(self, namespace: str, name: str, timeout: float | None = None) -> QuorumRead:
        return self.etcd.read(name)


def pod(name: str, uid: str) -> PodRef:
    return PodRef(NS, name, uid)


def is_ghost(decision: Decision) -> bool:
    return decision.is_ghost


# --- the checker's one entry (Checker.answer), as its callers use it --------------------------------


def check(checker: Checker, pod: PodRef, *, deadline: float | None = None, record: bool = True) -> Decision:
    """A call from a thread (a pool thread's /filter or /preempt, /validate/binding): always a verdict."""
    return checker.answer(CheckCall(pod, checker.deadline() if deadline is None else deadline, record))


def answer_prepared(checker: Checker, pod: PodRef) -> Decision | None:
    """The event loop's call with nothing to join: the verdict when it needs no waiting, else None."""
    decision = checker.answer(checker.call(pod), now=True)
    return None if isinstance(decision, Pending) else decision


def join_flight(checker: Checker, pod: PodRef, wake: Callable[[], None]) -> CheckCall | None:
    """The event loop's call for a pod whose quorum GET is in flight: the Call that joined it, else None."""
    call = checker.call(pod)
    return call if checker.answer(call, now=True, wake=wake) is Pending.JOINED else None


def answer_joined(checker: Checker, call: CheckCall, deadline: float) -> Decision | None:
    """The event loop's joined call asked again once woken: the verdict, or None (a pool thread answers)."""
    call.deadline = deadline
    decision = checker.answer(call, now=True)
    return None if isinstance(decision, Pending) else decision
