"""The incident on the lab, through the audit store: one replica drops a DELETE, the probes name exactly
that replica, `report` says what to restart, and after the restart the record shows it healed.

Real etcd, real HTTPS replicas, the guard's own quorum GET and replica probes (guard/kube.py), the
store, and the CLI as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.attribution import missed_delete, stale_replicas
from guard.audit import AuditStore, ghost_listener
from guard.kube import Kube, Replica, ReplicaClient, load_configuration
from guard.lab.harness import make_ghost, pod_manifest
from guard.report import render_diagnosis
from guard.verdict import PodRef, decide

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def clients(lab) -> Iterator[tuple[Kube, list[ReplicaClient]]]:
    kube = Kube(load_configuration(lab.kubeconfig(0)), timeout=2.0, pool_size=2)
    # As the guard does it: one base configuration (aimed at replica 0), one client pinned to each replica.
    base = load_configuration(lab.kubeconfig(0))
    replicas = [ReplicaClient(base, Replica(f"{r.ip}:{r.port}", r.url), server_name=None, timeout=2.0)
                for r in lab.replicas]
    yield kube, replicas
    for c in replicas:
        c.close()
    kube.close()


def cli(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "guard", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_stale_replica_named_then_healed_after_restart(lab, clients, tmp_path: Path) -> None:
    kube, probes = clients
    uid = make_ghost(lab, "default", "web-1", stale=1)
    stale = probes[1].replica.address
    db = str(tmp_path / "audit.db")
    store = AuditStore(db)
    try:
        # The guard's path: quorum GET -> verdict -> audit record.
        pod = PodRef("default", "web-1", uid)
        read = kube.quorum_get("default", "web-1")
        decision = decide(pod, read)
        assert decision.verdict.value == "ghost-deleted"
        ghost_listener(store)(pod, decision, read)

        # Attribution: probe every replica's cache.
        first = [p.probe("default", "web-1", uid, at=time.time()) for p in probes]
        store.record_observations(uid, first)
        assert stale_replicas(first) == [stale]

        # The stale cache keeps applying other events: it missed the delete, it is not lagging.
        lab.core_v1(0).create_namespaced_pod("default", pod_manifest("web-2"), _request_timeout=5)
        assert lab.wait_synced()
        again = probes[1].probe("default", "web-1", uid, at=time.time())
        store.record_observations(uid, [again])
        assert missed_delete(first[1].cache_resource_version, again.cache_resource_version, again.serves_ghost)
        # Both probes were answered by that replica's cache (its request log), not by another replica.
        assert [(r.query, r.source) for r in lab.replicas[1].requests(method="GET", path="/api/v1/namespaces/default/pods")] == [
            ({"fieldSelector": "metadata.name=web-1", "resourceVersion": "0"}, "cache")] * 2

        diagnosis = render_diagnosis(namespace="default", name="web-1", quorum_status=read.http_status,
                                     quorum_detail="NotFound", observations=[*first, again])
        assert diagnosis.splitlines()[-2:] == [f"verdict: stale replicas {stale}", "next: ghost-guard heal default/web-1 "
                                               "(no restart; restart a replica only if heal reports it frozen)"]

        report = cli("report", "--db", db, "-o", "json")
        assert [r["replica"] for r in report["stale_replicas"]] == [stale]
        assert [(g["namespace"], g["name"], g["uid"]) for g in report["stale_replicas"][0]["ghosts"]] == [("default", "web-1", uid)]
        assert report["remediation"][0].startswith("Heal without restarting anything: ghost-guard heal default/web-1 (")
        assert f"Only if heal reports a replica frozen (its cache revision no longer moves; among {stale})" in report["remediation"][2]

        # The operator restarts that replica: its cache is rebuilt from etcd, the next probe sees it healed.
        lab.replicas[1].restart()
        assert lab.wait_synced()
        after = [p.probe("default", "web-1", uid, at=time.time()) for p in probes]
        assert [o.serves_ghost for o in after] == [False, False, False]
        store.record_observations(uid, after)
    finally:
        store.close()

    (record,) = cli("audit", "--db", db, "-o", "json", "--replica", stale)
    assert (record["uid"], record["verdict"], record["stale_replicas"]) == (uid, "ghost-deleted", [])
    entry = next(r for r in record["replicas"] if r["replica"] == stale)
    assert (entry["state"], entry["serves"]) == ("consistent", False)
    assert entry["first_seen_serving"] is not None and entry["healed_at"] is not None
    assert record["evidence"]["quorum_status"] == 404
    report = cli("report", "--db", db, "-o", "json")
    assert report["stale_replicas"] == []
    assert [h["replica"] for h in report["healed_replicas"]] == [stale]
