"""The etcd fault proxy on REAL Kubernetes: a kube-apiserver replica behind it goes stale as in the incident.

The shared ``real_lab`` (real etcd, two real kube-apiserver replicas, each through its own ``EtcdProxy``):
replica 0 (A) runs without faults; replica 1 (B)'s proxy gets them. With ``drop_deletes`` on one pod, B's
watch cache keeps serving the pod after its deletion (``LIST resourceVersion=0``) while A's does not, B's
quorum GET says 404, and B's cache resourceVersion keeps advancing; with ``freeze_watch`` B's cache stops,
and resumes on unfreeze. Each test works in its own namespace (``real_namespace``, which clears the faults
after it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("grpc", reason="real tier: the etcd proxy needs grpcio (the lab extra)")

from guard.lab.harness import create as create_pod  # noqa: E402
from guard.lab.harness import eventually, pod_manifest  # noqa: E402

A, B = 0, 1


class Replica:
    """One replica of the shared lab, read the way the test asserts about it (raw HTTP, the lab's token)."""

    def __init__(self, lab, index: int, namespace: str) -> None:
        self.lab, self.index, self.ns = lab, index, namespace

    def cached_pods(self) -> tuple[int, set[str]]:
        """(list resourceVersion, pod names) of ``LIST resourceVersion=0``: this replica's watch cache."""
        import json

        status, body = self.lab.raw_get(self.index, f"/api/v1/namespaces/{self.ns}/pods?resourceVersion=0",
                                        timeout=30)
        assert status == 200, body
        doc = json.loads(body)
        return int(doc["metadata"]["resourceVersion"]), {p["metadata"]["name"] for p in doc["items"]}

    def get_status(self, name: str) -> int:
        """The status of a quorum GET of the pod through this replica."""
        return self.lab.raw_get(self.index, f"/api/v1/namespaces/{self.ns}/pods/{name}", timeout=30)[0]


@pytest.fixture
def cluster(real_lab, real_namespace):
    """(A, B, B's proxy faults, namespace)."""
    if real_lab.replicas[B].proxy is None:
        pytest.skip("real tier: no etcd fault proxy (guard.lab.real.etcdproxy)")
    faults = real_lab.replicas[B].faults
    faults.clear()
    return Replica(real_lab, A, real_namespace), Replica(real_lab, B, real_namespace), faults, real_namespace


def create(replica: Replica, name: str) -> int:
    pod = create_pod(replica.lab.core_v1(replica.index), pod_manifest(name, namespace=replica.ns))
    return int(pod["metadata"]["resourceVersion"])


def test_a_lost_delete_leaves_a_ghost_in_the_proxied_replica(cluster):
    a, b, faults, ns = cluster
    rv = create(a, "ghost")
    eventually(lambda: all(s.cached_pods()[0] >= rv and "ghost" in s.cached_pods()[1] for s in (a, b)), 30,
               what="both caches hold the new pod")
    faults.drop_deletes(ns, "ghost")

    a.lab.core_v1(A).delete_namespaced_pod("ghost", ns, _request_timeout=30)
    dropped = eventually(lambda: [e for e in faults.dropped if e.type == "DELETED" and e.namespace == ns], 30,
                         what="the proxy dropped the DELETE")
    delete_rv = dropped[0].resource_version
    assert (dropped[0].namespace, dropped[0].name) == (ns, "ghost")

    eventually(lambda: "ghost" not in a.cached_pods()[1], 30, what="replica A's cache lost the pod")
    # B's cache went past the deletion (progress notifications carry the revision on) yet holds the pod
    b_rv = eventually(lambda: (lambda c: c[0] if c[0] >= delete_rv else 0)(b.cached_pods()), 30,
                      what="replica B's cache at or past the delete revision")
    assert "ghost" in b.cached_pods()[1]
    assert b_rv >= delete_rv
    # a quorum read through B goes to etcd: no such pod
    assert b.get_status("ghost") == 404
    assert a.get_status("ghost") == 404

    # other writes still reach B's cache and move its resourceVersion on; the ghost stays
    later = create(a, "after-ghost")
    eventually(lambda: {"after-ghost", "ghost"} <= b.cached_pods()[1] and b.cached_pods()[0] >= later, 30,
               what="replica B's cache took a later write")
    assert b.cached_pods()[0] > b_rv
    assert "ghost" not in a.cached_pods()[1]
    kinds = sorted(e.type for e in faults.dropped if (e.namespace, e.name) == (ns, "ghost"))
    assert "DELETED" in kinds, kinds


def test_a_frozen_watch_stops_the_proxied_cache_until_unfrozen(cluster):
    a, b, faults, ns = cluster
    first = create(a, "before-freeze")
    eventually(lambda: b.cached_pods()[0] >= first, 30, what="replica B's cache caught up")
    faults.freeze_watch()
    # a write that B's cache may still see (it was on its way), then one it must not
    create(a, "frozen-0")
    frozen_rv = b.cached_pods()[0]
    rv = create(a, "frozen-1")
    eventually(lambda: a.cached_pods()[0] >= rv and "frozen-1" in a.cached_pods()[1], 30,
               what="replica A's cache took the write")
    rv_b, names_b = b.cached_pods()
    assert "frozen-1" not in names_b and rv_b < rv
    # B's quorum read still works: only its watch is frozen
    assert b.get_status("frozen-1") == 200
    assert b.cached_pods()[0] <= max(frozen_rv, rv_b)

    faults.unfreeze_watch()
    eventually(lambda: "frozen-1" in b.cached_pods()[1] and b.cached_pods()[0] >= rv, 30,
               what="replica B's cache resumed after unfreeze")
