"""What the guard says about a frozen replica while `heal` holds its placeholder (issue 26, finding 1).

`heal` keeps a placeholder pod under a deleted ghost's name for a while when a replica's watch is
frozen. A write of the guard's own is never evidence: the quorum GET that finds the placeholder makes
the ghost *deleted* (not "replaced by" the placeholder's UID), and a replica the cache check names
frozen is told to restart, never "heal it without a restart".

Real etcd, three real apiserver replicas, a real `ghost-guard serve` (one worker, so the cache
check that named the replica frozen is the one beside the recorder that gives the advice).
"""

from __future__ import annotations

import json

import pytest

from guard.core.heal_plan import placeholder_pod
from guard.lab.harness import create, eventually, make_ghost

pytestmark = pytest.mark.timeout(240)

NODES = ["node-a", "node-b"]


def test_heal_placeholder_is_no_replacement_and_a_frozen_replica_is_told_to_restart(shared_lab, lab_namespace,
                                                                                    start_guard, tmp_path):
    lab, ns = shared_lab, lab_namespace
    stale = f"{lab.replicas[1].ip}:{lab.replicas[1].port}"
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--workers", "1", "--no-prepare", "--no-events",
                     "--frozen-after", "3", "--stale-confirm-delay", "0.5", "--audit-db", str(tmp_path / "a.db")], wait=None)
    g.wait("/readyz", 90)  # a loaded machine boots a worker slowly
    uid = make_ghost(lab, ns, "web-5", stale=1)
    lab.replicas[1].faults.freeze_watch()
    # heal's placeholder under the ghost's name (replica 1, frozen, never sees it; etcd moves on)
    manifest = placeholder_pod("web-5", [uid], at="2026-01-01T00:00:00Z")
    manifest["metadata"]["namespace"] = ns
    holder = create(lab.core_v1(0), manifest)
    holder_uid = holder["metadata"]["uid"]
    eventually(lambda: g.metric("ghost_guard_replica_frozen", replica=stale) == 1, 60,
               what="replica 1 named frozen", process=g)
    assert "its watch is frozen" in g.logs(None)

    pod = {"metadata": {"name": "web-5", "namespace": ns, "uid": uid},
           "spec": {"containers": [{"name": "app", "image": "pause"}]}, "status": {"phase": "Pending"}}
    out = g.post("/filter", {"Pod": pod, "Nodes": None, "NodeNames": NODES}).json()
    reasons = set(out["FailedAndUnresolvableNodes"].values())
    assert sorted(out["FailedAndUnresolvableNodes"]) == NODES, out
    (reason,) = reasons
    # the per-node reason is the verdict alone; the record (its stdout line) carries the evidence
    assert reason.startswith("ghost pod: ghost-deleted "), reason

    def blocked() -> list[dict]:
        return [d for d in (json.loads(line) for line in g.stdout().splitlines() if line.startswith("{"))
                if d.get("event") == "ghost-blocked" and d.get("name") == "web-5"]

    (line,) = eventually(blocked, 30, what="the ghost's record on stdout", process=g)
    assert line["verdict"] == "ghost-deleted" and line["evidence"]["quorum_get"]["heal_placeholder"] is True, line
    assert "placeholder" in line["evidence"]["reason"] and "replaced" not in line["evidence"]["reason"], line
    assert holder_uid not in line["evidence"]["reason"], line  # never named as a replacement
    assert "ghost-replaced" not in g.logs(None)

    def advice() -> list[str]:
        return [r["msg"] for r in g.log_records("guard.incident")
                if "still serves pod" in r.get("msg", "") and stale in r["msg"]]

    (said,) = eventually(advice, 30, what="the stale-replica advice", process=g)
    assert "restart that apiserver replica" in said and "without a restart" not in said, said
    lab.core_v1(0).delete_namespaced_pod("web-5", ns, _request_timeout=5)
