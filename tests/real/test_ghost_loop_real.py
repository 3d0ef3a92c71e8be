"""The incident on real Kubernetes: a real kube-scheduler whose informer reads the stale replica loops on a
ghost (every Binding POST answers 404, counted by that apiserver's ``apiserver_request_total``), and the
guard, registered through the product's own KubeSchedulerConfiguration (HTTPS, mTLS, ``serverName`` as
shipped), stops the loop: at most one binding 404 for the ghost while live pods still schedule.

One control plane for the module (two real replicas, each behind its etcd fault proxy); each test
restarts kube-scheduler as it needs it.
"""

from __future__ import annotations

import pytest

from guard import certs as guard_certs
from guard.lab.harness import create, eventually, make_ghost, node_manifest, pod_manifest, tls_files

STALE = 1  # the scheduler reads replica 2 (127.0.0.2), whose cache lost the delete


@pytest.fixture(scope="module")
def ghost_lab(real_lab_module_factory):
    lab = real_lab_module_factory(2)
    if lab.replicas[STALE].proxy is None:
        pytest.skip("real tier: no etcd fault proxy (guard.lab.real.etcdproxy)")
    for name in ("node-a", "node-b"):
        create(lab.core_v1(0), node_manifest(name))
    lab.ensure_namespace("ghosts")
    uid = make_ghost(lab, "ghosts", "web-1", stale=STALE, timeout=60)
    lab.replicas[STALE].faults.clear()  # one lost delete; the watch flows on
    return lab, uid


def _bound(lab, namespace, name):
    return lab.core_v1(0).read_namespaced_pod(name, namespace, _request_timeout=10).spec.node_name


def test_without_the_guard_the_real_scheduler_loops_on_the_ghost(ghost_lab):
    lab, uid = ghost_lab
    before = lab.binding_404s(STALE)
    lab.start_scheduler(None, replica=STALE)
    try:
        create(lab.core_v1(0), pod_manifest("live-before", namespace="ghosts"))
        # kube-scheduler binds the ghost, gets 404, and (its informer still holding it) retries after backoff
        eventually(lambda: _bound(lab, "ghosts", "live-before"), 120, what="the live pod bound by kube-scheduler")
        eventually(lambda: lab.binding_404s(STALE) - before >= 3, 120, what="three binding 404s for the ghost (the loop)")
    finally:
        lab.stop_scheduler()
    assert lab.cached_pod(STALE, "ghosts", "web-1")["metadata"]["uid"] == uid  # still a ghost


def test_the_guard_stops_the_real_scheduler_loop(ghost_lab, start_guard, tmp_path):
    lab, uid = ghost_lab
    bundle = guard_certs.generate(tmp_path / "certs", ips=["127.0.0.1"])
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--apiserver-replicas", ",".join(lab.urls),
                     "--audit-db", str(tmp_path / "audit.db"), "--no-access-log"],
                    tls=tls_files(bundle), clean_env=True, wait=None)
    g.wait("/readyz", timeout=120)
    before = lab.binding_404s(STALE)
    lab.start_scheduler(g.extender(), replica=STALE)
    try:
        create(lab.core_v1(0), pod_manifest("live-after", namespace="ghosts"))
        eventually(lambda: _bound(lab, "ghosts", "live-after"), 120, what="the live pod bound through the guard")
        # Rejected on every node by the extender, the ghost waits among the unschedulable pods until a
        # cluster event: each new Node makes kube-scheduler try it again, and the guard answer again.
        def verdicts():
            return g.metric("ghost_guard_verdicts_total", verdict="ghost-deleted")

        eventually(lambda: verdicts() >= 1, 120, what="the ghost blocked by the guard", process=g)
        for k in range(2):
            seen = verdicts()
            create(lab.core_v1(0), node_manifest(f"node-extra-{k}"))
            eventually(lambda: verdicts() > seen, 120, what=f"the ghost tried again after node-extra-{k}", process=g)
        assert lab.binding_404s(STALE) - before <= 1
    finally:
        lab.stop_scheduler()
    assert g.metric("ghost_guard_ghosts_blocked_total") == 1
