"""Real `ghost-guard serve` processes recording to the lab's apiserver with --audit-store kubernetes:
two guards converge on one GhostPod per ghost, `kubectl get ghostpods -A` and `ghost-guard
audit|report --audit-store kubernetes` read it from any kubeconfig, and `ghost-guard audit export`
migrates a SQLite store (safe to run twice)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
from kubernetes import client

from clirun import ghost_guard
from payloads import filter_body
from guard.audit.sqlite import AuditStore
from guard.lab.harness import eventually, make_ghost

pytestmark = pytest.mark.timeout(180)

G, V, P = "kube-ghost-guard.io", "v1alpha1", "ghostpods"
FAST = ["--sweep-interval", "0.5", "--stale-confirm-delay", "0.5", "--reprobe-interval", "0.5",
        "--discovery-interval", "5", "--audit-store", "kubernetes", "--audit-write-interval", "0.5", "--no-events"]


def ghostpods(lab, namespace: str) -> list[dict]:
    return client.CustomObjectsApi(lab.api_client(0)).list_namespaced_custom_object(G, V, namespace, P)["items"]


def test_two_guards_record_one_ghostpod_readable_from_any_kubeconfig(lab, start_guard, tmp_path):
    guards = start_guard.together(*(["--kubeconfig", lab.kubeconfig(i), "--audit-db", str(tmp_path / f"unused-{i}.db"),
                                     *FAST] for i in (0, 2)))
    for g in guards:
        eventually(lambda: "apiserver replicas" in g.logs(tail=None), 20, what="replica discovery", process=g)
    uid = make_ghost(lab, "default", "web-1", stale=1)
    stale = f"{lab.replicas[1].ip}:{lab.replicas[1].port}"
    # the scheduler loops on the ghost through both guards (the Service spreads its calls)
    for _ in range(20):
        for g in guards:
            out = g.post("/filter", filter_body("default", "web-1", uid, ["node-a"])).json()
            assert out["NodeNames"] == [] and out["FailedAndUnresolvableNodes"] == {"node-a": out["FailedAndUnresolvableNodes"]["node-a"]}

    def attributed():
        objs = ghostpods(lab, "default")
        return objs if len(objs) == 1 and objs[0].get("status", {}).get("staleReplicas") == stale else None

    (obj,) = eventually(attributed, 30, what="one GhostPod naming the stale replica", interval=0.2)
    assert obj["spec"]["podName"] == "web-1" and obj["spec"]["podUID"] == uid and obj["spec"]["verdict"] == "ghost-deleted"
    assert obj["spec"]["evidence"]["quorum_get"]["http_status"] == 404
    eventually(lambda: ghostpods(lab, "default")[0]["status"]["timesBlocked"] >= 40, 15, what="every block counted")
    for g in guards:
        detail = g.get("/readyz").json()["details"]["audit_store"]
        assert (detail["path"], detail["writable"]) == ("kubernetes (GhostPod objects)", True), detail

    # The guards stop (a rollout): what they had pending is written at exit; the records stay.
    for g in guards:
        g.stop()
    # `report` from "a laptop": only a kubeconfig, any replica's; the same answer each time.
    answers = []
    for i in (0, 1, 2):
        r = ghost_guard("report", "--audit-store", "kubernetes", "--kubeconfig", lab.kubeconfig(i), "-o", "json")
        assert r.returncode == 1, r.stderr  # it lists a replica serving a ghost: exit 1, as diagnose
        answers.append(json.loads(r.stdout))
    assert answers[0] == answers[1] == answers[2]
    assert [s["replica"] for s in answers[0]["stale_replicas"]] == [stale]
    r = ghost_guard("audit", "--audit-store", "kubernetes", "--kubeconfig", lab.kubeconfig(2), "-o", "json")
    assert r.returncode == 0, r.stderr
    (record,) = json.loads(r.stdout)
    assert (record["namespace"], record["name"], record["uid"], record["stale_replicas"]) == ("default", "web-1", uid, [stale])
    # filters as with SQLite
    r = ghost_guard("audit", "--audit-store", "kubernetes", "--kubeconfig", lab.kubeconfig(0), "--namespace", "other", "-o", "json")
    assert r.returncode == 0 and json.loads(r.stdout) == []

    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "--kubeconfig", lab.kubeconfig(0), "get", "ghostpods", "-A"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        row = out.stdout.splitlines()[1].split()
        assert row[0] == "default" and row[2:5] == ["web-1", "ghost-deleted", stale], out.stdout


def test_the_cli_says_clearly_when_the_kubernetes_store_cannot_be_read(dead_kubeconfig, tmp_path):
    r = ghost_guard("audit", "--audit-store", "kubernetes", "--kubeconfig", dead_kubeconfig)
    assert r.returncode == 1 and r.stderr.startswith("ghost-guard audit: cannot read GhostPods:"), r.stderr
    assert "Traceback" not in r.stderr
    r = ghost_guard("report", "--audit-store", "kubernetes", "--kubeconfig", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot load cluster credentials" in r.stderr and "Traceback" not in r.stderr
    r = ghost_guard("audit", "--audit-store", "etcd")
    assert r.returncode == 2 and "--audit-store must be" in r.stderr


def test_export_from_sqlite_migrates_every_record_and_is_safe_to_repeat(shared_lab, lab_namespace, tmp_path):
    db = str(tmp_path / "audit.db")
    now = time.time() - 60
    with AuditStore(db) as store:
        for i in range(3):
            for k in range(i + 1):
                store.record_block(uid=f"uid-{i}", namespace=lab_namespace, name=f"web-{i}", verdict="ghost-deleted",
                                   evidence={"reason": f"r{i}", "quorum_get": {"http_status": 404}}, at=now + i + k)
        store.record_probe(uid="uid-0", replica="10.0.0.2:6443", serves=True, cache_resource_version="41", error=None,
                           at=now + 5)
        store.record_probe(uid="uid-1", replica="10.0.0.2:6443", serves=True, cache_resource_version="41", error=None,
                           at=now + 5)
        store.record_probe(uid="uid-1", replica="10.0.0.2:6443", serves=False, cache_resource_version="50", error=None,
                           at=now + 9)
        store.retract(uid="uid-2", at=now + 10)
        node = f"ghost-node-{lab_namespace}"  # (GhostNodes are cluster-wide: a name of this test's own)
        store.record_node(name=node, uid="node-uid-0", serving=["10.0.0.2:6443"], at=now + 1,
                          evidence={"quorum_get": {"http_status": 404}})
        store.record_node(name=node, uid="node-uid-0", serving=["10.0.0.2:6443"], at=now + 2)
        store.record_node_heal(name=node, uid="node-uid-0", action="placeholder", outcome="healed", detail="ok",
                               at=now + 3)
        store.record_node(name=node, uid="node-uid-0", serving=[], healed=["10.0.0.2:6443"], at=now + 4)
    kc = shared_lab.kubeconfig(1)
    r = ghost_guard("audit", "export", "--from", f"sqlite:{db}", "--to", "kubernetes", "--kubeconfig", kc)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["3 records read, 3 GhostPods created, 0 existing, 0 failed",
                                     "1 ghost Node records read, 1 GhostNodes created, 0 existing, 0 failed"]
    r = ghost_guard("audit", "export", "--from", f"sqlite:{db}", "--to", "kubernetes", "--kubeconfig", kc)
    assert r.stdout.splitlines() == ["3 records read, 0 GhostPods created, 3 existing, 0 failed",
                                     "1 ghost Node records read, 0 GhostNodes created, 1 existing, 0 failed"], r.stderr

    def nodes(*store_args: str) -> list[dict]:
        out = ghost_guard("audit", *store_args, "--nodes", "-o", "json")
        assert out.returncode == 0, out.stderr
        return [n for n in json.loads(out.stdout) if n["node"] == node]

    (from_sqlite_node,) = nodes("--audit-store", f"sqlite:{db}")
    assert from_sqlite_node["times_detected"] == 2 and from_sqlite_node["heals"], from_sqlite_node
    assert nodes("--audit-store", "kubernetes", "--kubeconfig", kc) == [from_sqlite_node]  # exported twice, counted once

    def listing(*store_args: str) -> list[dict]:
        out = ghost_guard("audit", *store_args, "--namespace", lab_namespace, "--retracted", "-o", "json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    from_sqlite = listing("--audit-store", f"sqlite:{db}")
    from_kubernetes = listing("--audit-store", "kubernetes", "--kubeconfig", kc)
    assert from_kubernetes == from_sqlite
    assert [r["times_blocked"] for r in from_kubernetes] == [3, 2, 1]  # exported twice, counted once
    report_sqlite = ghost_guard("report", "--audit-store", f"sqlite:{db}", "--namespace", lab_namespace, "-o", "json")
    report_kube = ghost_guard("report", "--audit-store", "kubernetes", "--kubeconfig", kc, "--namespace", lab_namespace, "-o", "json")
    assert json.loads(report_kube.stdout) == json.loads(report_sqlite.stdout)
    r = ghost_guard("audit", "export", "--from", "kubernetes", "--to", f"sqlite:{db}")
    assert r.returncode == 2 and "export copies --from sqlite:PATH --to kubernetes" in r.stderr
