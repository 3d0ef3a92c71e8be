"""guard/kube/api.py's light API sends what the official ``kubernetes`` client sends, call for call.

The CLI's cluster commands call the apiserver through ``LightApi`` (no ``kubernetes`` import); the RBAC
test (tests/integration/test_security.py) derives the verbs from the official client's paths for the
same method names. Both hold only if, for every API method the code calls, the light twin sends the
same HTTP method, path, query, content type, credentials and body: checked here on a real HTTP server
that records both clients' requests, and the table is checked to cover every call site in guard/.
"""

from __future__ import annotations

import ast
import datetime
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest

from guard.kube.api import ApiError, open_api
from guard.kube.config import LightConfiguration
from guard.kube.writes import GHOSTPOD_GROUP as G, GHOSTPOD_PLURAL as P, GHOSTPOD_VERSION as V

REPO = Path(__file__).resolve().parents[2]
MERGE = "application/merge-patch+json"
META = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1, application/json"
DELETE = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0, "preconditions": {"uid": "u-1"}}
POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": []}}

# (API class, method, args, kwargs): one row per method the code calls, with arguments like the code's.
CALLS = [
    ("CoreV1Api", "list_namespaced_pod", ("ns",), {"field_selector": "metadata.name=p", "resource_version": "0"}),
    ("CoreV1Api", "list_pod_for_all_namespaces", (), {
        "field_selector": "spec.nodeName=", "resource_version": "17", "watch": True, "allow_watch_bookmarks": True,
        "timeout_seconds": 300, "_request_timeout": (5, 330)}),
    ("CoreV1Api", "list_node", (), {"resource_version": "0", "_headers": {"Accept": META}}),
    ("CoreV1Api", "read_namespaced_pod", ("p", "ns"), {}),
    ("CoreV1Api", "create_namespaced_pod", ("ns", POD), {}),
    ("CoreV1Api", "delete_namespaced_pod", ("p", "ns"), {"body": DELETE}),
    ("CoreV1Api", "patch_namespaced_pod", ("p", "ns", {"metadata": {"annotations": {"a": "b"}}}),
     {"_content_type": MERGE}),
    ("CoreV1Api", "read_node", ("n1",), {}),
    ("CoreV1Api", "create_node", ({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}},), {}),
    ("CoreV1Api", "delete_node", ("n1",), {"body": {"apiVersion": "v1", "kind": "DeleteOptions",
                                                   "preconditions": {"uid": "u"}}}),
    ("CoreV1Api", "read_namespaced_endpoints", ("kubernetes", "default"), {}),
    ("CoreV1Api", "create_namespaced_event", ("ns", {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": "e", "namespace": "ns"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": "ns", "name": "p", "uid": "u"},
        "reason": "GhostPod", "message": "m", "type": "Warning", "source": {"component": "ghost-guard", "host": "h"},
        "reportingComponent": "ghost-guard", "reportingInstance": "h", "firstTimestamp": "2026-01-02T03:04:05Z",
        "lastTimestamp": "2026-01-02T03:04:05Z", "count": 1}), {}),
    ("CoreV1Api", "read_namespaced_event", ("e", "ns"), {}),
    ("CoreV1Api", "patch_namespaced_event", ("e", "ns", {"count": 2}), {"_content_type": MERGE}),
    ("DiscoveryV1Api", "list_namespaced_endpoint_slice", ("default",),
     {"label_selector": "kubernetes.io/service-name=kubernetes"}),
    ("CoordinationV1Api", "list_namespaced_lease", ("kube-system",),
     {"label_selector": "apiserver.kubernetes.io/identity=kube-apiserver"}),
    ("CustomObjectsApi", "create_namespaced_custom_object", (G, V, "ns", P, {"kind": "GhostPod"}), {}),
    ("CustomObjectsApi", "get_namespaced_custom_object", (G, V, "ns", P, "g1"), {}),
    ("CustomObjectsApi", "patch_namespaced_custom_object_status", (G, V, "ns", P, "g1", {"status": {"x": 1}}),
     {"_content_type": MERGE}),
    ("CustomObjectsApi", "list_cluster_custom_object", (G, V, P), {"limit": 500, "_continue": "tok/en=="}),
    ("CustomObjectsApi", "list_namespaced_custom_object", (G, V, "ns", P), {"limit": 5}),
    ("CustomObjectsApi", "delete_namespaced_custom_object", (G, V, "ns", P, "g1"),
     {"body": {"apiVersion": "v1", "kind": "DeleteOptions",
               "preconditions": {"uid": "u", "resourceVersion": "9"}}}),
    ("CustomObjectsApi", "create_cluster_custom_object", (G, V, "ghostnodes", {"kind": "GhostNode"}), {}),
    ("CustomObjectsApi", "get_cluster_custom_object", (G, V, "ghostnodes", "n1"), {}),
    ("CustomObjectsApi", "patch_cluster_custom_object_status", (G, V, "ghostnodes", "n1", {"status": {"x": 1}}),
     {"_content_type": MERGE}),
    ("CustomObjectsApi", "delete_cluster_custom_object", (G, V, "ghostnodes", "n1"),
     {"body": {"apiVersion": "v1", "kind": "DeleteOptions",
               "preconditions": {"uid": "u", "resourceVersion": "9"}}}),
    ("VersionApi", "get_code", (), {}),
]


class _Recorder(BaseHTTPRequestHandler):
    seen: list[dict] = []
    status = 200

    def _any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        url = urlsplit(self.path)
        self.seen.append({"method": self.command, "path": url.path, "query": sorted(parse_qsl(url.query)),
                          "content-type": self.headers.get("Content-Type"), "accept": self.headers.get("Accept"),
                          "authorization": self.headers.get("Authorization"),
                          "body": json.loads(body) if body else None})
        reply = b'{"kind":"Status","reason":"Conflict","message":"m"}' if self.status != 200 else b"{}"
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _any

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _apis(url: str):
    from kubernetes import client

    official = client.Configuration(host=url)
    official.api_key = {"BearerToken": "Bearer t0ken"}
    light = LightConfiguration(url)
    light.token = "Bearer t0ken"
    return open_api(official), open_api(light)


def _request(api, cls: str, method: str, args: tuple, kwargs: dict) -> dict:
    _Recorder.seen.clear()
    resp = getattr(getattr(api, cls)(), method)(*args, _preload_content=False, **kwargs)
    resp.release_conn()
    (seen,) = _Recorder.seen
    return seen


@pytest.mark.parametrize("cls,method,args,kwargs", CALLS, ids=[f"{c[0]}.{c[1]}" for c in CALLS])
def test_the_light_api_sends_the_official_request(server, cls, method, args, kwargs):
    official, light = _apis(server)
    want = _request(official, cls, method, args, kwargs)
    got = _request(light, cls, method, args, kwargs)
    # The official client sends a body through its model: timestamps come back as "+00:00" for "Z" (the same time).
    assert _times(got) == _times(want)


def _times(value):
    if isinstance(value, dict):
        return {k: _times(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_times(v) for v in value]
    if isinstance(value, str) and len(value) >= 20 and value[4] == "-" and value[10] == "T":
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return value


def test_an_error_answer_is_an_api_error_from_both(server):
    """A non-2xx answer raises ApiError with the status and the Status body, from either API."""
    official, light = _apis(server)
    _Recorder.status = 409
    try:
        for api in (official, light):
            with pytest.raises(ApiError) as e:
                api.CoreV1Api().create_namespaced_pod("ns", POD, _preload_content=False)
            assert e.value.status == 409
            assert json.loads(e.value.body)["reason"] == "Conflict"
    finally:
        _Recorder.status = 200


def _called_methods() -> set[tuple[str, str]]:
    """(API class, method) of every API call in guard/ (outside the lab): ``x.core.M``, ``x.objects.M``,
    ``x.version.M`` and ``x.SomeApi().M``, and the CustomObjectsApi methods GhostPods passes by reference."""
    bound = {"core": "CoreV1Api", "objects": "CustomObjectsApi", "version": "VersionApi"}
    out = set()
    for path in (REPO / "guard").rglob("*.py"):
        if "lab" in path.relative_to(REPO / "guard").parts or path.name == "api.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            recv = node.value
            if isinstance(recv, ast.Attribute) and recv.attr in bound and not node.attr.startswith("_"):
                out.add((bound[recv.attr], node.attr))
            elif isinstance(recv, ast.Call) and isinstance(recv.func, ast.Attribute) and recv.func.attr.endswith("Api"):
                out.add((recv.func.attr, node.attr))
    return out


def test_the_table_covers_every_call_in_the_code():
    called = _called_methods()
    assert ("CoreV1Api", "list_namespaced_pod") in called and ("CustomObjectsApi", "delete_namespaced_custom_object") \
        in called  # the scan finds the calls
    assert called - {(c[0], c[1]) for c in CALLS} == set()
