"""Ghost Nodes on the Python lab (issue 27): a Node deleted in etcd whose DELETE one replica's watch
lost (``drop_deletes(resource="nodes")``, key ``/registry/minions/NAME``). The running guard watches
every replica's Node names, reads the name they disagree on once from etcd, and refuses that Node as
a candidate of a live pod (never the pod), in both /filter modes and in /preempt; the stale replica is
named in a metric and an Event. Nodes the replicas agree on cost no quorum read at all.

Real etcd, three real HTTPS apiserver replicas, a real `ghost-guard serve`.
"""

from __future__ import annotations

import json

import pytest
from clirun import ghost_guard, ghost_guard_beside_process, ghost_guard_process, interrupt
from fixtures_lab import mend

from guard.lab.harness import eventually, node_manifest, pod_manifest

pytestmark = pytest.mark.timeout(120)

FAST = ["--discovery-interval", "5", "--no-prepare"]
REASON = "ghost node: not in etcd (quorum read); a stale apiserver cache serves it"


def scheduler_pod(pod) -> dict:
    return {"metadata": {"name": pod.metadata.name, "namespace": pod.metadata.namespace, "uid": pod.metadata.uid},
            "spec": {"containers": [{"name": "app", "image": "pause"}]}, "status": {"phase": "Pending"}}


def node_reads(lab, name: str) -> int:
    return sum(len(r.requests(method="GET", path=f"/api/v1/nodes/{name}", quorum=True)) for r in lab.replicas)


def cached_nodes(lab, replica: int) -> set[str]:
    return {n.metadata.name for n in lab.core_v1(replica).list_node(resource_version="0", _request_timeout=5).items}


@pytest.fixture(scope="module")
def nodes_guard(module_lab, module_guard):
    """One guard (``FAST``) for the module's tests that need no other flag: they use distinct Node names and
    compare counters with their value at the test's start."""
    g = module_guard(["--kubeconfig", module_lab.kubeconfig(0), *FAST])
    replicas = [f"{r.ip}:{r.port}" for r in module_lab.replicas]
    eventually(lambda: all(g.metric("ghost_guard_node_watch_up", replica=r) == 1 for r in replicas),
               what="every replica's Nodes watched", process=g)
    return g


@pytest.fixture
def shared(mended_module_lab, nodes_guard):
    return mended_module_lab, nodes_guard


def test_a_ghost_node_is_refused_as_a_candidate_never_the_pod(shared):
    lab, g = shared
    api = lab.core_v1(0)
    for name in ("real-node", "ghost-node", "churn-node"):
        api.create_node(node_manifest(name), _request_timeout=5)
    replicas = [f"{r.ip}:{r.port}" for r in lab.replicas]
    eventually(lambda: all({"real-node", "ghost-node", "churn-node"} <= cached_nodes(lab, i) for i in range(3)),
               what="every replica's cache holds the Nodes")
    stale = replicas[1]
    counters = {(m, labels): g.metric(m, **dict(labels)) for m, labels in (
        ("ghost_guard_ghost_node_candidates_failed_total", (("verb", "filter"),)),
        ("ghost_guard_ghost_node_candidates_failed_total", (("verb", "preempt"),)),
        ("ghost_guard_ghost_node_detections_total", (("replica", stale),)))}

    def counted(metric: str, **labels: str) -> float:  # since the test began (the guard is the module's)
        return g.metric(metric, **labels) - counters[(metric, tuple(labels.items()))]

    # Nodes added and deleted normally (every replica sees it): no quorum read of any Node.
    api.delete_node("churn-node", _request_timeout=5)
    api.create_node(node_manifest("new-node"), _request_timeout=5)
    eventually(lambda: all("new-node" in cached_nodes(lab, i) and "churn-node" not in cached_nodes(lab, i)
                           for i in range(3)), what="every replica's cache current")

    # The incident, for a Node: replica 1's watch loses the DELETE of ghost-node.
    lab.replicas[1].faults.drop_deletes(name="ghost-node", resource="nodes")
    api.delete_node("ghost-node", _request_timeout=5)
    eventually(lambda: "ghost-node" not in cached_nodes(lab, 0) and "ghost-node" not in cached_nodes(lab, 2),
               what="the healthy replicas drop it")
    assert "ghost-node" in cached_nodes(lab, 1)  # the stale one still serves it

    eventually(lambda: g.metric("ghost_guard_ghost_nodes", replica=stale) == 1, what="the ghost Node attributed")
    assert g.metric("ghost_guard_ghost_nodes", replica=replicas[0]) == 0
    assert g.metric("ghost_guard_ghost_nodes", replica=replicas[2]) == 0
    assert node_reads(lab, "ghost-node") == 1  # one quorum read for the one name the replicas disagree on
    for name in ("real-node", "new-node", "churn-node"):
        assert node_reads(lab, name) == 0
    # /readyz names it, every replica's Nodes watched, nothing left undecided, the check running (one round a second)
    detail = eventually(lambda: (lambda d: d if d["ghost_nodes"] else None)(g.get("/readyz").json()["details"]["ghost_nodes"]),
                        what="the ghost Node in /readyz")
    assert detail["ghost_nodes"] == {"ghost-node": [stale]} and detail["disagreed"] == {}, detail
    assert detail["watched"] == dict.fromkeys(sorted(replicas), True) and 0 <= detail["last_round_seconds_ago"] < 30, detail

    pod = api.create_namespaced_pod("default", pod_manifest("web-1"), _request_timeout=5)
    names = ["real-node", "ghost-node", "new-node", "not-yet-seen"]
    r = g.post("/filter", {"Pod": scheduler_pod(pod), "Nodes": None, "NodeNames": names})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["NodeNames"] == ["real-node", "new-node", "not-yet-seen"]  # unknown names pass
    assert out["FailedAndUnresolvableNodes"] == {"ghost-node": REASON}
    assert out["FailedNodes"] == {} and out["Error"] == ""

    items = [{"metadata": {"name": n}, "status": {}} for n in names]
    out = g.post("/filter", {"Pod": scheduler_pod(pod), "Nodes": {"metadata": {}, "items": items},
                             "NodeNames": None}).json()
    assert [i["metadata"]["name"] for i in out["Nodes"]["items"]] == ["real-node", "new-node", "not-yet-seen"]
    assert out["FailedAndUnresolvableNodes"] == {"ghost-node": REASON}

    victims = {n: {"Pods": [{"UID": "victim"}], "NumPDBViolations": 0} for n in ("real-node", "ghost-node")}
    out = g.post("/preempt", {"Pod": scheduler_pod(pod), "NodeNameToVictims": None,
                              "NodeNameToMetaVictims": victims}).json()
    assert list(out["NodeNameToMetaVictims"]) == ["real-node"]
    assert counted("ghost_guard_ghost_node_candidates_failed_total", verb="filter") == 2
    assert counted("ghost_guard_ghost_node_candidates_failed_total", verb="preempt") == 1

    event = eventually(lambda: next((e for e in api.list_namespaced_event("default", _request_timeout=5).items
                                     if e.reason == "GhostNode" and e.involved_object.name == "ghost-node"), None),
                       what="the GhostNode Event")
    assert event.involved_object.kind == "Node" and stale in event.message
    assert counted("ghost_guard_ghost_node_detections_total", replica=stale) == 1

    # `report --live` names it too, from its own reads (no guard, no audit store needed). Each run looks for
    # 5 s: the table run is the real `python -m guard` process, run while the JSON run goes in-process.
    args = ["report", "--live", "--kubeconfig", lab.kubeconfig(0), "--db", "/nonexistent/none.db"]
    table, r = ghost_guard_beside_process(args, ["-o", "json"])
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["ghost_nodes"] == [{"node": "ghost-node", "replicas": [stale]}] and doc["ghost_node_errors"] == []
    assert table.returncode == 1, table.stdout + table.stderr
    assert "ghost-node" in table.stdout and stale in table.stdout

    # The Node is created again under that name: etcd has it, the guard never refuses it.
    api.create_node(node_manifest("ghost-node"), _request_timeout=5)
    eventually(lambda: g.metric("ghost_guard_ghost_nodes", replica=stale) == 0, what="the ghost withdrawn")
    out = g.post("/filter", {"Pod": scheduler_pod(pod), "Nodes": None, "NodeNames": names}).json()
    assert out["NodeNames"] == names and out["FailedAndUnresolvableNodes"] == {}
    r = ghost_guard("report", "--live", "--kubeconfig", lab.kubeconfig(0), "--db", "/nonexistent/none.db", "-o", "json")
    assert json.loads(r.stdout)["ghost_nodes"] == []


def test_heal_node_drops_the_ghost_node_from_the_stale_cache_without_a_restart(shared):
    lab, g = shared
    api = lab.core_v1(0)
    for name in ("healthy-node", "lost-node"):
        api.create_node(node_manifest(name), _request_timeout=5)
    real_uid = api.read_node("healthy-node", _request_timeout=5).metadata.uid
    eventually(lambda: all({"healthy-node", "lost-node"} <= cached_nodes(lab, i) for i in range(3)),
               what="every replica's cache holds the Nodes")
    stale = f"{lab.replicas[1].ip}:{lab.replicas[1].port}"
    lab.replicas[1].faults.drop_deletes(name="lost-node", resource="nodes", count=1)
    api.delete_node("lost-node", _request_timeout=5)
    eventually(lambda: g.metric("ghost_guard_ghost_nodes", replica=stale) == 1, what="the ghost Node attributed")

    r = ghost_guard("heal", "node/lost-node", "node/healthy-node", "--kubeconfig", lab.kubeconfig(0), "-o", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    nodes = {n["node"]: n for n in json.loads(r.stdout)["nodes"]}
    assert nodes["lost-node"]["outcome"] == "healed" and nodes["lost-node"]["serving_before"] == [stale]
    assert nodes["healthy-node"]["outcome"] == "etcd-has-it"  # a Node etcd has is never touched
    assert api.read_node("healthy-node", _request_timeout=5).metadata.uid == real_uid
    assert "lost-node" not in cached_nodes(lab, 1)  # the stale replica, no restart
    assert all("lost-node" not in cached_nodes(lab, i) for i in range(3))
    assert "lost-node" not in {n.metadata.name for n in api.list_node(_request_timeout=5).items}  # no placeholder left
    eventually(lambda: g.metric("ghost_guard_ghost_nodes", replica=stale) == 0, what="the guard sees it healed")

    r = ghost_guard("heal", "node/lost-node", "--kubeconfig", lab.kubeconfig(0))
    assert r.returncode == 0 and "consistent" in r.stdout, r.stdout + r.stderr
    r = ghost_guard("heal", "node/Bad_Name", "--kubeconfig", lab.kubeconfig(0))
    assert r.returncode == 2 and "node/NAME" in r.stderr


@pytest.mark.parametrize("fault", ["cut", "late"])
def test_a_node_placeholder_whose_create_got_no_answer_is_not_left_behind(shared, fault):
    """The placeholder's create reached etcd, its answer did not reach heal: broken mid-body ("cut"), or still
    held back when Ctrl-C comes ("late"). heal finds the Node under the name by its labels and deletes it."""
    lab, g = shared
    api = lab.core_v1(0)
    name = f"unanswered-{fault}"
    api.create_node(node_manifest(name), _request_timeout=5)
    eventually(lambda: all(name in cached_nodes(lab, i) for i in range(3)), what="every replica's cache holds the Node")
    lab.replicas[1].faults.drop_deletes(name=name, resource="nodes", count=1)
    api.delete_node(name, _request_timeout=5)
    eventually(lambda: name not in cached_nodes(lab, 0) and name in cached_nodes(lab, 1), what="a ghost on replica 1")
    rule = lab.replicas[0].faults.add(fault, method="POST", path="^/api/v1/nodes$", count=1,
                                      seconds=60 if fault == "late" else None)
    try:
        argv = ["heal", f"node/{name}", "--kubeconfig", lab.kubeconfig(0), "-o", "json"]
        if fault == "cut":
            r = ghost_guard(*argv)
            assert r.returncode == 1, r.stdout + r.stderr
            (res,) = json.loads(r.stdout)["nodes"]
            assert res["outcome"] == "failed" and "placeholder create" in res["detail"], res
        else:
            proc = ghost_guard_process(*argv)
            eventually(lambda: any(n.metadata.name == name for n in api.list_node(_request_timeout=5).items), 20,
                       what="the placeholder Node in etcd")
            assert rule.hits == 1  # its answer is held back: heal is still waiting for it
            interrupt(proc)
        assert name not in {n.metadata.name for n in api.list_node(_request_timeout=5).items}  # no placeholder left
    finally:
        lab.replicas[0].faults.remove(rule.id)
    # the placeholder's delete reached replica 1's cache too: the ghost is gone everywhere
    eventually(lambda: all(name not in cached_nodes(lab, i) for i in range(3)), what="no replica serves the Node")


def test_a_node_read_that_fails_passes_the_node(shared):
    """Fail open: while etcd cannot be read the replicas' disagreement condemns nothing."""
    lab, g = shared
    api = lab.core_v1(0)
    api.create_node(node_manifest("unread-node"), _request_timeout=5)
    replicas = [f"{r.ip}:{r.port}" for r in lab.replicas]
    eventually(lambda: all("unread-node" in cached_nodes(lab, i) for i in range(3)),
               what="every replica's cache holds the Node")
    errors = g.metric("ghost_guard_node_reads_total", outcome="error")
    pod = api.create_namespaced_pod("default", pod_manifest("web-2"), _request_timeout=5)
    # the quorum read (through replica 0, the kubeconfig's) fails
    lab.replicas[0].faults.add("status", method="GET", path="^/api/v1/nodes/unread-node$", status=500)
    lab.replicas[1].faults.drop_deletes(name="unread-node", resource="nodes")
    api.delete_node("unread-node", _request_timeout=5)
    eventually(lambda: "unread-node" not in cached_nodes(lab, 0), what="replica 0 drops it")
    eventually(lambda: g.metric("ghost_guard_node_reads_total", outcome="error") > errors, what="a failed read")
    out = g.post("/filter", {"Pod": scheduler_pod(pod), "Nodes": None, "NodeNames": ["unread-node"]}).json()
    assert out["NodeNames"] == ["unread-node"] and out["FailedAndUnresolvableNodes"] == {}
    assert g.metric("ghost_guard_ghost_nodes", replica=replicas[1]) == 0

    # The shared lab left consistent, with no ghost: the Node written again (replica 1 stores it over the stale
    # one), then deleted with every fault cleared.
    uid = api.create_node(node_manifest("unread-node"), _request_timeout=5).metadata.uid
    eventually(lambda: all(any(n.metadata.name == "unread-node" and n.metadata.uid == uid for n in
                               lab.core_v1(i).list_node(resource_version="0", _request_timeout=5).items)
                           for i in range(3)), what="every replica's cache holds the new Node")
    mend(lab)
    api.delete_node("unread-node", _request_timeout=5)
    eventually(lambda: all("unread-node" not in cached_nodes(lab, i) for i in range(3)), what="the Node gone")
