"""Ghost Nodes in the audit store (issue 27), on the Python lab: a replica's watch loses a Node's DELETE;
the running guard records the ghost Node once per identity (name and the UID the stale cache serves),
with the replica serving it, in both stores: the SQLite file and a GhostNode object (cluster-scoped,
kube-ghost-guard.io/v1alpha1) through the lab's apiserver; `audit --nodes` and `report` show it, and
once `heal node/NAME` heals the replica, the record says so (healed_at) and names no stale replica.

Real etcd, three real HTTPS apiserver replicas, two real `ghost-guard serve` (one per store).
"""

from __future__ import annotations

import json

import pytest
from clirun import ghost_guard

from guard.lab.harness import NotReached, eventually, node_manifest

pytestmark = pytest.mark.timeout(180)

FAST = ["--discovery-interval", "5", "--no-prepare", "--no-events"]


def node_records(*store: str) -> list[dict]:
    r = ghost_guard("audit", "--nodes", *store, "-o", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_lost_node_delete_is_recorded_in_both_stores_once_with_its_stale_replica(lab, start_guard, tmp_path):
    api = lab.core_v1(0)
    for name in ("real-node", "ghost-node"):
        api.create_node(node_manifest(name), _request_timeout=5)
    ghost_uid = api.read_node("ghost-node", _request_timeout=5).metadata.uid
    db = str(tmp_path / "audit.db")
    sqlite = ["--db", db]
    kube = ["--audit-store", "kubernetes", "--kubeconfig", lab.kubeconfig(2)]
    # both guards start at once (each start is seconds of a loaded machine's time, mostly waiting)
    g1 = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", db, *FAST], wait=None)
    g2 = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-store", "kubernetes", "--audit-write-interval", "0.2",
                      *FAST], wait=None)
    replicas = [f"{r.ip}:{r.port}" for r in lab.replicas]
    for g in (g1, g2):
        g.wait("/readyz", timeout=60)  # as start_guard waits
        eventually(lambda: all(g.metric("ghost_guard_node_watch_up", replica=r) == 1 for r in replicas),
                   what="every replica's Nodes watched", process=g)
    assert node_records(*sqlite) == [] and node_records(*kube) == []

    lab.replicas[1].faults.drop_deletes(name="ghost-node", resource="nodes", count=1)
    api.delete_node("ghost-node", _request_timeout=5)
    stale = replicas[1]
    for g in (g1, g2):
        try:
            eventually(lambda: g.metric("ghost_guard_ghost_nodes", replica=stale) == 1, 60,
                       what="the ghost Node attributed", process=g)
        except NotReached as e:  # seen once in a loaded run (the other guard named it): how far its check got
            detail = (g.get("/readyz", timeout=10).json().get("details") or {}).get("ghost_nodes")
            raise AssertionError(f"{e}; /readyz ghost_nodes: {detail}") from None

    def recorded(store: list[str]) -> dict | None:
        found = node_records(*store)
        return found[0] if found and found[0]["stale_replicas"] else None

    for store in (sqlite, kube):
        rec = eventually(lambda: recorded(store), 15, what=f"the ghost Node record ({store[0]})", interval=0.2)
        assert (rec["node"], rec["uid"], rec["times_detected"], rec["stale_replicas"]) == (
            "ghost-node", ghost_uid, 1, [stale])
        assert [r["replica"] for r in rec["replicas"]] == [stale] and rec["replicas"][0]["healed_at"] is None
        assert rec["evidence"]["quorum_get"] == {"outcome": "not-found"}
    from kubernetes import client

    (obj,) = client.CustomObjectsApi(lab.api_client(2)).list_cluster_custom_object("kube-ghost-guard.io", "v1alpha1", "ghostnodes",
                                                              _request_timeout=5)["items"]
    assert "namespace" not in obj["metadata"]  # cluster-scoped
    assert (obj["spec"]["nodeName"], obj["spec"]["nodeUID"]) == ("ghost-node", ghost_uid)
    assert obj["status"]["staleReplicas"] == stale and obj["status"]["timesDetected"] == 1

    # `audit` (table) points at the Node records; `report` names the replica and the heal, and exits 1.
    r = ghost_guard("audit", *sqlite)
    assert r.returncode == 0 and "1 ghost Node record: ghost-guard audit --nodes" in r.stdout, r.stdout
    r = ghost_guard("report", *sqlite)
    assert r.returncode == 1 and stale in r.stdout and "ghost-guard heal node/ghost-node" in r.stdout, r.stdout
    r = ghost_guard("report", *kube, "-o", "json")
    assert r.returncode == 1, r.stderr
    assert [x["node"] for x in json.loads(r.stdout)["ghost_node_records"]] == ["ghost-node"]

    # Healed without a restart, the attempt recorded in each store (--audit-store); each guard sees the replica
    # no longer serving it; the record says when.
    r = ghost_guard("heal", "node/ghost-node", "--kubeconfig", lab.kubeconfig(0), "-o", "json",
                    "--audit-store", f"sqlite:{db}")
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    r = ghost_guard("heal", "node/ghost-node", "--kubeconfig", lab.kubeconfig(2), "--audit-store", "kubernetes")
    assert r.returncode == 0 and "consistent" in r.stdout, r.stdout + r.stderr  # nothing left to heal: not recorded
    (rec,) = node_records(*sqlite)
    assert [(h["action"], h["outcome"]) for h in rec["heals"]] == [("placeholder", "healed")]
    r = ghost_guard("heal", "node/real-node", "--kubeconfig", lab.kubeconfig(2), "--audit-store", "kubernetes")
    assert r.returncode == 0 and "no record of ghost Node real-node" in r.stderr, r.stdout + r.stderr

    def healed(store: list[str]) -> dict | None:
        (rec,) = node_records(*store)
        return rec if rec["replicas"][0]["healed_at"] else None

    for store in (sqlite, kube):
        rec = eventually(lambda: healed(store), 15, what=f"the record healed ({store[0]})", interval=0.2)
        assert rec["stale_replicas"] == [] and rec["times_detected"] == 1  # once per identity
    r = ghost_guard("report", *sqlite)
    assert r.returncode == 0 and "heal node/ghost-node" not in r.stdout, r.stdout
