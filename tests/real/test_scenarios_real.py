"""The e2e scenarios on real Kubernetes (issue 24, item 3): real etcd, two real kube-apiserver replicas
(replica 1 reaches etcd through a fault proxy that drops chosen watch events, so its watch cache serves
ghosts exactly as in the incident), the real kube-controller-manager and, per test, the real
kube-scheduler with the product's KubeSchedulerConfiguration, with or without a real ``ghost-guard serve``
(HTTPS + mTLS) as its extender.

One control plane and one guard serve the whole module (starting them is most of the cost; the ghost-loop
test runs here too); each test works in its own namespace and on its own Nodes (a label per test, every pod selects it), stops its
scheduler, clears the replicas' faults and heals the ghosts it left, so the next test starts clean.
Nothing here sleeps: every wait polls the state it asserts about (guard metrics and logs, apiserver
reads, the real apiserver's ``apiserver_request_total``).

The guard is given the replicas (``--apiserver-replicas``): discovery from ``default/kubernetes`` would
find the advertise addresses (192.0.2.x), which a real apiserver must publish and nothing here can dial.
"""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from clirun import ghost_guard

from guard.tools import certs as guard_certs
from guard.lab.harness import (GuardProcess, create, eventually, free_port, make_ghost, metric_sum, node_manifest,
                               parse_metrics, pod_manifest, quorum_pod, tls_files)

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
STALE = 1  # the replica whose watch loses events; the scheduler reads it, as in the incident
WAIT = 60.0  # seconds for a state the real control plane reaches in a few (2 loaded cores, ~6 engineers)
LABEL = "ghost-guard-test"
HIGH, LOW = "ghost-guard-test-high", "ghost-guard-test-low"
BLOCKING = {"ghost-deleted", "ghost-replaced", "already-bound", "terminating"}
# The guard's background work fast enough for a test; the cache-health checks named after a few seconds.
GUARD_FLAGS = ["--sweep-interval", "0.5", "--stale-confirm-delay", "0.5", "--reprobe-interval", "0.5",
               "--missing-after", "2", "--frozen-after", "3", "--audit-write-interval", "0.5"]


# --- the module's control plane and guard -------------------------------------------------------------------


class World:
    """The module's control plane (``lab``), its guard (``guard``) and the guard's certificates."""

    lab: Any
    guard: GuardProcess
    certs: guard_certs.CertBundle
    port: int  # the guard's port, fixed before the apiservers start (their webhook kubeconfig names it)

    def replica(self, i: int) -> str:
        """Replica ``i`` as the guard names it (metrics, logs, heal's output)."""
        return f"{self.lab.replicas[i].ip}:{self.lab.port}"

    @property
    def replicas_flag(self) -> str:
        return ",".join(self.lab.urls)


def _admission_files(tmp: Path, bundle: guard_certs.CertBundle, port: int) -> Path:
    """The product's AdmissionConfiguration and webhook kubeconfig (manifests/webhook), with only the paths
    and the webhook's host:port put in: the apiserver presents ``apiserver.crt`` to the guard."""
    kubeconfig = yaml.safe_load((ROOT / "manifests/webhook/apiserver-webhook-kubeconfig.yaml").read_text())
    (user,) = kubeconfig["users"]
    user["name"] = f"127.0.0.1:{port}"  # the webhook URL's host:port (the shipped file names the Service)
    user["user"] = {"client-certificate": str(bundle.apiserver_cert), "client-key": str(bundle.apiserver_key)}
    (tmp / "webhook-kubeconfig.yaml").write_text(yaml.safe_dump(kubeconfig))
    admission = yaml.safe_load((ROOT / "manifests/webhook/apiserver-admission-config.yaml").read_text())
    (plugin,) = admission["plugins"]
    plugin["configuration"]["kubeConfigFile"] = str(tmp / "webhook-kubeconfig.yaml")
    (tmp / "admission-config.yaml").write_text(yaml.safe_dump(admission))
    return tmp / "admission-config.yaml"


def kubectl(world: World, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    binary = str(world.lab.binaries.kubectl or shutil.which("kubectl") or "kubectl")  # KUBEBUILDER_ASSETS', else PATH
    r = subprocess.run([binary, "--kubeconfig", world.lab.kubeconfig(0), *args], capture_output=True, text=True,
                       timeout=60)
    if check:
        assert r.returncode == 0, f"kubectl {' '.join(args)}: {r.stderr}"
    return r


@contextlib.contextmanager
def running_world(make_lab: Callable[..., Any], tmp: Path) -> Iterator[World]:
    """Start the module's control plane (``make_lab``: a RealLab factory) and guard; stop the guard after."""
    w = World()
    w.port = free_port()
    w.certs = guard_certs.generate(tmp / "certs")
    admission = _admission_files(tmp, w.certs, w.port)
    w.lab = make_lab(replicas=2, controller_manager=True, startup_timeout=180.0,
                     apiserver_args=["--admission-control-config-file", str(admission)])
    kubectl(w, "apply", "-f", str(ROOT / "manifests/crd/ghostpods.yaml"))
    kubectl(w, "wait", "--for=condition=Established", "--timeout=60s", "crd/ghostpods.kube-ghost-guard.io")
    from kubernetes import client

    sched = client.SchedulingV1Api(w.lab.api_client(0))
    from kubernetes.client.exceptions import ApiException

    for name, value in ((HIGH, 1000), (LOW, 0)):
        try:
            sched.create_priority_class({"metadata": {"name": name}, "value": value}, _request_timeout=10)
        except ApiException as e:
            if e.status != 409:  # a control plane shared with another module that made them
                raise
    w.guard = GuardProcess(["--kubeconfig", w.lab.kubeconfig(0), "--apiserver-replicas", w.replicas_flag,
                            "--audit-store", "kubernetes", *GUARD_FLAGS],
                           tls=tls_files(w.certs), port=w.port, logdir=tmp)
    try:
        w.guard.wait("/readyz", timeout=WAIT * 2)
        eventually(lambda: _watches_synced(w), WAIT, what="the guard's watches on both replicas", process=w.guard)
        yield w
    finally:
        w.guard.stop()


@pytest.fixture(scope="module")
def world(real_lab_module_factory, tmp_path_factory):
    with running_world(real_lab_module_factory, tmp_path_factory.mktemp("real-scenarios")) as w:
        yield w


def _watches_synced(w: World) -> bool:
    replicas = w.guard.get("/readyz", timeout=5).json()["details"]["replicas"]
    return len(replicas) == 2 and all(v["watch"] and v["watch"]["state"] == "synced" for v in replicas.values())


class Scenario:
    """What one test works with: the world, its namespace, its label (its Nodes and pods carry it)."""

    def __init__(self, world: World, ns: str) -> None:
        self.world = world
        self.lab = world.lab
        self.guard = world.guard
        self.ns = ns
        self.api = world.lab.core_v1(0)  # the test's own writes and quorum reads go through the healthy replica

    def node(self, name: str, **resources: str) -> str:
        """A Node only this test's pods select; schedulable (``harness.create`` takes off the not-ready taint
        the TaintNodesByCondition admission plugin adds: no kubelet will)."""
        name = f"{self.ns}-{name}"
        create(self.api, node_manifest(name, labels={LABEL: self.ns}, **resources))
        return name

    def manifest(self, name: str, *, priority_class: str | None = None, node_name: str = "",
                 **kw: Any) -> dict[str, Any]:
        """``pod_manifest`` for a real apiserver: deleted at once (no kubelet confirms a graceful deletion of a
        bound pod), on this test's Nodes only, a PriorityClass (the Priority admission plugin refuses a bare
        ``priority``)."""
        m = pod_manifest(name, namespace=self.ns, node_selector={LABEL: self.ns}, node_name=node_name,
                         priority_class=priority_class, **kw)
        m["spec"]["terminationGracePeriodSeconds"] = 0
        return m

    def pod(self, name: str, **kw: Any) -> dict[str, Any]:
        return create(self.api, self.manifest(name, **kw))

    def ghost(self, name: str, **kw: Any) -> str:
        """A ghost on replica STALE (harness.make_ghost): created, its deletion lost there, deleted. Its UID."""
        return make_ghost(self.lab, self.ns, name, stale=STALE, timeout=WAIT, node_selector={LABEL: self.ns}, **kw)

    def quorum(self, name: str) -> dict[str, Any] | None:
        return quorum_pod(self.api, name, self.ns)

    def cached_uid(self, name: str, replica: int = STALE) -> str | None:
        pod = self.lab.cached_pod(replica, self.ns, name)
        return pod["metadata"]["uid"] if pod else None

    def access(self, uid: str, path: str | None = None) -> list[dict[str, Any]]:
        """The guard's access-log lines about this pod UID (``path``: one endpoint only)."""
        return [e for e in self.guard.log_records() if e.get("uid") == uid and (path is None or e.get("path") == path)]

    def blocked(self, uid: str, path: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.access(uid, path) if e.get("verdict") in BLOCKING]

    def events(self, reason: str, uid: str) -> list[Any]:
        """The Events of this reason about this object UID (core/v1 shows the scheduler's events.k8s.io ones)."""
        return [e for e in self.api.list_namespaced_event(self.ns, _request_timeout=10).items
                if e.reason == reason and e.involved_object.uid == uid]

    def apiserver(self, name: str, replica: int = STALE, **labels: str) -> float:
        """A sum from the real apiserver's /metrics (e.g. ``apiserver_request_total``)."""
        return metric_sum(parse_metrics(self.lab.metrics(replica)), name, **labels)

    def binds(self, code: str, replica: int = STALE) -> float:
        return self.apiserver("apiserver_request_total", replica, verb="POST", resource="pods",
                              subresource="binding", code=code)

    def scheduler(self, *, guarded: bool, preempt: bool = True) -> None:
        """The real kube-scheduler on replica STALE (the product's configuration; the guard as its extender
        when ``guarded``; ``preempt=False``: registered without the preempt verb, filter only)."""
        self.lab.start_scheduler(self.guard.extender(preempt=preempt) if guarded else None, replica=STALE)

    def bound(self, name: str) -> str:
        """The node the pod is bound to (a quorum read), "" while pending or gone."""
        return ((self.quorum(name) or {}).get("spec") or {}).get("nodeName") or ""

    def heal(self, *args: str) -> tuple[int, dict[str, Any], str]:
        """``ghost-guard heal ARGS -o json`` (in-process, tests/clirun.py): (exit status, output, stderr)."""
        # --probe-timeout 10: a replica's read may take seconds on a loaded machine (2 cores, many engineers)
        r = ghost_guard("heal", "--kubeconfig", self.lab.kubeconfig(0), "--apiserver-replicas",
                        self.world.replicas_flag, "--probe-timeout", "10", "-o", "json", *args)
        try:
            doc = json.loads(r.stdout)
        except ValueError:
            doc = {}
        return r.returncode, doc, r.stderr

    def leftover_ghosts(self) -> list[str]:
        """``ns/name`` of the pods replica STALE serves under a UID etcd does not have."""
        out = []
        for pod in self.lab.core_v1(STALE).list_namespaced_pod(self.ns, resource_version="0",
                                                                 _request_timeout=10).items:
            live = self.quorum(pod.metadata.name)
            if live is None or live["metadata"]["uid"] != pod.metadata.uid:
                out.append(f"{self.ns}/{pod.metadata.name}")
        return out


@contextlib.contextmanager
def scenario(world: World, failed: Callable[[], bool] = lambda: False) -> Iterator[Scenario]:
    """A namespace of its own; after it: the scheduler stopped, faults cleared, the ghosts left healed."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    world.lab.ensure_namespace(ns)
    from kubernetes.client.exceptions import ApiException

    try:  # kube-controller-manager makes it too, a moment later; the ServiceAccount admission needs it now
        world.lab.core_v1(0).create_namespaced_service_account(ns, {"metadata": {"name": "default"}},
                                                                _request_timeout=10)
    except ApiException as e:
        if e.status != 409:
            raise
    test = Scenario(world, ns)
    try:
        yield test
    finally:
        world.lab.stop_scheduler()
        for r in world.lab.replicas:
            r.faults.clear()  # unfreezes too
        if failed():
            print(f"\n--- guard log ---\n{world.guard.logs()}\n--- control plane ---\n{world.lab.logs(40)}")
    assert world.lab.wait_synced(WAIT)
    leftover = test.leftover_ghosts()
    if leftover:  # heal them (a placeholder created and deleted under the name): the next test starts clean
        rc, doc, err = test.heal(*leftover)
        assert rc == 0, (doc, err)


@pytest.fixture
def t(world, request):
    def failed() -> bool:
        rep = getattr(request.node, "rep_call", None)
        return rep is not None and rep.failed

    with scenario(world, failed) as test:
        yield test


# --- the ghost loop -----------------------------------------------------------------------------------------


def test_the_guard_stops_the_real_scheduler_loop(t):
    """With the guard as extender (the product's configuration, HTTPS, mTLS): at most one binding 404 for the
    ghost while live pods still schedule; each new Node makes kube-scheduler try the ghost again, and the
    guard answer again. (The loop without the guard, binding 404s counted from the stale apiserver's
    ``apiserver_request_total``, is shown by the eviction test below and by the demo's test.)"""
    t.node("a")
    ghost = t.ghost("web-1")
    blocked_before = t.guard.metric("ghost_guard_ghosts_blocked_total")
    before = t.binds("404")
    t.scheduler(guarded=True)
    t.pod("live-after")
    eventually(lambda: t.bound("live-after"), WAIT, what="the live pod bound through the guard", process=t.guard)
    eventually(lambda: t.blocked(ghost, "/filter"), WAIT, what="the ghost blocked by the guard", process=t.guard)
    for k in range(2):  # rejected on every node, the ghost waits for a cluster event: a new Node is one
        seen = len(t.blocked(ghost, "/filter"))
        t.node(f"extra-{k}")
        eventually(lambda: len(t.blocked(ghost, "/filter")) > seen, WAIT,
                   what=f"the ghost tried again after extra-{k}", process=t.guard)
    assert t.binds("404") - before <= 1
    assert t.guard.metric("ghost_guard_ghosts_blocked_total") - blocked_before == 1


# --- preemption ---------------------------------------------------------------------------------------------


def test_a_ghost_that_fits_only_by_eviction_evicts_a_pod_without_the_guard_and_nobody_with_it(t):
    node = t.node("n", cpu="2")
    victim = t.pod("batch-1", cpu="1500m", priority_class=LOW, node_name=node)
    ghost = t.ghost("web-1", cpu="1", priority_class=HIGH)
    assert t.cached_uid("web-1") == ghost and t.quorum("web-1") is None

    # Without the guard: DefaultPreemption evicts the real pod for the ghost, then the ghost's binds 404.
    before = t.binds("404")
    t.scheduler(guarded=False)
    eventually(lambda: t.quorum("batch-1") is None, WAIT, what="the victim evicted for the ghost")
    eventually(lambda: t.binds("404") - before >= 2, WAIT, what="the ghost's binding 404 loop")
    eventually(lambda: t.events("Preempted", victim["metadata"]["uid"]), WAIT, what="the victim's Preempted Event")
    t.lab.stop_scheduler()

    # With the guard (filter + preempt verbs, the product's configuration): the preempt verb vetoes.
    victim = t.pod("batch-2", cpu="1500m", priority_class=LOW, node_name=node)
    before = t.binds("404")
    t.scheduler(guarded=True)
    eventually(lambda: t.blocked(ghost, "/preempt"), WAIT, what="the guard's veto of the ghost's preemption",
               process=t.guard)
    seen = len(t.access(ghost, "/preempt"))
    live = t.pod("live", cpu="100m", priority_class=LOW)
    eventually(lambda: (t.quorum("live") or {}).get("spec", {}).get("nodeName") == node, WAIT,
               what="a live pod bound")
    # A Node the ghost selects (too small for it) is an event its NodeAffinity rejection queues on: tried again.
    t.node("small", cpu="200m")
    eventually(lambda: len(t.access(ghost, "/preempt")) > seen, WAIT, what="the ghost's preemption tried again",
               process=t.guard)
    assert t.quorum("batch-2")["metadata"]["uid"] == victim["metadata"]["uid"]
    assert t.binds("404") == before  # the ghost never fits, so it never binds
    assert t.access(ghost, "/filter") == []  # NodeResourcesFit failed the node: only the preempt verb helps
    assert not [e for e in t.access(live["metadata"]["uid"]) if e.get("verdict") in BLOCKING]
    assert t.events("Preempted", victim["metadata"]["uid"]) == []


def test_a_filter_only_guard_lets_a_ghost_that_fits_only_by_eviction_evict_a_pod(t):
    """Why the product registers the preempt verb: with the filter verb alone, NodeResourcesFit rejects the
    node before the extender is asked, DefaultPreemption (which skips an extender without the preempt verb)
    evicts the real pod for the ghost, and only then is the ghost's filter call refused."""
    node = t.node("n", cpu="2")
    victim = t.pod("batch", cpu="1500m", priority_class=LOW, node_name=node)
    ghost = t.ghost("web-1", cpu="1", priority_class=HIGH)
    t.scheduler(guarded=True, preempt=False)
    eventually(lambda: t.quorum("batch") is None, WAIT, what="the victim evicted for the ghost")
    eventually(lambda: t.events("Preempted", victim["metadata"]["uid"]), WAIT, what="the victim's Preempted Event")
    eventually(lambda: t.blocked(ghost, "/filter"), WAIT, what="the ghost refused by the filter verb, too late",
               process=t.guard)
    assert t.access(ghost, "/preempt") == []  # never asked: no preempt verb


def test_a_live_high_priority_pod_still_preempts_with_the_guard(t):
    node = t.node("n", cpu="2")
    victim = t.pod("batch", cpu="1500m", priority_class=LOW, node_name=node)
    t.scheduler(guarded=True)
    urgent = t.pod("urgent", cpu="1", priority_class=HIGH)
    uid = urgent["metadata"]["uid"]
    eventually(lambda: t.quorum("batch") is None, WAIT, what="the low-priority pod evicted")
    eventually(lambda: (t.quorum("urgent") or {}).get("spec", {}).get("nodeName") == node, WAIT,
               what="the high-priority pod bound")
    preempts = eventually(lambda: t.access(uid, "/preempt"), WAIT, what="the guard's preempt call", process=t.guard)
    assert all(e["status"] == 200 and e.get("verdict") not in BLOCKING for e in preempts), preempts
    assert t.blocked(uid) == []
    eventually(lambda: t.events("Preempted", victim["metadata"]["uid"]), WAIT, what="the victim's Preempted Event")


def test_the_real_apiserver_refuses_a_pod_priority_that_no_priority_class_gives(t):
    """Why the scenarios name PriorityClasses: the Priority admission plugin computes ``spec.priority`` from
    ``priorityClassName`` and refuses a pod that sets another (the Python lab takes any ``priority``)."""
    from kubernetes.client.exceptions import ApiException

    with pytest.raises(ApiException) as refused:
        create(t.api, pod_manifest("bare", namespace=t.ns, priority=1000))
    assert refused.value.status == 403, refused.value
    assert "priority" in json.loads(refused.value.body)["message"]
    assert t.pod("named", priority_class=HIGH, priority=1000)["spec"]["priority"] == 1000


# --- the StatefulSet recreate race --------------------------------------------------------------------------


def statefulset(t: Scenario, name: str = "web") -> dict[str, Any]:
    template = {"metadata": {"labels": {"app": name}}, "spec": t.manifest("unused", cpu="100m")["spec"]}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "namespace": t.ns},
            "spec": {"replicas": 1, "serviceName": name, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": {"app": name}}, "template": template}}


def test_the_real_statefulset_controller_recreates_web_0_the_new_pod_schedules_and_the_old_uid_is_blocked(t):
    node = t.node("n")
    t.lab.apps_v1(0).create_namespaced_stateful_set(t.ns, statefulset(t), _request_timeout=10)
    old = eventually(lambda: (t.quorum("web-0") or {}).get("metadata", {}).get("uid"), WAIT,
                     what="kube-controller-manager's web-0")
    assert t.lab.wait_synced(WAIT) and t.cached_uid("web-0") == old
    # Replica STALE loses web-0's deletion and its re-creation (one each): it serves the old pod.
    faults = t.lab.replicas[STALE].faults
    faults.drop_deletes(namespace=t.ns, name="web-0", count=1)
    faults.drop_creates(namespace=t.ns, name="web-0", count=1)
    t.api.delete_namespaced_pod("web-0", t.ns, body={"preconditions": {"uid": old}}, _request_timeout=10)
    new = eventually(lambda: ((t.quorum("web-0") or {}).get("metadata", {}).get("uid") or old) != old
                     and t.quorum("web-0")["metadata"]["uid"], WAIT, what="web-0 recreated under a new UID")
    assert t.lab.wait_synced(WAIT)
    assert (t.cached_uid("web-0"), t.cached_uid("web-0", 0)) == (old, new)

    # kube-scheduler on the stale replica, the guard its extender: the old UID is blocked, and the scheduler's
    # own status patch of the blocked pod (by name) writes the new one, which reaches the stale cache and is
    # scheduled.
    before = {code: t.binds(code) for code in ("201", "404", "409")}
    t.scheduler(guarded=True)
    eventually(lambda: (t.quorum("web-0") or {}).get("spec", {}).get("nodeName") == node, WAIT,
               what="the new web-0 bound", process=t.guard)
    assert t.quorum("web-0")["metadata"]["uid"] == new
    blocked = t.blocked(old)
    assert blocked and {e["verdict"] for e in blocked} == {"ghost-replaced"}, t.access(old)
    assert t.blocked(new) == [], t.access(new)  # never a live pod
    assert t.binds("201") - before["201"] == 1  # the new pod, once
    assert (t.binds("404"), t.binds("409")) == (before["404"], before["409"])  # the old one never bound
    assert t.cached_uid("web-0") == new
    # The guard named the replica that served the old pod, and no other.
    stale, healthy = t.world.replica(STALE), t.world.replica(0)
    eventually(lambda: t.guard.metric("ghost_guard_stale_replica_detections_total", replica=stale) >= 1, WAIT,
               what="the stale replica named", process=t.guard)
    assert t.guard.metric("ghost_guard_stale_replica_detections_total", replica=healthy) == 0


# --- heal ---------------------------------------------------------------------------------------------------


def start_time(t: Scenario, replica: int) -> float:
    return t.apiserver("process_start_time_seconds", replica)


def test_heal_of_a_deleted_ghost_drops_it_from_the_stale_cache_without_a_restart(t):
    ghost = t.ghost("web-0")
    t.lab.replicas[STALE].faults.clear()  # one lost delete; the watch flows on
    started = start_time(t, STALE)
    assert t.cached_uid("web-0") == ghost
    rc, doc, err = t.heal(f"{t.ns}/web-0")
    assert rc == 0, (doc, err)
    (res,) = doc["results"]
    assert (res["action"], res["outcome"], res["writes"], res["ghostUIDs"]) == ("placeholder", "healed", 2, [ghost])
    assert all(r["agrees"] for r in res["replicas"]) and len(res["replicas"]) == 2
    assert t.cached_uid("web-0") is None and t.quorum("web-0") is None  # no placeholder left either
    assert start_time(t, STALE) == started  # nothing restarted


def test_heal_of_a_replaced_ghost_drops_it_from_the_stale_cache_without_a_restart(t):
    node = t.node("n")
    ghost = t.pod("web-0")["metadata"]["uid"]
    assert t.lab.wait_synced(WAIT)
    faults = t.lab.replicas[STALE].faults
    faults.drop_deletes(namespace=t.ns, name="web-0", count=1)
    faults.drop_creates(namespace=t.ns, name="web-0", count=1)
    t.api.delete_namespaced_pod("web-0", t.ns, _request_timeout=10)
    live = t.pod("web-0", node_name=node)["metadata"]["uid"]  # re-created bound (nothing writes it again)
    assert t.lab.wait_synced(WAIT)
    faults.clear()
    assert (t.cached_uid("web-0"), t.cached_uid("web-0", 0)) == (ghost, live)
    started = start_time(t, STALE)
    rc, doc, err = t.heal(f"{t.ns}/web-0")
    assert rc == 0, (doc, err)
    (res,) = doc["results"]
    assert (res["action"], res["outcome"], res["writes"], res["ghostUIDs"]) == ("annotate", "healed", 1, [ghost])
    assert t.cached_uid("web-0") == live
    assert t.quorum("web-0")["metadata"]["uid"] == live
    assert start_time(t, STALE) == started


def test_heal_names_a_frozen_replica_to_restart(t):
    ghost = t.ghost("web-0")
    faults = t.lab.replicas[STALE].faults
    faults.clear()
    faults.freeze_watch()
    rc, doc, err = t.heal("--timeout", "5", f"{t.ns}/web-0")
    assert rc == 1, (doc, err)
    (res,) = doc["results"]
    stale = t.world.replica(STALE)
    assert (res["action"], res["outcome"]) == ("placeholder", "frozen"), res
    assert [r["replica"] for r in res["replicas"] if r["frozen"]] == [stale], res
    assert res["advice"].startswith(f"restart apiserver replica {stale} only"), res
    assert t.quorum("web-0") is None
    assert t.cached_uid("web-0") == ghost
    faults.unfreeze_watch()
    # the placeholder's delete did happen: once the watch flows, the replica catches up on both writes
    eventually(lambda: t.cached_uid("web-0") is None, WAIT, what="the thawed replica caught up")


# --- the admission webhook, called by a real apiserver ------------------------------------------------------


def binding(name: str, uid: str, node: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


def bind(t: Scenario, name: str, uid: str, node: str, *, dry_run: bool = False,
         replica: int = STALE) -> tuple[int, str]:
    """POST pods/binding through replica ``replica`` (as kube-scheduler on it would): (status, message)."""
    from kubernetes.client.exceptions import ApiException

    try:
        resp = t.lab.core_v1(replica).create_namespaced_pod_binding(
            name, t.ns, binding(name, uid, node), dry_run="All" if dry_run else None, _preload_content=False,
            _request_timeout=10)
        return resp.status, ""
    except ApiException as e:
        try:
            return e.status, json.loads(e.body).get("message", "")
        except (TypeError, ValueError):
            return e.status, str(e.body)


def webhook_configuration(world: World) -> dict[str, Any]:
    """The product's ValidatingWebhookConfiguration, pointed at this guard by URL (no Service routing here)."""
    vwc = yaml.safe_load((ROOT / "manifests/webhook/validatingwebhookconfiguration.yaml").read_text())
    vwc = copy.deepcopy(vwc)
    vwc["metadata"]["name"] = f"ghost-guard-{uuid.uuid4().hex[:6]}"
    (hook,) = vwc["webhooks"]
    hook["clientConfig"] = {"url": f"https://127.0.0.1:{world.port}/validate/binding",
                            "caBundle": world.certs.ca_bundle}
    return vwc


def test_the_webhook_called_by_a_real_apiserver_over_mtls_refuses_a_ghosts_binding_and_allows_a_live_one(t):
    from kubernetes import client

    node = t.node("n")
    ghost = t.ghost("web-0")
    live = t.pod("live")
    live_uid = live["metadata"]["uid"]
    # Without the webhook the ghost's binding reaches the storage: 404 (dry run: nothing written).
    assert bind(t, "web-0", ghost, node, dry_run=True)[0] == 404

    admission = client.AdmissionregistrationV1Api(t.lab.api_client(0))
    vwc = admission.create_validating_webhook_configuration(webhook_configuration(t.world), _request_timeout=10)
    try:
        # Each apiserver picks the configuration up from its own informer: wait on a dry-run bind through each.
        for replica in (0, STALE):
            eventually(lambda: bind(t, "web-0", ghost, node, dry_run=True, replica=replica)[0] != 404, WAIT,
                       what=f"the webhook active on replica {replica}", process=t.guard)
        before = t.binds("404")
        status, message = bind(t, "web-0", ghost, node)
        assert status == 403, (status, message)
        assert "ghost" in message and ghost in message, message
        assert t.binds("404") == before  # refused at admission: the storage never saw it
        assert bind(t, "live", live_uid, node) == (201, "")
        assert t.quorum("live")["spec"]["nodeName"] == node
    finally:
        admission.delete_validating_webhook_configuration(vwc.metadata.name, _request_timeout=10)
    # Over mTLS with the apiserver's client certificate: the guard answers that role only on this route.
    calls = t.access(ghost, "/validate/binding")
    assert calls and all(e["status"] == 200 for e in calls), calls
    assert {e["verdict"] for e in calls if e.get("verdict")} <= BLOCKING
    assert [e.get("verdict") for e in t.access(live_uid, "/validate/binding")] and not t.blocked(live_uid)
    assert t.guard.metric("ghost_guard_requests_forbidden_total") == 0


# --- the GhostPod store -------------------------------------------------------------------------------------


def test_a_blocked_ghost_is_recorded_as_a_ghostpod_that_kubectl_shows(t):
    t.node("n")
    ghost = t.ghost("web-1")
    before = t.binds("404")
    t.scheduler(guarded=True)

    def recorded() -> list[dict[str, Any]]:
        r = kubectl(t.world, "get", "ghostpods", "-n", t.ns, "-o", "json")
        return [i for i in json.loads(r.stdout)["items"] if i["spec"].get("podUID") == ghost]

    (obj,) = eventually(recorded, WAIT, what="the GhostPod of the blocked ghost", process=t.guard)
    assert obj["spec"]["podName"] == "web-1", obj
    assert obj["spec"]["verdict"] in BLOCKING, obj
    # The real apiserver answers kubectl's Table request with the CRD's printer columns (the Python lab serves
    # no Table: NAME and AGE only).
    header, *rows = kubectl(t.world, "get", "ghostpods", "-n", t.ns).stdout.splitlines()
    assert header.split()[:3] == ["NAME", "POD", "VERDICT"], header
    assert [r.split()[:3] for r in rows] == [[obj["metadata"]["name"], "web-1", obj["spec"]["verdict"]]], rows
    assert t.binds("404") - before <= 1  # the loop stopped: at most one binding 404 for the ghost


# --- cache health: a missing pod, a frozen replica ----------------------------------------------------------


def test_a_pod_whose_creation_the_stale_replica_lost_is_reported_missing_there(t):
    stale, healthy = t.world.replica(STALE), t.world.replica(0)
    t.lab.replicas[STALE].faults.drop_creates(namespace=t.ns, name="lost")
    detections = t.guard.metric("ghost_guard_replica_pods_missing_detections_total", replica=stale)
    uid = t.pod("lost")["metadata"]["uid"]
    assert t.lab.wait_synced(WAIT)
    assert (t.cached_uid("lost"), t.cached_uid("lost", 0)) == (None, uid)
    eventually(lambda: t.guard.metric("ghost_guard_replica_pods_missing", replica=stale) >= 1, WAIT,
               what="the missing-pod gauge", process=t.guard)
    assert t.guard.metric("ghost_guard_replica_pods_missing_detections_total", replica=stale) == detections + 1
    assert t.guard.metric("ghost_guard_replica_pods_missing", replica=healthy) == 0

    (ev,) = eventually(lambda: t.events("PodMissingFromReplica", uid), WAIT, what="the PodMissingFromReplica Event")
    assert stale in ev.message, ev.message
    # Written again (any write), the pod reaches the replica: no longer missing.
    t.lab.replicas[STALE].faults.clear()
    t.api.patch_namespaced_pod("lost", t.ns, {"metadata": {"labels": {"touched": "yes"}}}, _request_timeout=10)
    eventually(lambda: t.cached_uid("lost") == uid, WAIT, what="the pod in the stale cache")
    eventually(lambda: t.guard.metric("ghost_guard_replica_pods_missing", replica=stale) == 0, WAIT,
               what="the missing-pod gauge cleared", process=t.guard)


def test_a_frozen_replica_is_named_and_cleared_once_it_thaws(t):
    frozen, healthy = t.world.replica(STALE), t.world.replica(0)
    t.lab.replicas[STALE].faults.freeze_watch()
    t.pod("after-the-freeze")  # etcd's revision moves on; the frozen cache's does not
    eventually(lambda: t.guard.metric("ghost_guard_replica_frozen", replica=frozen) == 1, WAIT,
               what="the frozen gauge", process=t.guard)
    assert t.guard.metric("ghost_guard_replica_frozen", replica=healthy) == 0
    assert any("watch is frozen" in (r.get("msg") or "") and frozen in (r.get("msg") or "")
               for r in t.guard.log_records()), t.guard.logs()
    t.lab.replicas[STALE].faults.unfreeze_watch()
    eventually(lambda: t.guard.metric("ghost_guard_replica_frozen", replica=frozen) == 0, WAIT,
               what="the frozen gauge cleared", process=t.guard)
