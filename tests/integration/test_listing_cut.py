"""A replica's listing of unscheduled pods cut mid-body (issue 29: the listing is read as it arrives,
a pod at a time) fails that replica's view, visibly, and only that one: ``/readyz`` shows it retrying
with the broken read while the other replicas stay synced, and it syncs again, with every pending
pod, once its answers are whole."""

from __future__ import annotations

import pytest

from guard.lab.harness import eventually, pod_manifest

pytestmark = pytest.mark.timeout(120)


def views(g) -> dict:
    resp = g.session.get(g.url("/readyz"), timeout=5)
    assert resp.status_code == 200, resp.text  # informational only: never a reason for 503
    return {a: r["watch"] or {} for a, r in resp.json()["details"]["replicas"].items()}


def test_a_listing_cut_mid_body_fails_only_that_replicas_view(lab, start_guard, tmp_path):
    for i in range(30):  # a listing long enough that pods are read before the cut
        lab.core_v1(0).create_namespaced_pod("default", pod_manifest(f"pending-{i:02d}"), _request_timeout=5)
    g = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", str(tmp_path / "a.db"), "--no-events",
                     "--apiserver-replicas", ",".join(r.url for r in lab.replicas), "--prepare-idle-after", "0"])
    addresses = [r.url.removeprefix("https://") for r in lab.replicas]
    eventually(lambda: all(views(g).get(a, {}).get("state") == "synced" and views(g)[a].get("pods") == 30
                           for a in addresses), 30, what="every replica's view synced with the 30 pods", process=g)
    cut = next(i for i, a in enumerate(addresses) if views(g)[a]["mode"] == "list")
    target = addresses[cut]
    rule = lab.replicas[cut].faults.add("cut", method="GET", path="/api/v1/pods", query=".*spec.nodeName.*")

    def failed() -> bool:
        v = views(g)
        return v[target]["state"] == "retrying" and all(v[a]["state"] == "synced" for a in addresses if a != target)

    eventually(failed, 30, what=f"{target}'s view retrying, the others synced", process=g)
    assert rule.hits >= 1
    error = views(g)[target]["error"]
    assert error and "Protocol" in error, error  # the broken read (urllib3: IncompleteRead), said as it is

    lab.replicas[cut].faults.remove(rule.id)
    eventually(lambda: views(g)[target]["state"] == "synced" and views(g)[target]["pods"] == 30, 30,
               what=f"{target}'s view synced again", process=g)
