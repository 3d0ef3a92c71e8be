"""Two guard replicas against one lab, only one of them called (the leading scheduler's connection
reaches one guard): the cluster pays one quorum GET per pod, not one per guard.

Neither guard watches while idle: both list every replica's cache every few seconds. The one
nobody calls (idle, --prepare-idle-after) makes no quorum GET for the new pods and says so in
/readyz and ``ghost_guard_prepare_active``. The called one's first call is a takeover: answered
inline, the backlog of pods pending before it is verified in the background, so the scheduler's
later calls find their verdicts prepared, and it watches one replica (of three) from then on.
"""

from __future__ import annotations

import pytest
from payloads import filter_body

from guard.lab.harness import eventually, pod_manifest

pytestmark = pytest.mark.timeout(120)

PODS = 8


def prepare_detail(g) -> dict:
    resp = g.session.get(g.url("/readyz"), timeout=5)
    assert resp.status_code == 200, resp.text
    return resp.json()["details"]["prepare"]


def modes(g) -> dict[str, tuple[str, str]]:
    replicas = g.session.get(g.url("/readyz"), timeout=5).json()["details"]["replicas"]
    return {a: (r["watch"]["mode"], r["watch"]["state"]) for a, r in replicas.items() if r["watch"]}


def test_only_the_called_guard_verifies_and_the_backlog_is_ready_after_the_takeover(lab, start_guard, tmp_path):
    args = ["--kubeconfig", lab.kubeconfig(0), "--no-events", "--discovery-interval", "5"]
    called, idle = start_guard.together([*args, "--audit-db", str(tmp_path / "a.db")],
                                        [*args, "--audit-db", str(tmp_path / "b.db")])
    for g in (called, idle):
        eventually(lambda g=g: len(modes(g)) == 3 and all(m == ("list", "synced") for m in modes(g).values()), 20,
                   what="every replica listed, none watched", process=g)
    api = lab.core_v1(0)
    uids = {f"p-{i}": api.create_namespaced_pod("default", pod_manifest(f"p-{i}"), _request_timeout=5).metadata.uid
            for i in range(PODS)}
    assert lab.wait_synced()
    for g in (called, idle):  # both watches hold the backlog; neither verifies it
        eventually(lambda g=g: prepare_detail(g)["backlog"] == PODS, 10, what="the backlog watched", process=g)
        assert prepare_detail(g)["active"] is False
        assert g.metric("ghost_guard_prepare_active") == 0
        assert g.metric("ghost_guard_prepare_deferred_total") == PODS

    def quorum_gets() -> int:
        return sum(len([q for q in r.requests(method="GET", quorum=True)
                        if q.path.startswith("/api/v1/namespaces/default/pods/p-")]) for r in lab.replicas)

    assert quorum_gets() == 0

    # The takeover: p-0 is answered by its own quorum GET (inline, or sharing the GET the background verifier
    # began for it: the takeover queues the backlog, p-0 included, as the call arrives); the rest of the backlog
    # is verified in the background.
    def own_reads() -> float:
        return called.metric("ghost_guard_verdicts_inline_total") + called.metric("ghost_guard_verdicts_shared_read_total")

    assert called.post("/filter", filter_body("default", "p-0", uids["p-0"])).json()["NodeNames"] == ["n1"]
    assert own_reads() == 1
    shared = called.metric("ghost_guard_verdicts_shared_read_total")  # 1: the verifier's GET for p-0 counted too
    eventually(lambda: called.metric("ghost_guard_prepare_verified_total", verdict="alive") == PODS - 1 + shared, 10,
               what="the backlog verified in the background", process=called)
    assert called.metric("ghost_guard_prepare_takeovers_total") == 1
    # (/readyz details are reused for 2 s)
    eventually(lambda: (d := prepare_detail(called))["active"] is True and d["backlog"] == 0, 5,
               what="/readyz: verifying ahead", process=called)
    for i in range(1, PODS):
        assert called.post("/filter", filter_body("default", f"p-{i}", uids[f"p-{i}"])).json()["NodeNames"] == ["n1"]
    assert called.metric("ghost_guard_verdicts_prepared_total") == PODS - 1
    assert own_reads() == 1
    eventually(lambda: called.metric("ghost_guard_prepare_active") == 1, 5, what="the gauge sampled",
               process=called)

    # The called guard watches one replica and lists the other two; the idle one still watches none.
    eventually(lambda: sorted(modes(called).values()) == [("list", "synced")] * 2 + [("watch", "synced")], 5,
               what="one replica watched by the called guard", process=called)
    assert all(m == ("list", "synced") for m in modes(idle).values())

    # The cluster paid one quorum GET per pod; the idle guard none.
    assert quorum_gets() == PODS
    assert idle.metric("ghost_guard_quorum_get_duration_seconds_count") == 0
    assert idle.metric("ghost_guard_prepare_verified_total") == 0
    assert prepare_detail(idle)["active"] is False
