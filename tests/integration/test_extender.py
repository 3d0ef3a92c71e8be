"""The extender over real HTTP: a real ``ghost-guard serve`` process, quorum GETs through the
official client to a lab apiserver replica on a real etcd.

Pods are sent as kube-scheduler sends them: no apiVersion/kind. GET counts come from the
lab's request log, never from the guard.
"""

from __future__ import annotations

import concurrent.futures
import time

import orjson
import pytest
import requests
from payloads import binding_review, filter_body, scheduler_pod

from guard.lab.harness import eventually, make_ghost, pod_manifest


FILTER_KEYS = ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]
NAMES = ["node-a", "node-b", "node-c"]
NODE_LIST = {"metadata": {"resourceVersion": "1"}, "items": [{"metadata": {"name": n}, "status": {}} for n in NAMES]}


def filter_of(namespace: str, name: str, uid: str, mode: str) -> dict:
    """/filter in either mode: node names (nodeCacheCapable) or the full node list."""
    return filter_body(namespace, name, uid, NAMES, node_list=None if mode == "names" else NODE_LIST)


def preempt_body(pod: dict, mode: str) -> dict:
    victim = {"metadata": {"name": "low", "namespace": "default", "uid": "victim-uid"}}
    if mode == "meta":
        return {"Pod": pod, "NodeNameToVictims": None,
                "NodeNameToMetaVictims": {"node-a": {"Pods": [{"UID": "victim-uid"}], "NumPDBViolations": 0}}}
    return {"Pod": pod, "NodeNameToVictims": {"node-a": {"Pods": [victim], "NumPDBViolations": 0}},
            "NodeNameToMetaVictims": None}


def quorum_gets(lab, namespace: str, name: str, replica: int = 0, since: float | None = None) -> int:
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"
    return len(lab.replicas[replica].requests(method="GET", path=path, quorum=True, since=since))


@pytest.fixture(scope="module")
def guard(_shared_lab_session, module_guard, tmp_path_factory):
    """One guard for the module, reading the shared lab through replica 0 (no pre-verification,
    so every GET counted here is the scheduling path's)."""
    db = str(tmp_path_factory.mktemp("extender") / "audit.db")
    return module_guard(["--kubeconfig", _shared_lab_session.kubeconfig(0), "--audit-db", db, "--no-prepare",
                         "--no-events"])


def make_pod(lab, ns: str, name: str, **kw) -> str:
    return lab.core_v1(0).create_namespaced_pod(ns, pod_manifest(name, **kw), _request_timeout=5).metadata.uid


# --- every verdict, both modes ------------------------------------------------------------


def _case(lab, ns: str, verdict: str) -> tuple[str, str]:
    """Make the lab state for a verdict; return (name, the scheduler's UID)."""
    api = lab.core_v1(0)
    if verdict == "alive":
        return "p", make_pod(lab, ns, "p")
    if verdict == "ghost-deleted":
        return "p", make_ghost(lab, ns, "p")
    if verdict == "ghost-replaced":
        old = make_pod(lab, ns, "p")
        api.delete_namespaced_pod("p", ns, grace_period_seconds=0, _request_timeout=5)
        make_pod(lab, ns, "p")
        return "p", old
    if verdict == "already-bound":
        return "p", make_pod(lab, ns, "p", node_name="node-x")
    if verdict == "terminating":
        uid = make_pod(lab, ns, "p", finalizers=["example.com/hold"])
        api.delete_namespaced_pod("p", ns, _request_timeout=5)
        return "p", uid
    raise AssertionError(verdict)


REASONS = {
    "ghost-deleted": "ghost pod: {ns}/p uid {uid} not found by quorum read (etcd); scheduler cache is stale",
    "ghost-replaced": "ghost pod: {ns}/p uid {uid} was replaced by uid ",
    "already-bound": "ghost pod: {ns}/p uid {uid} is already bound to node node-x (quorum read, etcd); "
                     "scheduler cache is stale",
    "terminating": "ghost pod: {ns}/p uid {uid} is terminating since ",
}
VERDICTS = ["alive", "ghost-deleted", "ghost-replaced", "already-bound", "terminating"]


@pytest.mark.parametrize("mode", ["names", "nodes"])
@pytest.mark.parametrize("verdict", VERDICTS)
def test_filter_every_verdict_in_both_modes(guard, shared_lab, lab_namespace, verdict, mode):
    name, uid = _case(shared_lab, lab_namespace, verdict)
    r = guard.post("/filter", filter_of(lab_namespace, name, uid, mode))
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "application/json"
    out = r.json()
    assert list(out) == FILTER_KEYS
    assert out["Error"] == "" and out["FailedNodes"] == {}
    if verdict == "alive":
        assert out["FailedAndUnresolvableNodes"] == {}
        if mode == "names":
            assert out["NodeNames"] == NAMES and out["Nodes"] is None
        else:
            assert out["Nodes"] == NODE_LIST and out["NodeNames"] is None
        return
    assert sorted(out["FailedAndUnresolvableNodes"]) == NAMES
    reasons = set(out["FailedAndUnresolvableNodes"].values())
    assert len(reasons) == 1
    # one short reason per node (a reply grows by it per node); the pod and the whole reason once, in the log
    assert reasons.pop() == f"ghost pod: {verdict} (see kube-ghost-guard log/record)"
    expected = REASONS[verdict].format(ns=lab_namespace, uid=uid)
    eventually(lambda: any(str(r.get("msg", "")).startswith(expected) for r in guard.log_records()), 5,
               what="the whole reason in the guard's log")
    if mode == "names":
        assert out["NodeNames"] == [] and out["Nodes"] is None
    else:
        assert out["Nodes"]["items"] == [] and out["NodeNames"] is None


@pytest.mark.parametrize("mode", ["meta", "full"])
@pytest.mark.parametrize("verdict", VERDICTS)
def test_preempt_vetoes_ghosts_and_echoes_candidates_otherwise(guard, shared_lab, lab_namespace, verdict, mode):
    name, uid = _case(shared_lab, lab_namespace, verdict)
    r = guard.post("/preempt", preempt_body(scheduler_pod(lab_namespace, name, uid), mode))
    assert r.status_code == 200, r.text
    if verdict == "alive":
        assert r.json() == {"NodeNameToMetaVictims": {"node-a": {"Pods": [{"UID": "victim-uid"}], "NumPDBViolations": 0}}}
    else:
        assert r.json() == {"NodeNameToMetaVictims": {}}


def test_admission_denies_a_ghost_binding_and_allows_a_live_one(guard, shared_lab, lab_namespace):
    ghost_uid = make_ghost(shared_lab, lab_namespace, "gone")
    live_uid = make_pod(shared_lab, lab_namespace, "live")

    def review(name: str, uid: str) -> dict:
        return binding_review(lab_namespace, name, uid, node="node-a", review_uid=f"rev-{name}")

    denied = guard.post("/validate/binding", review("gone", ghost_uid)).json()["response"]
    assert denied["uid"] == "rev-gone" and denied["allowed"] is False
    assert denied["status"]["code"] == 403
    assert denied["status"]["message"] == (f"ghost pod: {lab_namespace}/gone uid {ghost_uid} not found by quorum "
                                           f"read (etcd); scheduler cache is stale")
    allowed = guard.post("/validate/binding", review("live", live_uid)).json()["response"]
    assert allowed == {"uid": "rev-live", "allowed": True}


# --- caching and single flight ----------------------------------------------------------------


def test_single_flight_50_concurrent_calls_make_one_get(guard, shared_lab, lab_namespace):
    uid = make_pod(shared_lab, lab_namespace, "burst")
    body = orjson.dumps(filter_of(lab_namespace, "burst", uid, "names"))

    def call(_):
        with requests.Session() as s:
            return s.post(guard.url("/filter"), data=body, headers={"Content-Type": "application/json"}, timeout=10)

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        replies = list(pool.map(call, range(50)))
    assert [r.status_code for r in replies] == [200] * 50
    assert all(r.json()["NodeNames"] == NAMES for r in replies)
    assert quorum_gets(shared_lab, lab_namespace, "burst") == 1


def test_a_ghost_costs_no_get_on_retry(guard, shared_lab, lab_namespace):
    uid = make_ghost(shared_lab, lab_namespace, "loop")
    body = filter_of(lab_namespace, "loop", uid, "names")
    read = time.monotonic()
    assert guard.post("/filter", body).json()["FailedAndUnresolvableNodes"]
    # The verdict's GET, and the incident follow-up's (etcd asked again before any replica is named).
    eventually(lambda: quorum_gets(shared_lab, lab_namespace, "loop") == 2, 10, what="the follow-up's quorum GET")
    time.sleep(max(0.0, 0.7 - (time.monotonic() - read)))  # the behaviour: past the 0.5 s read cache, only the
    # ghost cache can answer now (a TTL running out is the subject: no state to wait on)
    for _ in range(5):
        assert guard.post("/filter", body).json()["FailedAndUnresolvableNodes"]
    assert quorum_gets(shared_lab, lab_namespace, "loop") == 2


def test_a_live_pod_back_on_a_later_attempt_is_read_again(guard, shared_lab, lab_namespace):
    """Coming back after the scheduler's backoff means its bind may have failed: verify again."""
    uid = make_pod(shared_lab, lab_namespace, "again")
    body = filter_of(lab_namespace, "again", uid, "names")
    assert guard.post("/filter", body).json()["NodeNames"] == NAMES
    assert guard.post("/filter", body).json()["NodeNames"] == NAMES  # same burst: cached
    assert quorum_gets(shared_lab, lab_namespace, "again") == 1
    time.sleep(0.7)  # the behaviour: a later attempt, past the 0.5 s read cache (a TTL running out is the subject)
    assert guard.post("/filter", body).json()["NodeNames"] == NAMES
    assert quorum_gets(shared_lab, lab_namespace, "again") == 2


# --- fail open / closed -------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [
    pytest.param({"action": "status", "status": 500}, id="apiserver-500"),
    pytest.param({"action": "status", "status": 429}, id="apiserver-429"),
    pytest.param({"action": "latency", "seconds": 3}, id="apiserver-slower-than-get-timeout"),
])
def test_apiserver_trouble_fails_open_and_is_counted(guard, shared_lab, lab_namespace, fault):
    uid = make_ghost(shared_lab, lab_namespace, "x")  # a real ghost: fail open means it passes
    before = guard.metric("ghost_guard_fail_open_total", reason="apiserver")
    shared_lab.replicas[0].faults.add(method="GET", path=rf"^/api/v1/namespaces/{lab_namespace}/pods/x$", **fault)
    out = guard.post("/filter", filter_of(lab_namespace, "x", uid, "names")).json()
    assert out == {"Nodes": None, "NodeNames": NAMES, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""}
    pre = guard.post("/preempt", preempt_body(scheduler_pod(lab_namespace, "x", uid), "meta")).json()
    assert pre["NodeNameToMetaVictims"] != {}
    assert guard.metric("ghost_guard_fail_open_total", reason="apiserver") >= before + 1
    assert "failing open" in guard.logs(tail=None)


def test_fail_closed_rejects_when_undecided(start_guard, shared_lab, lab_namespace, tmp_path):
    g = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--fail-closed", "--no-prepare", "--no-events",
                     "--audit-db", str(tmp_path / "a.db")])
    uid = make_pod(shared_lab, lab_namespace, "y")
    shared_lab.replicas[0].faults.add("status", method="GET", path=rf"^/api/v1/namespaces/{lab_namespace}/pods/y$",
                                      status=503)
    out = g.post("/filter", filter_of(lab_namespace, "y", uid, "names")).json()
    assert sorted(out["FailedAndUnresolvableNodes"]) == NAMES
    assert next(iter(out["FailedAndUnresolvableNodes"].values())) == "unknown: failing closed (see kube-ghost-guard log)"
    whole = f"quorum read of pod {lab_namespace}/y uid {uid} failed: HTTP 503 ServiceUnavailable; failing closed"
    eventually(lambda: any(r.get("msg") == whole for r in g.log_records()), 5, what="the reason in the log")
    assert g.metric("ghost_guard_fail_closed_total", reason="apiserver") == 1


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("method,path,body,ctype,status,reason", [
    pytest.param("POST", "/filter", b"{", "application/json", 400, "request body is not valid JSON", id="truncated"),
    pytest.param("POST", "/filter", b'{"Nodes":null,"NodeNames":[]}', "application/json", 400,
                 "missing Pod: expected a v1.Pod object, got None", id="missing-pod"),
    pytest.param("POST", "/filter", b'{"Pod":{"spec":{}},"NodeNames":[]}', "application/json", 400,
                 "Pod.metadata is missing or not an object", id="missing-metadata"),
    pytest.param("POST", "/filter", b'{"Pod":{"metadata":{"name":"a"}},"Nodes":{"items":[]},"NodeNames":[]}',
                 "application/json", 400, "both Nodes and NodeNames are set", id="both-modes"),
    pytest.param("POST", "/filter", b'{"Pod":{"metadata":{"name":"a"}},"Nodes":null,"NodeNames":null}',
                 "application/json", 400, "neither Nodes nor NodeNames is set", id="neither-mode"),
    pytest.param("POST", "/filter", b"{}", "text/plain", 415, "Content-Type must be application/json", id="content-type"),
    pytest.param("GET", "/filter", None, None, 405, "The method is not allowed", id="method"),
    pytest.param("POST", "/preempt", b"[]", "application/json", 400, "request body must be a JSON object", id="preempt-array"),
    pytest.param("POST", "/validate/binding", b'{"kind":"Pod"}', "application/json", 400, "expected apiVersion",
                 id="review-not-a-review"),
    pytest.param("POST", "/nowhere", b"{}", "application/json", 404, "no such endpoint: the path must be exactly one of", id="unknown-path"),
])
def test_bad_input_gets_a_4xx_with_a_reason(guard, method, path, body, ctype, status, reason):
    headers = {"Content-Type": ctype} if ctype else {}
    r = guard.session.request(method, guard.url(path), data=body, headers=headers, timeout=5)
    assert r.status_code == status
    assert r.headers["Content-Type"] == "application/json"
    assert r.json()["error"].startswith(reason)


def test_body_over_the_cap_is_413(start_guard, shared_lab, tmp_path):
    g = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--max-body-bytes", "1024", "--no-prepare",
                     "--audit-db", str(tmp_path / "a.db")])
    big = orjson.dumps({"Pod": scheduler_pod("d", "p", "u"), "Nodes": None, "NodeNames": ["n" * 50] * 100})
    r = g.post("/filter", big)
    assert r.status_code == 413
    assert "error" in r.json()


# --- probes and metrics -------------------------------------------------------------------------------


def test_probes_and_metrics(guard):
    assert guard.get("/healthz", timeout=5).json() == {"status": "ok"}
    ready = guard.get("/readyz", timeout=5).json()
    assert ready["status"] == "ready" and set(ready) == {"status", "details"}, ready
    assert ready["details"]["audit_store"]["writable"] is True
    text = guard.get("/metrics", timeout=5).text
    for name in ("ghost_guard_requests_total", "ghost_guard_request_duration_seconds_bucket",
                 "ghost_guard_verdicts_total", "ghost_guard_cache_lookups_total",
                 "ghost_guard_quorum_get_duration_seconds_bucket"):
        assert name in text
    assert 'le="0.0001"' in text  # sub-millisecond buckets


def test_readyz_is_503_when_the_apiserver_is_unreachable(start_guard, tmp_path):
    kc = tmp_path / "kc.yaml"
    kc.write_text("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'http://127.0.0.1:9'}\n"
                  "users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
                  "current-context: x\n")
    g = start_guard(["--kubeconfig", str(kc), "--no-prepare", "--audit-db", str(tmp_path / "a.db")], wait="/healthz")
    r = g.get("/readyz", timeout=5)
    assert r.status_code == 503
    assert r.json()["problems"] == ["apiserver unreachable: NewConnectionError"]
    # and a scheduling call still answers: fail open, with the cause named (a refusal is not a timeout)
    out = g.post("/filter", filter_of("d", "p", "u", "names")).json()
    assert out["NodeNames"] == NAMES
    assert "quorum read of pod d/p uid u failed: connection error: NewConnectionError; failing open" in g.logs(tail=None)


def test_startup_errors_exit_2_with_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "guard", "serve", "--insecure-http", "--bind", "0.0.0.0:1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.strip() == ("ghost-guard serve: --insecure-http serves plain HTTP and is for a loopback sidecar "
                                "only; bind 127.0.0.1 (got 0.0.0.0)")
    r = subprocess.run([sys.executable, "-m", "guard", "serve", "--insecure-http", "--bind", "127.0.0.1:1",
                        "--kubeconfig", str(tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr.startswith("ghost-guard serve: cannot load cluster credentials from ")
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_chunked_body_under_the_cap_is_read_whole(guard):
    """No Content-Length (chunked transfer): read to the end, not cut."""
    def chunks():
        yield b'{"Pod": {"metadata": {"name": "p", "namespace": "d", "uid": "u"}}, "Nodes": null, '
        yield b'"NodeNames": ["node-a", "node-b", "node-c"]}'

    r = guard.post("/filter", chunks())
    assert r.status_code == 200, r.text
    # d/p does not exist: a ghost, so every node the body named must come back as unresolvable
    assert sorted(r.json()["FailedAndUnresolvableNodes"]) == NAMES


@pytest.mark.parametrize("path,doc", [
    pytest.param("/filter", {"Pod": {"metadata": {"name": "gone", "namespace": "d", "uid": "u-1"}}, "Nodes": None,
                             "NodeNames": NAMES}, id="filter-ghost"),
    pytest.param("/filter", {"Pod": {"metadata": {"name": "gone", "namespace": "d", "uid": "u-1"}},
                             "Nodes": NODE_LIST, "NodeNames": None}, id="filter-ghost-nodes"),
    pytest.param("/preempt", {"Pod": {"metadata": {"name": "gone", "namespace": "d", "uid": "u-1"}},
                              "NodeNameToMetaVictims": {"node-a": {"Pods": [{"UID": "v"}]}}}, id="preempt-ghost"),
    pytest.param("/filter", {"Pod": {"metadata": {"name": "x"}}, "Nodes": None, "NodeNames": [1]}, id="bad-names"),
    pytest.param("/filter", {"Nodes": None, "NodeNames": NAMES}, id="no-pod"),
    pytest.param("/preempt", {"Pod": {"metadata": {"name": "x"}}, "NodeNameToMetaVictims": []}, id="bad-victims"),
])
def test_both_lanes_answer_alike(guard, path, doc):
    """With a Content-Length the fast lane answers, chunked goes through Flask: same status, same bytes."""
    body = orjson.dumps(doc)
    fast = guard.post(path, body)
    flask = guard.post(path, iter([body[:10], body[10:]]))
    assert fast.request.headers.get("Content-Length") and "Content-Length" not in flask.request.headers
    assert (fast.status_code, fast.content) == (flask.status_code, flask.content)
    assert fast.headers["Content-Type"] == flask.headers["Content-Type"] == "application/json"
    assert fast.status_code in (200, 400) and fast.content


def test_the_fast_lane_counts_and_logs_its_calls(guard):
    """A kube-scheduler-shaped call (the fast lane's) is counted and access-logged like any other."""
    body = orjson.dumps({"Pod": {"metadata": {"name": "lane", "namespace": "d", "uid": "u-lane"}}, "Nodes": None,
                         "NodeNames": NAMES})
    before = guard.metric("ghost_guard_requests_total", endpoint="/filter", code="200")
    assert guard.post("/filter", body).status_code == 200
    assert guard.metric("ghost_guard_requests_total", endpoint="/filter", code="200") == before + 1
    line = [ln for ln in guard.logs(tail=None).splitlines() if '"uid":"u-lane"' in ln][-1]
    entry = orjson.loads(line)
    assert (entry["path"], entry["status"], entry["pod"], entry["verdict"]) == ("/filter", 200, "d/lane", "ghost-deleted")


def test_a_body_shorter_than_its_content_length_is_a_400(guard):
    """The client promises 200 bytes, sends 20 and stops writing: a clear 400, the worker carries on."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(guard.url("/filter"))
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\nConnection: close\r\n\r\n" + b'{"Pod":{"metadata":')
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply[:300]
    assert orjson.loads(body)["error"]
    assert guard.get("/healthz", timeout=5).status_code == 200
