"""The incident on the lab, through the running guard's own recorder: one replica drops a DELETE, the
audit record keeps what the quorum GET said (the nested ``quorum_get`` evidence of docs/OPERATIONS.md),
the probes name exactly that replica, `report` says what to do, and after a restart the record shows
it healed.

Real etcd, real HTTPS replicas, and the objects one guard worker builds, wired as
``guard.engine.wiring.build_guard`` wires them: ``Checker.answer`` (what /filter, /preempt and
/validate/binding call) -> ``IncidentRecorder`` (new ghost, sightings, block recorder) -> the store
``guard.audit.backend.GuardAudit.open`` opens, with the recorder's ``announce_new_ghost`` as its ``on_new`` hook (the new-ghost
line on stdout). The follow-ups run inline
and the stale confirmation's timer only records the delay asked for: the test runs each step itself,
no sleeping. The CLI runs as a subprocess.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from clirun import ghost_guard_json

from guard.audit.backend import AuditBackend, GuardAudit
from guard.engine.checker import Checker, Events
from guard.engine.incident import IncidentRecorder, announce_new_ghost
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.lab.harness import make_ghost, pod_manifest
from guard.engine.replicas import ReplicaPool
from guard.core.settings import Settings
from guard.core.verdict import PodRef

pytestmark = pytest.mark.timeout(120)

PODS = "/api/v1/namespaces/default/pods"


@dataclass
class Worker:
    """One guard worker's checker and recorder; ``delays``: the timers the recorder asked for."""

    settings: Settings
    checker: Checker
    incidents: IncidentRecorder
    audit: AuditBackend
    delays: list[tuple[float, object, tuple]]


@pytest.fixture
def worker(lab, tmp_path: Path) -> Iterator[Worker]:
    settings = Settings(kubeconfig=lab.kubeconfig(0), audit_db=str(tmp_path / "audit.db"), events=False,
                        probe_timeout=2.0, reprobe_interval=0.001)
    kube = Kube(load_configuration(settings.kubeconfig), timeout=2.0, pool_size=4)
    opened = GuardAudit.open(settings, on_new=announce_new_ghost)
    assert opened.store is not None, opened.health.detail()
    audit = opened.store
    pool = ReplicaPool(settings, kube)
    delays: list[tuple[float, object, tuple]] = []
    built: list[IncidentRecorder] = []

    def events(checker: Checker) -> Events:  # as guard.engine.wiring.build_guard does
        built.append(IncidentRecorder(settings, kube, pool, opened, retract=checker.retract,
                                      later=lambda delay, fn, *args: delays.append((delay, fn, args))))
        return built[0].events()

    checker = Checker(settings, kube.quorum_get, events=events, background=False)
    (incidents,) = built
    yield Worker(settings, checker, incidents, audit, delays)
    incidents.close()
    audit.close()
    pool.close()
    kube.close()


def announced(capsys: pytest.CaptureFixture[str]) -> list[dict]:
    """The new-ghost lines written to stdout since the last call."""
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_stale_replica_named_then_healed_after_restart(lab, worker: Worker, capsys) -> None:
    uid = make_ghost(lab, "default", "web-1", stale=1)
    stale = f"{lab.replicas[1].ip}:{lab.replicas[1].port}"
    db = worker.settings.audit_db
    ghost = PodRef("default", "web-1", uid)

    # The scheduler asks about the ghost: quorum GET -> ghost-deleted -> record, etcd again, every replica probed.
    decision = worker.checker.answer(worker.checker.call(ghost))
    assert decision.verdict.value == "ghost-deleted"
    evidence = {"reason": decision.reason,
                "quorum_get": {"outcome": "not-found", "http_status": 404, "uid": None, "node_name": None,
                               "deletion_timestamp": None, "resource_version": None}}
    record = worker.audit.record(uid)
    assert record is not None
    assert (record.namespace, record.name, record.verdict, record.times_blocked) == ("default", "web-1",
                                                                                     "ghost-deleted", 1)
    assert dict(record.evidence) == evidence
    # The replica serving the ghost is not written down yet (it may only lag); the two others are, as consistent.
    assert record.stale_replicas == []
    assert sorted((s.replica, s.serves) for s in record.replicas) == sorted(
        (f"{r.ip}:{r.port}", False) for i, r in enumerate(lab.replicas) if i != 1)
    # One new-ghost line, with what the record holds.
    (line,) = announced(capsys)
    assert {k: line[k] for k in ("event", "namespace", "name", "uid", "verdict", "evidence")} == {
        "event": "ghost-blocked", "namespace": "default", "name": "web-1", "uid": uid, "verdict": "ghost-deleted",
        "evidence": evidence}

    # The confirmation after --stale-confirm-delay; meanwhile the stale cache keeps applying other events.
    ((delay, confirm, args),) = worker.delays
    assert delay == worker.settings.stale_confirm_delay
    lab.core_v1(0).create_namespaced_pod("default", pod_manifest("web-2"), _request_timeout=5)
    assert lab.wait_synced()
    confirm(*args)
    record = worker.audit.record(uid)
    assert record is not None and record.stale_replicas == [stale]
    # Both probes were answered by that replica's cache (its request log), not by another replica.
    assert [(r.query, r.source) for r in lab.replicas[1].requests(method="GET", path=PODS)] == [
        ({"fieldSelector": "metadata.name=web-1", "resourceVersion": "0"}, "cache")] * 2

    report = ghost_guard_json("report", "--db", db, "-o", "json", status=1)  # a replica serves a ghost: exit 1, as diagnose
    assert [r["replica"] for r in report["stale_replicas"]] == [stale]
    assert [(g["namespace"], g["name"], g["uid"]) for g in report["stale_replicas"][0]["ghosts"]] == [
        ("default", "web-1", uid)]
    assert report["remediation"][0].startswith("Heal without restarting anything: ghost-guard heal default/web-1 (")
    assert f"Only if heal reports a replica frozen (its cache revision no longer moves; among {stale})" in (
        report["remediation"][2])

    # The operator restarts that replica: its cache is rebuilt from etcd. The scheduler asks again: the
    # sighting is recorded and, the re-probe being due, every replica is probed again: healed.
    lab.replicas[1].restart()
    assert lab.wait_synced()
    assert worker.checker.answer(worker.checker.call(ghost)).verdict.value == "ghost-deleted"
    assert announced(capsys) == []  # not new any more
    assert len(worker.delays) == 1  # nobody serves it: nothing to confirm

    (record,) = ghost_guard_json("audit", "--db", db, "-o", "json", "--replica", stale)
    assert (record["uid"], record["verdict"], record["times_blocked"], record["stale_replicas"]) == (
        uid, "ghost-deleted", 2, [])
    # The sighting knew less (no read): what the quorum GET said is kept.
    assert record["evidence"] == evidence
    entry = next(r for r in record["replicas"] if r["replica"] == stale)
    assert (entry["state"], entry["serves"]) == ("consistent", False)
    assert entry["first_seen_serving"] is not None and entry["healed_at"] is not None
    report = ghost_guard_json("report", "--db", db, "-o", "json")
    assert report["stale_replicas"] == []
    assert [h["replica"] for h in report["healed_replicas"]] == [stale]
