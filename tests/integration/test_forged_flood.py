"""A flood of forged /filter calls (issue 25, hole 8): pods that never existed, in many namespaces,
while a real ghost (a lab replica dropped its delete) is asked about.

Every forged call is still answered ``ghost-deleted`` (etcd has no such pod: right for the
scheduler), but what it costs besides is bounded: GhostPodBlocked Events, audit records and
follow-ups for ghosts no replica ever listed stay within --unsighted-ghost-rate/-burst (shed
calls counted in ghost_guard_flood_shed_total), while the real ghost, which a replica lists, gets
its record, its Event and its attribution; and pruning at --audit-max-records keeps the ghost a
replica was seen serving over the forged ones.

Real etcd, three real HTTPS apiserver replicas, real `ghost-guard serve` processes.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import requests
from clirun import audit_records
from guardstate import view_pods
from payloads import filter_body
from guard.lab.harness import eventually, make_ghost

pytestmark = pytest.mark.timeout(240)

FAST = ["--sweep-interval", "0.5", "--stale-confirm-delay", "0.5", "--reprobe-interval", "0.5",
        "--discovery-interval", "5", "--prepare-idle-after", "0"]
NAMESPACES = ["default", "kube-system", "kube-public", "flood-a", "flood-b", "flood-c"]
FORGED = 600
RATE, BURST = 0.05, 2  # per namespace; all namespaces together: 0.5/s, 20


def flood(g, calls: list[tuple[str, str, str]]) -> list[int]:
    """Send the forged calls from 8 threads, each with its own connection; the status codes."""
    def send(chunk: list[tuple[str, str, str]]) -> list[int]:
        with requests.Session() as s:
            s.trust_env = False
            codes = []
            for ns, name, uid in chunk:
                r = s.post(g.url("/filter"), data=orjson.dumps(filter_body(ns, name, uid, spec=False)),
                           headers={"Content-Type": "application/json"}, timeout=10)
                assert r.json()["NodeNames"] == []  # still a ghost for the scheduler: etcd has no such pod
                codes.append(r.status_code)
            return codes

    with ThreadPoolExecutor(8) as pool:
        return [c for codes in pool.map(send, [calls[i::8] for i in range(8)]) for c in codes]


def ghost_events(lab, uids: set[str]) -> list:
    return [e for ns in NAMESPACES for e in lab.core_v1(0).list_namespaced_event(ns, _request_timeout=10).items
            if e.reason == "GhostPodBlocked" and e.involved_object.uid in uids]


def test_a_forged_flood_is_shed_before_it_costs_a_real_ghost_its_record_event_or_attribution(lab, start_guard,
                                                                                               tmp_path):
    for ns in NAMESPACES[3:]:
        lab.core_v1(0).create_namespace({"metadata": {"name": ns}}, _request_timeout=10)
    db = str(tmp_path / "audit.db")
    args = ["--kubeconfig", lab.kubeconfig(0), "--audit-db", db, *FAST,
            "--unsighted-ghost-rate", str(RATE), "--unsighted-ghost-burst", str(BURST)]
    g = start_guard(args)
    # Every known shed reason is exported from zero, before anything was shed (a rate() over it works at once).
    for reason in ("namespace-budget", "global-budget", "queue-full"):
        assert f'ghost_guard_flood_shed_total{{reason="{reason}"}} 0.0' in g.get("/metrics", timeout=5).text
    eventually(lambda: "apiserver replicas" in g.logs(tail=None), 20, what="replica discovery", process=g)
    real_uid = make_ghost(lab, "default", "real-ghost", stale=1)
    stale = f"{lab.replicas[1].ip}:{lab.replicas[1].port}"
    # The guard's views hold the pod on the stale replica only (it listed it: the real ghost is "sighted"), and
    # the others show its DELETE (until the guard's watch shows it, a prepared "alive" verdict answers for it).
    def ghost_on_the_stale_replica_only() -> bool:
        pods = view_pods(g)
        return len(pods) == 3 and pods == {r: int(r == stale) for r in pods}

    eventually(ghost_on_the_stale_replica_only, 20, what="the guard's views: the ghost on the stale replica only",
               interval=0.2, process=g)

    forged = [(NAMESPACES[i % len(NAMESPACES)], f"forged-{i}", str(uuid.uuid4())) for i in range(FORGED)]
    forged_uids = {uid for _, _, uid in forged}
    started = time.monotonic()
    half = FORGED // 2
    codes = flood(g, forged[:half])
    # the real ghost, asked in the middle of the flood, as kube-scheduler would
    out = g.post("/filter", filter_body("default", "real-ghost", real_uid)).json()
    # blocked on every node; the per-node reason is the verdict alone (the pod is named in the log and record)
    assert out["NodeNames"] == [] and out["FailedAndUnresolvableNodes"]["n1"].startswith("ghost pod: ")
    codes += flood(g, forged[half:])
    elapsed = time.monotonic() - started
    assert codes == [200] * FORGED

    # The real ghost: its record names the stale replica (the attribution follow-up ran), its Event is written.
    record = eventually(lambda: next((r for r in audit_records(db) if r["uid"] == real_uid and r["stale_replicas"]),
                                     None), 30, what="the real ghost's attributed record", interval=0.3, process=g)
    assert record["stale_replicas"] == [stale]
    eventually(lambda: ghost_events(lab, {real_uid}), 20, what="the real ghost's GhostPodBlocked Event", process=g)

    # The flood: within the budget (all namespaces together: GLOBAL_FACTOR x the per-namespace one).
    budget = 10 * BURST + 10 * RATE * (elapsed + 1)
    shed = sum(g.metric("ghost_guard_flood_shed_total", reason=r) for r in ("namespace-budget", "global-budget"))
    forged_records = [r for r in audit_records(db) if r["uid"] in forged_uids]
    events = ghost_events(lab, forged_uids)
    print(f"\nflood of {FORGED} forged /filter calls in {elapsed:.1f}s: {len(forged_records)} records, "
          f"{len(events)} GhostPodBlocked Events, {shed:g} shed; "
          f"followups dropped {g.metric('ghost_guard_followups_dropped_total'):g}")
    assert len(forged_records) <= budget, (len(forged_records), budget)
    assert len(events) <= budget, (len(events), budget)
    assert shed == FORGED - len(forged_records)
    assert g.metric("ghost_guard_flood_shed_total", reason="queue-full") == 0
    assert g.metric("ghost_guard_followups_dropped_total") == 0

    # Pruning at --audit-max-records: a guard restarted with room for one record prunes on its first write
    # (a forged call, the newest record of all; --no-prepare: no sweep writes first); the record naming a
    # stale replica is the one kept.
    g.stop()
    g2 = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", db, "--no-prepare", "--audit-max-records", "1"])
    g2.post("/filter", filter_body("flood-a", "forged-after-restart", str(uuid.uuid4())))
    kept = eventually(lambda: (lambda rs: rs if len(rs) == 1 else None)(audit_records(db)), 20,
                      what="the prune to one record", interval=0.3, process=g2)
    assert [r["uid"] for r in kept] == [real_uid]
