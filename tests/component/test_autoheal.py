"""guard.engine.autoheal.AutoHealer on the lab: one heal at a time, a name queued once, the rate bound, every
outcome in the audit store. Real etcd and replicas; the heals' writes are read from replica 0's request log."""

from __future__ import annotations


from guard.audit.sqlite import AuditStore
from guard.engine.autoheal import AutoHealer
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.lab.harness import make_ghost
from guard.engine.replicas import ReplicaPool
from guard.core.settings import Settings
from guard.core.verdict import PodRef

PODS = "/api/v1/namespaces/default/pods"


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
    healer = AutoHealer(settings, kube, pool, store)
    lab.replicas[0].clear_requests()
    try:
        web0, web1 = (PodRef("default", n, uids[n]) for n in ("web-0", "web-1"))
        healing = [healer.submit(web0)]
        assert healing[0] is not None
        assert healer.submit(web0) is None  # already queued or being healed
        healing.append(healer.submit(web1))
        assert healing[1] is not None
        results = [(pod.name, heal.action.value, heal.outcome.value)
                   for pod, heal in zip((web0, web1), (f.result(30) for f in healing))]
    finally:
        healer.close()
        pool.close()
        kube.close()
    assert results == [("web-0", "placeholder", "healed"), ("web-1", "placeholder", "healed")]
    writes = [(r.method, r.path, r.time) for r in lab.replicas[0].requests() if r.method in ("POST", "DELETE")
              and r.path.startswith(PODS)]
    assert [(m, p) for m, p, _ in writes] == [("POST", PODS), ("DELETE", f"{PODS}/web-0"),
                                              ("POST", PODS), ("DELETE", f"{PODS}/web-1")]  # never interleaved
    # one heal every 2 s with a burst of one: heals begin 2 s apart; each one's quorum GET follows its cache
    # reads, which took the first heal longer (new connections to every replica): 0.5 s of slack for that
    starts = [r.time for r in lab.replicas[0].requests(method="GET", quorum=True) if r.path.startswith(f"{PODS}/web-")]
    assert len(starts) == 2 and starts[1] - starts[0] >= 1.5
    for name, uid in uids.items():
        assert [(h.action, h.outcome) for h in store.record(uid).heals] == [("placeholder", "healed")]
    store.close()
