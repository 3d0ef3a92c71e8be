"""The simulator's extender client against a real recording HTTP(S) server (no guard).

Checks the exact wire JSON in both modes (k8s.io/kube-scheduler/extender/v1/types.go:
Go field names as keys, no omitempty, so unset fields are ``null``), which
nodes the filter verb sees, how replies and errors steer the pod, and the preempt verb.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fixtures_lab import _report

from guard.tools import certs as guard_certs
from guard.lab.harness import eventually, node_manifest, pod_manifest
from guard.lab.scheduler import ExtenderConfig, PodStats, Scheduler, Timings, TLSConfig

FAST = Timings(pod_initial_backoff=0.05, pod_max_backoff=0.2, backoff_flush_period=0.02,
               pod_max_in_unschedulable=60.0, unschedulable_flush_period=5.0, request_timeout=5.0,
               retry_period=0.1, sync_timeout=10.0)
WAIT = 20.0


class Recorder:
    """An extender that records each request body and answers with ``reply(verb, body) -> (status, obj)``."""

    def __init__(self, reply, tls: ssl.SSLContext | None = None) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.peer_certs: list[dict] = []
        self.reply = reply
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                verb = self.path.rsplit("/", 1)[-1]
                recorder.calls.append((self.path, body))
                if tls is not None:
                    recorder.peer_certs.append(self.connection.getpeercert())
                status, obj = recorder.reply(verb, body)
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}/scheduler/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def bodies(self, verb: str) -> list[dict]:
        return [body for path, body in self.calls if path.endswith("/" + verb)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def pass_all(verb, body):
    """A correct, permissive extender: every node passes, every candidate allowed."""
    if verb == "filter":
        return 200, {"Nodes": body["Nodes"], "NodeNames": body["NodeNames"], "FailedNodes": {},
                     "FailedAndUnresolvableNodes": {}, "Error": ""}
    if body["NodeNameToMetaVictims"] is not None:
        return 200, {"NodeNameToMetaVictims": body["NodeNameToMetaVictims"]}
    return 200, {"NodeNameToMetaVictims": {
        node: {"Pods": [{"UID": p["metadata"]["uid"]} for p in v["Pods"]], "NumPDBViolations": 0}
        for node, v in body["NodeNameToVictims"].items()}}


@pytest.fixture(scope="module")
def module_lab_replicas():
    """``module_lab`` with one replica: the simulator reads and writes through replica 0 only
    (``lab.kubeconfig(0)``)."""
    return 1


@pytest.fixture
def lab(module_lab, request):
    """The module's lab, emptied after each test of what the tests create (Nodes, Pods in ``default``) and
    synced, so that each test's scheduler starts on its own objects only."""
    lab = module_lab
    yield lab
    _report(lab, request)
    api = lab.core_v1(0)
    for pod in api.list_namespaced_pod("default", _request_timeout=5).items:
        api.delete_namespaced_pod(pod.metadata.name, "default", grace_period_seconds=0, _request_timeout=5)
    for node in api.list_node(_request_timeout=5).items:
        api.delete_node(node.metadata.name, _request_timeout=5)
    eventually(lambda: not api.list_namespaced_pod("default", _request_timeout=5).items
               and not api.list_node(_request_timeout=5).items, 10, what="the lab emptied for the next test")
    assert lab.wait_synced()


@pytest.fixture
def harness(lab):
    """(start_extender(reply, tls=None), start_scheduler(extender_kwargs)) with cleanup."""
    recorders, schedulers = [], []

    def extender(reply, tls=None):
        r = Recorder(reply, tls)
        recorders.append(r)
        return r

    def scheduler(rec, **ext):
        config = ExtenderConfig(url_prefix=rec.url, **{"filter_verb": "filter", **ext})
        # The informer's first LIST (resourceVersion=0) is served by the watch cache: let it catch up
        # with the nodes the test just created, or the first attempt may see no node at all.
        assert lab.wait_synced()
        s = Scheduler(lab.kubeconfig(0), extenders=[config], timings=FAST)
        s.start()
        schedulers.append(s)
        return s

    yield extender, scheduler
    for s in schedulers:
        s.stop()
    for r in recorders:
        r.close()


def create(api, obj):
    if obj["kind"] == "Node":
        return json.loads(api.create_node(obj, _preload_content=False, _request_timeout=5).data)
    return json.loads(api.create_namespaced_pod("default", obj, _preload_content=False, _request_timeout=5).data)


def stat(s, key):
    return s.get(key, PodStats())


@pytest.mark.parametrize("node_cache_capable", [True, False], ids=["node-names", "node-list"])
def test_filter_sees_only_nodes_that_passed_built_in_filters(lab, harness, node_cache_capable):
    start_extender, start_scheduler = harness
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", labels={"disk": "ssd"}))
    create(api, node_manifest("node-b", labels={"disk": "ssd"}))
    create(api, node_manifest("node-c"))
    rec = start_extender(pass_all)
    sched = start_scheduler(rec, node_cache_capable=node_cache_capable)
    pod = create(api, pod_manifest("web", node_selector={"disk": "ssd"}))

    assert sched.wait_for(lambda s: stat(s, "default/web").bound_node in {"node-a", "node-b"}, WAIT)
    [(path, body)] = rec.calls
    assert path == "/scheduler/filter"  # urlPrefix's trailing slash trimmed, then "/" + verb
    assert set(body) == {"Pod", "Nodes", "NodeNames"}
    assert "apiVersion" not in body["Pod"] and "kind" not in body["Pod"]
    assert body["Pod"]["metadata"]["uid"] == pod["metadata"]["uid"]
    if node_cache_capable:
        assert body["Nodes"] is None
        assert body["NodeNames"] == ["node-a", "node-b"]
    else:
        assert body["NodeNames"] is None
        assert set(body["Nodes"]) == {"metadata", "items"}
        assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["node-a", "node-b"]
        assert all("apiVersion" not in n and "kind" not in n for n in body["Nodes"]["items"])
    assert stat(sched.stats(), "default/web").filter_calls == 1


def test_reply_in_the_wrong_mode_means_no_feasible_node(lab, harness):
    start_extender, start_scheduler = harness
    api = lab.core_v1(0)
    create(api, node_manifest("node-a"))
    rec = start_extender(lambda verb, body: (200, {"Nodes": {"items": []}, "NodeNames": None, "FailedNodes": {},
                                                   "FailedAndUnresolvableNodes": {}, "Error": ""}))
    sched = start_scheduler(rec, node_cache_capable=True)
    create(api, pod_manifest("web"))
    assert sched.wait_for(lambda s: stat(s, "default/web").unschedulable >= 1, WAIT)
    assert stat(sched.stats(), "default/web").bind_attempts == 0


def test_unresolvable_on_every_node_parks_the_pod_until_a_cluster_event(lab, harness):
    start_extender, start_scheduler = harness
    api = lab.core_v1(0)
    create(api, node_manifest("node-a"))
    create(api, node_manifest("node-b"))

    def reject(verb, body):
        return 200, {"Nodes": None, "NodeNames": [], "FailedNodes": {},
                     "FailedAndUnresolvableNodes": {n: "ghost-deleted" for n in body["NodeNames"]}, "Error": ""}

    rec = start_extender(reject)
    sched = start_scheduler(rec, node_cache_capable=True)
    create(api, pod_manifest("web"))
    assert sched.wait_for(lambda s: stat(s, "default/web").unschedulable >= 1, WAIT)
    assert sched.queue()["default/web"] == "unschedulable"
    web = stat(sched.stats(), "default/web")
    assert (web.filter_calls, web.bind_attempts, web.preempt_calls) == (1, 0, 0)
    assert web.last_message == ("0/2 nodes are available: 2 ghost-deleted. "
                                "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.")

    create(api, node_manifest("node-c"))  # a cluster event requeues it
    assert sched.wait_for(lambda s: len(rec.bodies("filter")) >= 2, WAIT)
    assert [b["NodeNames"] for b in rec.bodies("filter")[:2]] == [["node-a", "node-b"], ["node-a", "node-b", "node-c"]]
    assert stat(sched.stats(), "default/web").bind_attempts == 0


@pytest.mark.parametrize("failure", ["status-500", "error-field", "timeout"])
@pytest.mark.parametrize("ignorable", [False, True], ids=["required", "ignorable"])
def test_extender_failure_is_a_scheduling_error_unless_ignorable(lab, harness, failure, ignorable):
    start_extender, start_scheduler = harness
    api = lab.core_v1(0)
    create(api, node_manifest("node-a"))

    def broken(verb, body):
        if failure == "status-500":
            return 500, {"error": "boom"}
        if failure == "timeout":
            time.sleep(1.0)  # the behaviour: an extender that stalls past the scheduler's 0.2 s httpTimeout
            return pass_all(verb, body)
        return 200, {"Nodes": None, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {},
                     "Error": "cannot decide"}

    rec = start_extender(broken)
    sched = start_scheduler(rec, node_cache_capable=True, ignorable=ignorable, http_timeout=0.2)
    create(api, pod_manifest("web"))
    if ignorable:
        assert sched.wait_for(lambda s: stat(s, "default/web").bound_node == "node-a", WAIT)
        assert stat(sched.stats(), "default/web").scheduling_errors == 0
    else:
        assert sched.wait_for(lambda s: stat(s, "default/web").scheduling_errors >= 2, WAIT)
        web = stat(sched.stats(), "default/web")
        assert (web.bind_attempts, web.unschedulable) == (0, 0)
        if failure == "error-field":
            assert web.last_message == "cannot decide"


@pytest.mark.parametrize("node_cache_capable", [True, False], ids=["meta-victims", "full-victims"])
def test_preempt_verb_sees_candidates_and_its_veto_saves_the_victim(lab, harness, node_cache_capable):
    start_extender, start_scheduler = harness
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", cpu="2"))
    victim = create(api, pod_manifest("batch", cpu="1500m", priority=0, node_name="node-a"))

    def veto(verb, body):
        return (200, {"NodeNameToMetaVictims": {}}) if verb == "preempt" else pass_all(verb, body)

    rec = start_extender(veto)
    sched = start_scheduler(rec, node_cache_capable=node_cache_capable, preempt_verb="preempt")
    create(api, pod_manifest("urgent", cpu="1", priority=1000))

    assert sched.wait_for(lambda s: stat(s, "default/urgent").preempt_calls >= 1
                          and stat(s, "default/urgent").unschedulable >= 1, WAIT)
    urgent = stat(sched.stats(), "default/urgent")
    assert urgent.filter_calls == 0  # built-in NodeResourcesFit failed every node: the filter verb is skipped
    assert urgent.evictions == []
    assert urgent.last_message == ("0/1 nodes are available: 1 Insufficient cpu. "
                                   "preemption: no candidate node for preemption")
    body = rec.bodies("preempt")[0]
    assert set(body) == {"Pod", "NodeNameToVictims", "NodeNameToMetaVictims"}
    assert "apiVersion" not in body["Pod"] and "kind" not in body["Pod"]
    if node_cache_capable:
        assert body["NodeNameToVictims"] is None
        assert body["NodeNameToMetaVictims"] == {
            "node-a": {"Pods": [{"UID": victim["metadata"]["uid"]}], "NumPDBViolations": 0}}
    else:
        assert body["NodeNameToMetaVictims"] is None
        [pod] = body["NodeNameToVictims"]["node-a"]["Pods"]
        assert body["NodeNameToVictims"]["node-a"]["NumPDBViolations"] == 0
        assert pod["metadata"]["uid"] == victim["metadata"]["uid"]
        assert "apiVersion" not in pod and "kind" not in pod
    assert json.loads(api.read_namespaced_pod("batch", "default", _preload_content=False).data)["metadata"]["uid"] \
        == victim["metadata"]["uid"]


def test_preempt_verb_that_allows_lets_the_victim_go(lab, harness):
    start_extender, start_scheduler = harness
    api = lab.core_v1(0)
    create(api, node_manifest("node-a", cpu="2"))
    create(api, pod_manifest("batch", cpu="1500m", priority=0, node_name="node-a"))
    rec = start_extender(pass_all)
    sched = start_scheduler(rec, node_cache_capable=True, preempt_verb="preempt")
    create(api, pod_manifest("urgent", cpu="1", priority=1000))
    assert sched.wait_for(lambda s: stat(s, "default/urgent").bound_node == "node-a", WAIT)
    urgent = stat(sched.stats(), "default/urgent")
    assert urgent.evictions == ["default/batch"]
    assert urgent.preempt_calls == 1


def test_https_with_ca_and_client_certificate(lab, harness, tmp_path):
    start_extender, start_scheduler = harness
    bundle = guard_certs.generate(tmp_path / "certs")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(bundle.ca_cert))
    ctx.load_cert_chain(str(bundle.tls_cert), str(bundle.tls_key))
    ctx.verify_mode = ssl.CERT_REQUIRED
    api = lab.core_v1(0)
    create(api, node_manifest("node-a"))
    rec = start_extender(pass_all, tls=ctx)
    tls = TLSConfig(ca_file=str(bundle.ca_cert), cert_file=str(bundle.client_cert), key_file=str(bundle.client_key))
    sched = start_scheduler(rec, node_cache_capable=True, enable_https=True, tls_config=tls)
    create(api, pod_manifest("web"))
    assert sched.wait_for(lambda s: stat(s, "default/web").bound_node == "node-a", WAIT)
    assert rec.url.startswith("https://")
    subject = dict(item for rdn in rec.peer_certs[0]["subject"] for item in rdn)
    assert subject["commonName"] == guard_certs.CLIENT_COMMON_NAME


def test_extender_config_from_scheduler_configuration():
    config = ExtenderConfig.from_dict({
        "urlPrefix": "https://ghost-guard.ghost-guard.svc:8443", "filterVerb": "filter", "preemptVerb": "preempt",
        "enableHTTPS": True, "nodeCacheCapable": True, "ignorable": False, "httpTimeout": "500ms",
        "tlsConfig": {"caFile": "/etc/guard/ca.crt", "serverName": "ghost-guard.ghost-guard.svc"},
    })
    assert (config.filter_verb, config.preempt_verb, config.http_timeout) == ("filter", "preempt", 0.5)
    assert config.tls_config == TLSConfig(ca_file="/etc/guard/ca.crt", server_name="ghost-guard.ghost-guard.svc")
    with pytest.raises(ValueError, match="bindVerb is not supported"):
        ExtenderConfig.from_dict({"urlPrefix": "http://x", "bindVerb": "bind"})
    with pytest.raises(ValueError, match="unknown extender keys: filterverb"):
        ExtenderConfig.from_dict({"urlPrefix": "http://x", "filterverb": "filter"})
