"""guard.engine.autoheal.AutoHealer on the lab: one heal at a time, a name queued once, the rate bound, every
outcome in the audit store. Real etcd and replicas; the heals' writes are read from replica 0's request log."""

from __future__ import annotations

import threading
import time

from guard.audit.sqlite import AuditStore
from guard.engine.autoheal import AutoHealer
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.lab.harness import eventually, make_ghost
from guard.engine.replicas import ReplicaPool
from guard.core.settings import Settings
from guard.core.verdict import PodRef

PODS = "/api/v1/namespaces/default/pods"


class StepClock:
    """The healer's clock (``time.monotonic`` in the guard): it stands still until the test advances it, and
    counts its reads (each one is the token bucket deciding)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        with self._lock:
            self.reads += 1
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def test_heals_run_one_at_a_time_at_the_bounded_rate_and_are_audited(lab, tmp_path):
    uids = {name: make_ghost(lab, "default", name, stale=1) for name in ("web-0", "web-1")}
    lab.replicas[1].faults.clear()
    settings = Settings(kubeconfig=lab.kubeconfig(0), heal=True, heal_rate=0.5, heal_burst=1, heal_timeout=10.0,
                        events=False, probe_timeout=2.0)
    kube = Kube(load_configuration(lab.kubeconfig(0)), timeout=2.0, pool_size=4)
    pool = ReplicaPool(settings, kube)
    store = AuditStore(str(tmp_path / "audit.db"))
    for name, uid in uids.items():
        store.record_block(uid=uid, namespace="default", name=name, verdict="ghost-deleted", evidence={}, at=1.0)
    clock = StepClock()
    healer = AutoHealer(settings, kube, pool, store, clock=clock)
    lab.replicas[0].clear_requests()
    try:
        web0, web1 = (PodRef("default", n, uids[n]) for n in ("web-0", "web-1"))
        healing = [healer.submit(web0)]
        assert healing[0] is not None
        assert healer.submit(web0) is None  # already queued or being healed
        healing.append(healer.submit(web1))
        assert healing[1] is not None
        first = healing[0].result(30)
        # The rate bound, on the healer's own clock (stood still): once web-0 is healed, the healer asks its
        # bucket about web-1 (it reads the clock) and gets no token: web-1 waits, however long that takes here.
        seen = clock.reads
        eventually(lambda: clock.reads > seen, 10, what="the healer asking its bucket for web-1's turn")
        assert not healing[1].done()
        assert not [r for r in lab.replicas[0].requests() if r.path.startswith(f"{PODS}/web-1")]
        advanced_at = time.time()
        clock.advance(2.0)  # one heal every 2 s (rate 0.5, burst 1): web-1's turn
        second = healing[1].result(30)
        results = [(pod.name, heal.action.value, heal.outcome.value) for pod, heal in ((web0, first), (web1, second))]
    finally:
        healer.close()
        pool.close()
        kube.close()
    assert results == [("web-0", "placeholder", "healed"), ("web-1", "placeholder", "healed")]
    writes = [(r.method, r.path) for r in lab.replicas[0].requests() if r.method in ("POST", "DELETE")
              and r.path.startswith(PODS)]
    assert writes == [("POST", PODS), ("DELETE", f"{PODS}/web-0"),
                      ("POST", PODS), ("DELETE", f"{PODS}/web-1")]  # never interleaved
    (web1_read,) = [r.time for r in lab.replicas[0].requests(method="GET", quorum=True)
                    if r.path == f"{PODS}/web-1"]
    assert web1_read >= advanced_at  # web-1's heal began only once its token was due
    for name, uid in uids.items():
        assert [(h.action, h.outcome) for h in store.record(uid).heals] == [("placeholder", "healed")]
    store.close()
