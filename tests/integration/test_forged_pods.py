"""Forged pod identities on the lab (issue 25, hole 2): no request makes a healthy replica look stale.

A ``/filter`` for ``<live-pod>,metadata.namespace=default`` used to get a 404 from the quorum GET
(no pod has that literal name), be judged a ghost, and then every replica's probe (a field selector
built from the name) returned the live pod: every replica confirmed stale, StaleWatchCache Events,
and with ``--heal`` a heal. Now every pod identity a caller sends is validated as the apiserver
validates it (guard.core.names) and refused with a 400 and the reason, on ``/filter``, ``/preempt`` and
the binding review, whatever the UID (the live pod's or none).

To show that nothing happens *later* either (the attribution runs after the reply), a real ghost is
made and asked about after the forged calls: once its replica is confirmed stale and healed (the
same delays the forged calls would have had), no other replica is stale, no record, Event or heal
names the live pod, and no pod with an invalid name exists.

Real etcd, three real apiserver replicas, a real ``ghost-guard serve --heal``.
"""

from __future__ import annotations


import orjson
import pytest
from clirun import audit_records
from guardstate import view_pods
from payloads import binding_review, filter_body, preempt_body

from guard.lab.harness import create, eventually, make_ghost, pod_manifest
from guard.core.names import pod_identity_problem

pytestmark = pytest.mark.timeout(180)

GUARD = ["--sweep-interval", "0.5", "--stale-confirm-delay", "0.5", "--reprobe-interval", "0.5",
         "--discovery-interval", "5", "--heal", "--prepare-idle-after", "0"]

SELECTOR_TAILS = [",metadata.namespace=default", ",metadata.name!=x", "&fieldSelector=metadata.name%3Dlive",
                  " ", "\u202e", "/../live", ".", ",spec.nodeName="]


def filter_doc(namespace: str, name: str, uid: str | None) -> dict:
    return filter_body(namespace, name, uid, ["n1", "n2"], spec=False)


def preempt_doc(namespace: str, name: str, uid: str | None) -> dict:
    return preempt_body(namespace, name, uid, "n1", spec=False)


def review_doc(namespace: str, name: str, uid: str | None) -> dict:
    return binding_review(namespace, name, uid, node="n1", review_uid="rev-1")


DOCS = {"/filter": filter_doc, "/preempt": preempt_doc, "/validate/binding": review_doc}


def test_forged_names_are_refused_and_no_replica_is_named(lab, start_guard, tmp_path):
    api = lab.core_v1(0)
    live = create(api, pod_manifest("live"))  # pending: no node
    live_uid = live["metadata"]["uid"]
    db = str(tmp_path / "audit.db")
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", db, *GUARD], wait=None)
    g.wait("/readyz", timeout=60)
    eventually(lambda: "apiserver replicas" in g.logs(tail=None), 30, what="replica discovery", process=g)
    replicas = [f"{r.ip}:{r.port}" for r in lab.replicas]

    forged = [("default", "live" + tail) for tail in SELECTOR_TAILS]
    forged += [("default,metadata.name=live", "live"), ("Default", "live"), ("d" * 64, "live"), ("default", "L" * 5),
               ("default", "a" * 254)]
    calls = 0
    for namespace, name in forged:
        assert pod_identity_problem(namespace, name, "") is not None
        for path, doc in DOCS.items():
            for uid in (live_uid, "", None):
                resp = g.post(path, orjson.dumps(doc(namespace, name, uid)))
                calls += 1
                assert resp.status_code == 400, (path, namespace, name, uid, resp.status_code, resp.text[:300])
                assert set(resp.json()) == {"error"}
                reason = resp.json()["error"]
                assert "DNS-1123" in reason, reason
                assert "\u202e" not in reason  # escaped in the reason (guard.core.names.visible)
    # a forged UID too
    for uid in ("x,y", "a b", "\u202eu", "u" * 129, "-u"):
        resp = g.post("/filter", orjson.dumps(filter_doc("default", "live", uid)))
        calls += 1
        assert resp.status_code == 400 and "uid" in resp.json()["error"], (uid, resp.text[:300])

    # A real ghost, asked about after the forged calls: its follow-ups run after theirs would have.
    ghost_uid = make_ghost(lab, "default", "web-1", stale=1)
    lab.replicas[1].faults.clear()  # one lost delete; the watch flows on (heal can fix it)
    stale = replicas[1]
    # The guard verified web-1 ahead when its watch showed it created (a prepared "alive" verdict); that
    # verdict holds until the guard's own views show the DELETE (a call in between is answered "alive": seen
    # once under load). Wait until they do: "live" everywhere, web-1 only on the stale replica.
    eventually(lambda: sorted(view_pods(g).values()) == [1, 1, 2], 30, what="the guard's views of the DELETE",
               interval=0.2, process=g)
    assert view_pods(g)[stale] == 2
    resp = g.post("/filter", orjson.dumps(filter_doc("default", "web-1", ghost_uid)))
    assert resp.status_code == 200 and resp.json()["FailedAndUnresolvableNodes"], resp.text[:300]
    eventually(lambda: g.metric("ghost_guard_heals_total", outcome="healed") >= 1, 60,
               what="the real ghost confirmed stale and healed", process=g)

    assert g.metric("ghost_guard_stale_replica_detections_total", replica=replicas[0]) == 0
    assert g.metric("ghost_guard_stale_replica_detections_total", replica=replicas[2]) == 0
    assert g.metric("ghost_guard_stale_replica_detections_total", replica=stale) == 1
    # nothing recorded, announced or healed about the live pod or a forged name
    records = audit_records(db)
    assert [(r["namespace"], r["name"]) for r in records] == [("default", "web-1")], records
    heals = g.metric("ghost_guard_heals_total")
    assert heals == 1, heals
    events = [e for e in api.list_namespaced_event("default").items
              if e.involved_object.uid == live_uid or "live" in (e.message or "")]
    assert events == [], [(e.reason, e.message) for e in events]
    pods = api.list_namespaced_pod("default").items
    assert sorted(p.metadata.name for p in pods) == ["live"]
    assert all(pod_identity_problem(p.metadata.namespace, p.metadata.name, "") is None for p in pods)
    assert api.read_namespaced_pod("live", "default").metadata.uid == live_uid
    print(f"\nforged calls: {calls}, all 400; stale replicas named for them: 0; heals: 0 (1 for the real ghost)")
