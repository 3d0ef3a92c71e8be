"""The running guard on the lab: it finds a ghost no scheduler asked about, names exactly the
stale replica (audit record, gauge, Events, `diagnose`), and sees it heal after a restart.
Pre-verification: a pod deleted after its verdict was prepared is not passed.

Real etcd, three real HTTPS apiserver replicas, a real `ghost-guard serve`, the CLI in-process (tests/clirun.py).
"""

from __future__ import annotations

import json
import time

import pytest
from clirun import audit_records, ghost_guard
from payloads import filter_body
from guard.lab.harness import eventually, make_ghost, pod_manifest

pytestmark = pytest.mark.timeout(180)

# --prepare-idle-after 0: the guard verifies ahead from its start, before any scheduler call (these tests
# are about what pre-verification decides; tests/state/test_idle_takeover.py and
# tests/integration/test_two_guards_one_called.py are about when an idle guard does it).
FAST = ["--sweep-interval", "0.5", "--stale-confirm-delay", "0.5", "--reprobe-interval", "0.5",
        "--discovery-interval", "5", "--prepare-idle-after", "0"]


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    return eventually(predicate, timeout, what=what, interval=0.2)  # each audit_records() reads the store


# One lab and one guard for the module: each test uses its own pod names, compares counters, records, Events
# and log lines with what was there at its start, and its faults are cleared after it.
@pytest.fixture(scope="module")
def attribution_guard(module_lab, module_guard, tmp_path_factory):
    db = str(tmp_path_factory.mktemp("attribution") / "audit.db")
    return module_guard(["--kubeconfig", module_lab.kubeconfig(0), "--audit-db", db, *FAST]), db


@pytest.fixture
def shared(mended_module_lab, attribution_guard):
    return mended_module_lab, *attribution_guard


def counter(g, name: str, **labels: str):
    """``name``'s value since now: call the result for the increase."""
    start = g.metric(name, **labels)
    return lambda: g.metric(name, **labels) - start


def event_uids(lab, reason: str) -> set[str]:
    return {e.involved_object.uid for e in lab.core_v1(0).list_namespaced_event("default").items if e.reason == reason}


def test_sweeper_finds_and_attributes_a_ghost_then_sees_the_replica_heal(shared):
    lab, g, db = shared
    verified = {v: counter(g, "ghost_guard_prepare_verified_total", verdict=v) for v in ("ghost-deleted", "terminating")}
    logged = len(g.stdout())
    wait_for(lambda: g.metric("ghost_guard_watch_restarts_total") == 0 and "apiserver replicas" in g.logs(tail=None),
             what="replica discovery")
    uid = make_ghost(lab, "default", "web-1", stale=1)
    stale = f"{lab.replicas[1].ip}:{lab.replicas[1].port}"

    # No scheduler ever calls the guard: the sweep (replicas disagree twice in a row) finds the ghost.
    records = wait_for(lambda: [r for r in audit_records(db) if r["stale_replicas"] and r["uid"] == uid],
                       what="an attributed record")
    (record,) = records
    assert (record["namespace"], record["name"], record["uid"]) == ("default", "web-1", uid)
    # A graceless delete is an update that sets deletionTimestamp, then the delete (the generic store's
    # updateForGracefulDeletionAndFinalizers): a background verification whose GET lands between the
    # two (one etcd write apart; seen as the suite's first test on a busy machine)
    # reads the pod terminating, and that verdict is the one kept. Otherwise the sweep's read finds it gone.
    assert record["verdict"] in ("ghost-deleted", "terminating")
    assert record["stale_replicas"] == [stale]
    # still serving it after --stale-confirm-delay: confirmed stale, not lag
    wait_for(lambda: g.metric("ghost_guard_stale_replica", replica=stale) == 1, what="the stale gauge")
    for other in lab.replicas[0], lab.replicas[2]:
        assert g.metric("ghost_guard_stale_replica", replica=f"{other.ip}:{other.port}") == 0
    assert verified[record["verdict"]]() == 1

    events = wait_for(lambda: {e.reason: e for e in lab.core_v1(0).list_namespaced_event("default").items
                               if e.involved_object.uid == uid and e.reason in ("GhostPodBlocked", "StaleWatchCache")}
                      if len({e.reason for e in lab.core_v1(0).list_namespaced_event("default").items
                              if e.involved_object.uid == uid}) >= 2 else None, what="both Events")
    assert events["GhostPodBlocked"].type == "Warning"
    assert stale in events["StaleWatchCache"].message
    # the new ghost's JSON line for log shippers, exactly once
    lines = [json.loads(line) for line in g.stdout()[logged:].splitlines() if line.startswith("{")]
    assert [(x["uid"], x["verdict"]) for x in lines] == [(uid, record["verdict"])]

    r = ghost_guard("diagnose", "default/web-1", "--kubeconfig", lab.kubeconfig(0), "-o", "json")
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["stale_replicas"] == [stale]

    # The operator restarts that replica: its cache is rebuilt from etcd; the guard sees it heal.
    lab.replicas[1].restart()
    assert lab.wait_synced()
    wait_for(lambda: g.metric("ghost_guard_stale_replica", replica=stale) == 0, what="the gauge to clear")
    healed = wait_for(lambda: [r for r in audit_records(db) if not r["stale_replicas"] and r["uid"] == uid],
                      what="a healed record")
    entry = next(x for x in healed[0]["replicas"] if x["replica"] == stale)
    assert entry["healed_at"] is not None and entry["serves"] is False
    r = ghost_guard("diagnose", "default/web-1", "--kubeconfig", lab.kubeconfig(0))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "verdict: consistent"


def test_a_pod_deleted_after_its_verdict_was_prepared_is_not_passed(shared):
    lab, g, _ = shared
    wait_for(lambda: "apiserver replicas" in g.logs(tail=None), what="replica discovery")
    alive, prepared = counter(g, "ghost_guard_prepare_verified_total", verdict="alive"), \
        counter(g, "ghost_guard_verdicts_prepared_total")
    api = lab.core_v1(0)
    uid = api.create_namespaced_pod("default", pod_manifest("late"), _request_timeout=5).metadata.uid
    wait_for(lambda: alive() >= 1, what="the prepared verdict")
    # The guard's watches of replicas 1 and 3 hold it as an unscheduled pod (their /readyz detail counts them,
    # with the pending pods earlier tests left: `before`).
    others = [r.url.removeprefix("https://") for i, r in enumerate(lab.replicas) if i != 1]
    before = len([p for p in api.list_namespaced_pod("default", _request_timeout=5).items
                  if not p.spec.node_name and p.metadata.name != "late"])

    def watched(count: int) -> bool:
        replicas = g.get("/readyz", timeout=5).json()["details"]["replicas"]
        return all(((replicas.get(a) or {}).get("watch") or {}).get("pods") == before + count for a in others)

    wait_for(lambda: watched(1), what="the pod in the guard's watches of replicas 1 and 3")
    # replica 2 (the scheduler's, say) misses the delete; the others deliver DELETED to the guard's watches
    lab.replicas[1].faults.drop_deletes(namespace="default", name="late")
    api.delete_namespaced_pod("late", "default", grace_period_seconds=0, _request_timeout=5)
    assert lab.wait_synced()
    wait_for(lambda: watched(0), what="the DELETED applied by the guard's watches of replicas 1 and 3")
    body = filter_body("default", "late", uid, spec=False)
    out = g.post("/filter", body).json()
    assert out["NodeNames"] == []
    assert out["FailedAndUnresolvableNodes"]["n1"] == "ghost pod: ghost-deleted (see kube-ghost-guard log/record)"
    assert prepared() == 0  # the prepared alive verdict was dropped


def test_a_prepared_verdict_answers_the_first_call_without_a_get(shared):
    lab, g, _ = shared
    wait_for(lambda: "apiserver replicas" in g.logs(tail=None), what="replica discovery")
    alive, prepared, inline = (counter(g, "ghost_guard_prepare_verified_total", verdict="alive"),
                               counter(g, "ghost_guard_verdicts_prepared_total"),
                               counter(g, "ghost_guard_verdicts_inline_total"))
    uid = lab.core_v1(0).create_namespaced_pod("default", pod_manifest("ready"), _request_timeout=5).metadata.uid
    wait_for(lambda: alive() >= 1, what="the prepared verdict")
    path = "/api/v1/namespaces/default/pods/ready"
    gets = sum(len(r.requests(method="GET", path=path, quorum=True)) for r in lab.replicas)
    assert gets == 1  # the background verification, once, whatever the three watches delivered
    body = filter_body("default", "ready", uid, spec=False)
    first = time.monotonic()
    assert g.post("/filter", body).json()["NodeNames"] == ["n1"]
    assert prepared() == 1
    assert sum(len(r.requests(method="GET", path=path, quorum=True)) for r in lab.replicas) == 1
    # a later attempt (after the grace) means a bind may have failed: verified again, inline
    time.sleep(max(0.0, 0.7 - (time.monotonic() - first)))  # the behaviour: past --prepared-grace (0.5 s)
    assert g.post("/filter", body).json()["NodeNames"] == ["n1"]
    assert inline() == 1
    assert sum(len(r.requests(method="GET", path=path, quorum=True)) for r in lab.replicas) == 2


def test_pods_deleted_normally_are_no_incident(shared):
    """Pods that come and go (a Job, a rollout) may be deleted before their background verification
    runs: that 404 is cached, but nothing is recorded or alerted, since no replica serves them."""
    lab, g, db = shared
    wait_for(lambda: "apiserver replicas" in g.logs(tail=None), what="replica discovery")
    verified, blocked_total = counter(g, "ghost_guard_prepare_verified_total"), counter(g, "ghost_guard_ghosts_blocked_total")
    recorded = {r["uid"] for r in audit_records(db)}
    announced = event_uids(lab, "GhostPodBlocked")

    def new_records() -> list[dict]:
        return [r for r in audit_records(db) if r["uid"] not in recorded]
    api = lab.core_v1(0)
    for i in range(20):
        api.create_namespaced_pod("default", pod_manifest(f"brief-{i}"), _request_timeout=5)
        api.delete_namespaced_pod(f"brief-{i}", "default", grace_period_seconds=0, _request_timeout=5)
    assert lab.wait_synced()
    wait_for(lambda: verified() >= 20, what="the background verifications")
    # A barrier instead of a pause: a real ghost made now is found by later sweeps (two in a row), verified,
    # recorded and announced through the same queues; once its record is there, whatever the sweeps and
    # follow-ups would have made of the brief pods is there too.
    canary = make_ghost(lab, "default", "canary", stale=1)
    wait_for(new_records, what="the canary ghost's record")
    assert [(r["name"], r["uid"]) for r in new_records()] == [("canary", canary)]
    assert blocked_total() == 1
    blocked = wait_for(lambda: [e for e in lab.core_v1(0).list_namespaced_event("default").items
                                if e.reason == "GhostPodBlocked" and e.involved_object.uid not in announced],
                       what="the canary's GhostPodBlocked Event")
    assert [e.involved_object.uid for e in blocked] == [canary]
