"""Hostile input against one real ``ghost-guard serve`` process (hypothesis).

Every answer on /filter, /preempt and /validate/binding must be either a valid
protocol reply (for /filter: exactly the five ExtenderFilterResult keys, in the
request's own mode, node names a subset of the request's) or a 4xx carrying
``{"error": reason}``. Never a 5xx; the worker never dies (same pid at the
end) and its RSS stays bounded.

The guard's apiserver is ``http://127.0.0.1:9`` (nothing listens): every check
fails open, so this module needs no lab and runs the parsers and the fail-open
path under fire. The ghost (reject) path under hostile node lists is in
``test_faults.py``, which has a lab.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guard.lab.harness import GuardProcess
from guard.serving.offload import OFFLOAD_BYTES

pytestmark = pytest.mark.timeout(240)

FILTER_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
MAX_BODY = 8 * 1024 * 1024
RSS_LIMIT_KB = 300 * 1024
TOKEN = "hostile-input-token-4f1d9a"

HYPOTHESIS = settings(max_examples=150, deadline=None, database=None, print_blob=True,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def dead_apiserver_kubeconfig(path: Path, token: str) -> str:
    """A kubeconfig whose apiserver never answers (nothing listens on port 9)."""
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        "clusters:\n- name: dead\n  cluster: {server: 'http://127.0.0.1:9'}\n"
        f"users:\n- name: guard\n  user: {{token: '{token}'}}\n"
        "contexts:\n- name: dead\n  context: {cluster: dead, user: guard}\n"
        "current-context: dead\n")
    return str(path)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture(scope="module")
def guard(tmp_path_factory, module_guard):
    tmp = tmp_path_factory.mktemp("hostile")
    kubeconfig = dead_apiserver_kubeconfig(tmp / "kubeconfig", TOKEN)
    g = module_guard(["--kubeconfig", kubeconfig, "--get-timeout", "0.2", "--max-body-bytes", str(MAX_BODY),
                      "--max-nodes", "100000", "--audit-db", str(tmp / "audit.db")], wait="/healthz")
    g.first_workers = g.workers()
    assert len(g.first_workers) == 1, g.first_workers
    return g


@pytest.fixture(autouse=True)
def alive_after_each_test(request, guard):
    yield
    assert guard.proc.poll() is None, f"guard exited with {guard.proc.returncode}:\n{guard.logs()}"
    assert guard.workers() == guard.first_workers, f"the worker was replaced (died):\n{guard.logs()}"


# --- reply checks ------------------------------------------------------------


def assert_error_reply(resp: requests.Response) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    assert resp.headers["Content-Type"] == "application/json", resp.headers
    body = resp.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"], str) and body["error"], body


def _names(items: Any) -> list:
    return [i["metadata"]["name"] for i in items]


def assert_filter_reply(request_doc: Any, resp: requests.Response) -> dict | None:
    """A valid ExtenderFilterResult in the request's mode, or a 4xx with a reason. Returns the reply."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code != 200:
        assert_error_reply(resp)
        return None
    reply = orjson.loads(resp.content)
    assert set(reply) == FILTER_KEYS, reply.keys()
    assert isinstance(request_doc, dict), "a 200 for a body that is not a JSON object"
    assert isinstance(reply["Error"], str)
    assert isinstance(reply["FailedNodes"], dict) and isinstance(reply["FailedAndUnresolvableNodes"], dict)
    if request_doc.get("NodeNames") is not None:  # names mode
        sent = request_doc["NodeNames"]
        assert reply["Nodes"] is None
        assert isinstance(reply["NodeNames"], list)
        sent_names = {orjson.dumps(n, option=orjson.OPT_SORT_KEYS) for n in sent}
        assert all(orjson.dumps(n, option=orjson.OPT_SORT_KEYS) in sent_names for n in reply["NodeNames"]), \
            "NodeNames not a subset of the request's"
        assert set(reply["FailedAndUnresolvableNodes"]) <= {n for n in sent if isinstance(n, str)}
    else:  # nodes mode
        sent = request_doc["Nodes"]
        assert isinstance(sent, dict), "a 200 for a request without Nodes or NodeNames"
        assert reply["NodeNames"] is None
        assert isinstance(reply["Nodes"], dict)
        got = reply["Nodes"].get("items") or []
        sent_items = {orjson.dumps(i, option=orjson.OPT_SORT_KEYS) for i in sent.get("items") or []}
        assert all(orjson.dumps(i, option=orjson.OPT_SORT_KEYS) in sent_items for i in got), \
            "Nodes.items not a subset of the request's"
    # The apiserver is unreachable: whatever parses must fail open (every node passes).
    assert reply["FailedAndUnresolvableNodes"] == {} and reply["FailedNodes"] == {}
    return reply


def assert_preempt_reply(request_doc: Any, resp: requests.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code != 200:
        assert_error_reply(resp)
        return
    reply = orjson.loads(resp.content)
    assert set(reply) == {"NodeNameToMetaVictims"}, reply
    assert isinstance(request_doc, dict)
    victims = reply["NodeNameToMetaVictims"]
    sent = request_doc.get("NodeNameToMetaVictims") or request_doc.get("NodeNameToVictims") or {}
    assert isinstance(victims, dict) and set(victims) <= set(sent)
    for node, v in victims.items():
        assert set(v) == {"Pods", "NumPDBViolations"}, v
        assert all(set(p) == {"UID"} and isinstance(p["UID"], str) for p in v["Pods"]), v


def assert_binding_reply(request_doc: Any, resp: requests.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code != 200:
        assert_error_reply(resp)
        return
    reply = orjson.loads(resp.content)
    assert set(reply) == {"apiVersion", "kind", "response"}, reply
    assert (reply["apiVersion"], reply["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    assert reply["response"]["uid"] == request_doc["request"]["uid"]
    # Unreachable apiserver: fail open, every binding allowed.
    assert reply["response"] == {"uid": request_doc["request"]["uid"], "allowed": True}, reply


CHECKS = {"/filter": assert_filter_reply, "/preempt": assert_preempt_reply, "/validate/binding": assert_binding_reply}


OVERLOADED = "(the guard's machine is overloaded); retry"


def send(guard: GuardProcess, path: str, doc: Any, retry_for: float = 60.0) -> requests.Response:
    """POST ``doc``. A body over OFFLOAD_BYTES is decoded by a helper process (guard.serving.offload): on a loaded
    machine the helper may miss the call's deadline, and the guard answers 503 "overloaded; retry" (by design:
    the worker does not decode it itself) and replaces the helper. The next large call may find the replacement
    still starting and be decoded by the worker, which on a loaded machine can take past the client's 10 s (a
    6 MiB /preempt once took 10.8 s: a known limit, docs/RELIABILITY.md): a large call is given 30 s, and
    retried, as kube-scheduler would, for up to ``retry_for`` seconds; any other answer is returned at once,
    and a small call is never retried."""
    body = orjson.dumps(doc)
    deadline = time.monotonic() + retry_for
    large = len(body) > OFFLOAD_BYTES
    while True:
        try:
            resp = guard.post(path, body, timeout=30 if large else 10)  # what is checked here is the answer
        except requests.Timeout:
            if not large or time.monotonic() > deadline:
                raise
            continue
        if not large or not (resp.status_code == 503 and OVERLOADED in resp.text):
            return resp
        if time.monotonic() > deadline:
            return resp


# --- strategies --------------------------------------------------------------

leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
dns_names = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
names = (dns_names | st.text(min_size=1, max_size=30) | st.text(min_size=240, max_size=300)
         | st.sampled_from(["", ".", "..", "../../etc/passwd", "a/b", "%2F", "名前-ポッド", "pöd\u200b", "\x00", "a\nb"]))
maybe_names = names | json_values
uids = st.uuids().map(str) | st.text(max_size=140) | json_values
metadata = st.fixed_dictionaries({}, optional={"name": maybe_names, "namespace": maybe_names, "uid": uids,
                                               "labels": json_values, "resourceVersion": json_values})
pods = (st.fixed_dictionaries({"metadata": metadata}, optional={"spec": json_values, "status": json_values,
                                                                "kind": json_values})
        | json_values)
node_names = st.lists(names | json_values, max_size=12) | json_values
node_items = st.lists(st.fixed_dictionaries({}, optional={"metadata": st.fixed_dictionaries(
    {}, optional={"name": maybe_names, "labels": json_values}), "status": json_values}) | json_values, max_size=8)
node_lists = st.fixed_dictionaries({}, optional={"items": node_items | json_values, "kind": json_values,
                                                 "metadata": json_values}) | json_values
extra = st.dictionaries(st.text(max_size=12).filter(lambda k: k not in (
    "Pod", "Nodes", "NodeNames", "NodeNameToVictims", "NodeNameToMetaVictims")), json_values, max_size=3)


@st.composite
def filter_docs(draw) -> Any:
    doc = draw(st.fixed_dictionaries({}, optional={"Pod": pods, "NodeNames": node_names, "Nodes": node_lists}))
    doc.update(draw(extra))
    return doc


meta_victims = st.dictionaries(names, st.fixed_dictionaries({}, optional={
    "Pods": st.lists(st.fixed_dictionaries({}, optional={"UID": uids}) | json_values, max_size=4) | json_values,
    "NumPDBViolations": json_values | st.integers(-(2**63), 2**63 - 1)}) | json_values, max_size=4)
full_victims = st.dictionaries(names, st.fixed_dictionaries({}, optional={
    "Pods": st.lists(pods, max_size=3) | json_values,
    "NumPDBViolations": json_values}) | json_values, max_size=4)


@st.composite
def preempt_docs(draw) -> Any:
    doc = draw(st.fixed_dictionaries({}, optional={"Pod": pods, "NodeNameToMetaVictims": meta_victims | json_values,
                                                   "NodeNameToVictims": full_victims | json_values}))
    doc.update(draw(extra))
    return doc


@st.composite
def binding_reviews(draw) -> Any:
    binding = st.fixed_dictionaries({}, optional={
        "apiVersion": st.just("v1") | json_values, "kind": st.just("Binding") | json_values,
        "metadata": metadata | json_values, "target": json_values}) | json_values
    req = draw(st.fixed_dictionaries(
        {"uid": st.uuids().map(str) | uids},
        optional={"kind": json_values,
                  "resource": st.just({"group": "", "version": "v1", "resource": "pods"}) | json_values,
                  "subResource": st.just("binding") | json_values,
                  "operation": st.sampled_from(["CREATE", "UPDATE", "DELETE"]) | json_values,
                  "name": maybe_names, "namespace": maybe_names, "object": binding}))
    doc = draw(st.fixed_dictionaries({"request": st.just(req) | json_values}, optional={
        "apiVersion": st.just("admission.k8s.io/v1") | json_values,
        "kind": st.just("AdmissionReview") | json_values}))
    return doc


def valid_filter_doc(n: int = 3) -> dict:
    return {"Pod": {"metadata": {"name": "web-1", "namespace": "default", "uid": "0b7e-uid"}},
            "NodeNames": [f"node-{i}" for i in range(n)]}


# --- properties --------------------------------------------------------------


@HYPOTHESIS
@given(doc=filter_docs())
def test_filter_structured_garbage(guard, doc):
    assert_filter_reply(doc, send(guard, "/filter", doc))


@HYPOTHESIS
@given(doc=preempt_docs())
def test_preempt_structured_garbage(guard, doc):
    assert_preempt_reply(doc, send(guard, "/preempt", doc))


@HYPOTHESIS
@given(doc=binding_reviews())
def test_binding_structured_garbage(guard, doc):
    assert_binding_reply(doc, send(guard, "/validate/binding", doc))


@HYPOTHESIS
@given(path=st.sampled_from(sorted(CHECKS)), body=st.binary(max_size=2000))
def test_random_bytes(guard, path, body):
    resp = guard.post(path, body)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        assert_error_reply(resp)
        assert resp.status_code == 400
        return
    CHECKS[path](doc, resp)


@HYPOTHESIS
@given(path=st.sampled_from(sorted(CHECKS)), doc=json_values)
def test_any_json_value(guard, path, doc):
    CHECKS[path](doc, send(guard, path, doc))


@HYPOTHESIS
@given(path=st.sampled_from(sorted(CHECKS)), doc=filter_docs() | preempt_docs() | binding_reviews(), cut=st.floats(0, 1))
def test_truncated_json(guard, path, doc, cut):
    body = orjson.dumps(doc)
    body = body[: int(len(body) * cut)]
    resp = guard.post(path, body)
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        assert resp.status_code == 400, resp.text
        assert_error_reply(resp)
        return
    CHECKS[path](parsed, resp)


content_types = (st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                  "application/jsonx", "json", "", "application/json-patch+json", "*/*",
                                  "APPLICATION/JSON", "application/json; charset=utf-16", "application/yaml"])
                 | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=60).map(str.strip))


@HYPOTHESIS
@given(path=st.sampled_from(sorted(CHECKS)), content_type=content_types)
def test_content_types(guard, path, content_type):
    doc = valid_filter_doc()
    resp = guard.post(path, orjson.dumps(doc), headers={"Content-Type": content_type})
    mimetype = content_type.split(";")[0].strip().lower()
    if mimetype != "application/json":
        assert resp.status_code == 415, (content_type, resp.status_code, resp.text)
        assert_error_reply(resp)
    else:
        assert resp.status_code < 500
        if path == "/filter":
            assert_filter_reply(doc, resp)


def test_missing_content_type(guard):
    resp = guard.session.post(guard.url("/filter"), data=orjson.dumps(valid_filter_doc()), timeout=10)
    assert resp.status_code == 415
    assert resp.json() == {"error": "Content-Type must be application/json, got 'none'"}


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/filter", "/preempt", "/validate/binding"])
def test_wrong_method_on_verbs(guard, method, path):
    resp = guard.session.request(method, guard.url(path), data=b"{}", headers={"Content-Type": "application/json"},
                                 timeout=10)
    assert resp.status_code == 405
    assert_error_reply(resp)
    assert set(resp.headers["Allow"].split(", ")) == {"OPTIONS", "POST"}


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics"])
def test_wrong_method_on_probes(guard, method, path):
    resp = guard.session.request(method, guard.url(path), data=b"{}", timeout=10)
    assert resp.status_code == 405
    assert_error_reply(resp)


@pytest.mark.parametrize("path", ["/", "/filter/", "/Filter", "/filter/../etc", "/%00", "/validate", "/metrics/x"])
def test_unknown_paths(guard, path):
    resp = guard.post(path, orjson.dumps(valid_filter_doc()))
    assert resp.status_code in (404, 405), (path, resp.status_code)
    assert_error_reply(resp)


# --- sizes and shapes hypothesis does not reach --------------------------------


def test_100k_node_names(guard):
    doc = valid_filter_doc(100_000)
    reply = assert_filter_reply(doc, send(guard, "/filter", doc))
    assert reply["NodeNames"] == doc["NodeNames"]


def test_100k_nodes_objects(guard):
    doc = {"Pod": valid_filter_doc()["Pod"],
           "Nodes": {"metadata": {"resourceVersion": "7"},
                     "items": [{"metadata": {"name": f"node-{i}", "labels": {"zone": "a"}}} for i in range(100_000)]}}
    reply = assert_filter_reply(doc, send(guard, "/filter", doc))
    assert reply["Nodes"] == doc["Nodes"]


def test_100k_preemption_candidates(guard):
    doc = {"Pod": valid_filter_doc()["Pod"],
           "NodeNameToMetaVictims": {f"node-{i}": {"Pods": [{"UID": f"v-{i}"}], "NumPDBViolations": 0}
                                     for i in range(100_000)}}
    resp = send(guard, "/preempt", doc)
    assert_preempt_reply(doc, resp)
    assert resp.json() == {"NodeNameToMetaVictims": doc["NodeNameToMetaVictims"]}


@pytest.mark.parametrize("field,length,limit", [("name", 254, 253), ("namespace", 64, 63), ("uid", 129, 128),
                                                ("name", 1_000_000, 253)])
def test_too_long_names(guard, field, length, limit):
    doc = valid_filter_doc()
    doc["Pod"]["metadata"][field] = "a" * length
    resp = send(guard, "/filter", doc)
    assert resp.status_code == 400
    assert resp.json()["error"].startswith(f"Pod.metadata: {field} is {length} characters, more than {limit}")


def test_longest_legal_names_pass(guard):
    doc = valid_filter_doc()
    doc["Pod"]["metadata"].update(name="n" * 253, namespace="s" * 63, uid="u" * 128)
    doc["NodeNames"] = ["x" * 100_000, "ノード-1", "node-\u200b"]
    reply = assert_filter_reply(doc, send(guard, "/filter", doc))
    assert reply["NodeNames"] == doc["NodeNames"]


@pytest.mark.parametrize("name", ["pöd-ü", "ポッド", "🙂", "\u202eevil", "a\u0000b", "a\nb\r\n", "'; DROP TABLE x;--",
                                  "live,metadata.namespace=default", "UPPER", "a_b", "-a", "a-"])
@pytest.mark.parametrize("field", ["name", "namespace"])
def test_names_the_apiserver_refuses_are_refused(guard, name, field):
    """No pod can have such a name (guard.core.names, as the apiserver validates): a 400 with the reason,
    no control or bidirectional character in it, before any read or selector is built."""
    doc = valid_filter_doc()
    doc["Pod"]["metadata"][field] = name
    resp = send(guard, "/filter", doc)
    assert_error_reply(resp)
    assert resp.status_code == 400
    reason = resp.json()["error"]
    assert reason.startswith(f"Pod.metadata: {field} ") and "DNS-1123" in reason, reason
    assert reason.isprintable(), reason


@pytest.mark.parametrize("path", sorted(CHECKS))
@pytest.mark.parametrize("shape", ["arrays", "objects", "unterminated", "inside-valid-request"])
@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_deep_nesting(guard, path, shape, depth):
    if shape == "arrays":
        body = b"[" * depth + b"]" * depth
    elif shape == "objects":
        body = b'{"a":' * depth + b"1" + b"}" * depth
    elif shape == "unterminated":
        body = b"[" * depth
    else:
        body = orjson.dumps(valid_filter_doc())[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"
    resp = guard.post(path, body)
    assert_error_reply(resp)
    if len(body) > 64 * 1024:  # mostly brackets: refused before decoding (guard.core.extender.decode)
        assert resp.status_code == 413, resp.text[:300]
        assert " JSON objects or arrays in " in resp.json()["error"], resp.text[:300]
    else:  # decoded, and refused past orjson's depth limit
        assert resp.status_code == 400, resp.text[:300]
        assert resp.json()["error"].startswith("request body is not valid JSON: ")


def test_body_over_the_limit(guard):
    body = orjson.dumps(valid_filter_doc()) + b" " * (MAX_BODY + 1)
    resp = guard.post("/filter", body)
    assert resp.status_code == 413
    assert_error_reply(resp)


def test_chunked_body_over_the_limit(guard):
    """No Content-Length: the limit holds while reading the stream."""

    def chunks():
        yield b'{"Pod": {"metadata": {"name": "x"}}, "NodeNames": ["'
        for _ in range(20):
            yield b"n" * (1024 * 1024)
        yield b'"]}'

    resp = guard.post("/filter", chunks())
    assert resp.status_code == 413
    assert_error_reply(resp)


def test_memory_bounded_and_token_never_logged(guard):
    """Runs last in this module: after everything above, the worker's RSS is bounded."""
    for _ in range(20):  # the largest accepted shapes again
        doc = valid_filter_doc(100_000)
        assert send(guard, "/filter", doc).status_code == 200
    (worker,) = guard.first_workers
    rss = rss_kb(worker)
    print(f"\nworker RSS after the hostile-input run: {rss / 1024:.1f} MiB")
    assert rss < RSS_LIMIT_KB, f"worker RSS {rss} kB"
    assert rss_kb(guard.proc.pid) < RSS_LIMIT_KB
    logs = guard.logs(tail=None) + guard.stdout()
    assert TOKEN not in logs
    assert "Traceback" not in logs and '"level":"error"' not in logs, logs[-3000:]
    assert guard.metric("ghost_guard_requests_total", code="500") == 0
    assert guard.metric("ghost_guard_fail_open_total", reason="internal-error") == 0
    assert guard.metric("ghost_guard_fail_open_total", reason="apiserver") > 0

