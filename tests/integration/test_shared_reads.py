"""A scheduler call that arrives while the pod's background verification is still in flight
waits for that GET instead of making its own: one quorum GET per pod, counted as shared."""

from __future__ import annotations

import pytest
from payloads import filter_body

from guard.lab.harness import eventually, pod_manifest

pytestmark = pytest.mark.timeout(120)


def test_a_call_during_the_background_get_shares_it(lab, start_guard, tmp_path):
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", str(tmp_path / "a.db"), "--no-events",
                     "--get-timeout", "1.9", "--prepare-idle-after", "0"])  # verify ahead before any call
    eventually(lambda: "apiserver replicas" in g.logs(tail=None), 20, what="replica discovery")
    path = "/api/v1/namespaces/default/pods/slow"
    # every quorum GET of this pod takes 1.5 s (within the 2 s request budget): the background one is
    # still running when the scheduler asks, as soon as that GET has reached a replica
    rules = [r.faults.add("latency", method="GET", path=f"^{path}$", query="^$", seconds=1.5) for r in lab.replicas]
    uid = lab.core_v1(0).create_namespaced_pod("default", pod_manifest("slow"), _request_timeout=5).metadata.uid
    assert lab.wait_synced()
    # The background GET has reached a replica (a rule counts its hit on arrival) and is held there for 1.5 s.
    eventually(lambda: sum(rule.hits for rule in rules) >= 1, 5, what="the background quorum GET under way",
               interval=0.01)
    body = filter_body("default", "slow", uid, spec=False)
    assert g.post("/filter", body).json()["NodeNames"] == ["n1"]
    # It waited for the rest of the background GET, not a GET of its own:
    assert (g.metric("ghost_guard_verdicts_shared_read_total"), g.metric("ghost_guard_verdicts_inline_total"),
            g.metric("ghost_guard_verdicts_prepared_total")) == (1, 0, 0)
    assert sum(len(r.requests(method="GET", path=path, quorum=True)) for r in lab.replicas) == 1
