"""``Kube.quorum_get`` over HTTPS with token auth against the lab: the answers and the fail-open reasons.

The GET goes through the kubernetes client's own urllib3 pool and auth settings (not its
``CoreV1Api`` call machinery): it must still verify the server's certificate and name,
send the kubeconfig's token (running the token refresh hook), read without resourceVersion,
and turn every kind of trouble into the same reasons as before.
"""

from __future__ import annotations

import copy
import http.server
import threading
from collections.abc import Iterator

import pytest

from guard.kube.config import load_configuration

from guard.kube.reads import Kube
from guard.lab.harness import free_port, make_ghost, pod_manifest
from guard.lab.pki import CA
from guard.core.verdict import QuorumRead, ReadStatus


def kube_for(cfg, timeout: float = 2.0) -> Kube:
    return Kube(cfg, timeout=timeout, pool_size=2)


@pytest.fixture
def configuration(shared_lab):
    return load_configuration(shared_lab.kubeconfig(0))


@pytest.fixture
def proxy_404() -> Iterator[str]:
    """A plain HTTP server that answers every path with a proxy's 404 (not a Kubernetes Status)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = b"404 page not found\n"
            self.send_response(404)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_live_pod_is_read_from_etcd_with_the_token(shared_lab, lab_namespace, configuration):
    created = shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    kube = kube_for(configuration)
    try:
        read = kube.quorum_get(lab_namespace, "p")
    finally:
        kube.close()
    assert read == QuorumRead.found(created.metadata.uid, resource_version=created.metadata.resource_version)
    gets = shared_lab.replicas[0].requests(method="GET", path=f"/api/v1/namespaces/{lab_namespace}/pods/p")
    assert [(r.status, r.source, r.query) for r in gets] == [(200, "etcd", {})]


def test_a_pod_etcd_no_longer_has_is_not_found_even_where_a_stale_cache_serves_it(shared_lab, lab_namespace):
    make_ghost(shared_lab, lab_namespace, "web-1", stale=1)
    for i in (0, 1):
        kube = kube_for(load_configuration(shared_lab.kubeconfig(i)))
        try:
            assert kube.quorum_get(lab_namespace, "web-1") == QuorumRead.not_found()
        finally:
            kube.close()


def test_names_are_percent_encoded_as_the_client_does(shared_lab, lab_namespace, configuration):
    """A name is never spliced raw into the path: '../x' cannot reach another resource."""
    kube = kube_for(configuration)
    try:
        read = kube.quorum_get(lab_namespace, "../../pods")
    finally:
        kube.close()
    assert read.status is ReadStatus.NOT_FOUND
    paths = [r.path for r in shared_lab.replicas[0].requests(method="GET")
             if r.path.startswith(f"/api/v1/namespaces/{lab_namespace}/")]
    assert paths == [f"/api/v1/namespaces/{lab_namespace}/pods/..%2F..%2Fpods"]


@pytest.mark.parametrize("status,reason", [
    pytest.param(500, "HTTP 500 InternalError", id="500"),
    pytest.param(429, "HTTP 429 TooManyRequests", id="429"),
    pytest.param(503, "HTTP 503 ServiceUnavailable", id="503"),
])
def test_apiserver_errors_fail_open_with_their_status(shared_lab, lab_namespace, configuration, status, reason):
    shared_lab.replicas[0].faults.add("status", method="GET", path=f"/api/v1/namespaces/{lab_namespace}/pods/p",
                                      status=status)
    kube = kube_for(configuration)
    try:
        assert kube.quorum_get(lab_namespace, "p") == QuorumRead.failed(reason, http_status=status)
    finally:
        kube.close()


def test_a_404_from_a_proxy_is_no_evidence(configuration, proxy_404):
    cfg = copy.deepcopy(configuration)
    cfg.host = proxy_404
    cfg.refresh_api_key_hook = None  # the kubeconfig loader's hook would put the kubeconfig's server back
    kube = kube_for(cfg)
    try:
        assert kube.quorum_get("default", "web-1") == QuorumRead.failed("HTTP 404 Not Found", http_status=404)
    finally:
        kube.close()


def test_a_hung_apiserver_is_a_timeout_within_the_callers_budget(shared_lab, lab_namespace, configuration):
    shared_lab.replicas[0].faults.add("hang", method="GET", path=f"/api/v1/namespaces/{lab_namespace}/pods/p")
    kube = kube_for(configuration, timeout=2.0)
    try:
        assert kube.quorum_get(lab_namespace, "p", 0.3) == QuorumRead.failed("timeout after 0.3s")
    finally:
        kube.close()


def test_a_refused_connection_is_a_connection_error(configuration):
    cfg = copy.deepcopy(configuration)
    cfg.host = f"https://127.0.0.1:{free_port()}"
    cfg.refresh_api_key_hook = None  # the kubeconfig loader's hook would put the kubeconfig's server back
    kube = kube_for(cfg)
    try:
        assert kube.quorum_get("default", "p") == QuorumRead.failed("connection error: NewConnectionError")
    finally:
        kube.close()


def test_the_server_certificate_is_verified_against_the_kubeconfigs_ca(shared_lab, lab_namespace, configuration,
                                                                      tmp_path):
    """Another CA, or a server name the certificate does not carry: a TLS error, and no request reaches the pod path."""
    other = tmp_path / "other-ca.crt"
    other.write_bytes(CA("not-the-lab").cert_pem)
    wrong_ca = copy.deepcopy(configuration)
    wrong_ca.ssl_ca_cert, wrong_ca.ca_cert_data = str(other), None
    wrong_name = copy.deepcopy(configuration)
    wrong_name.tls_server_name = "not-the-apiserver.example"
    for cfg in (wrong_ca, wrong_name):
        kube = kube_for(cfg)
        try:
            assert kube.quorum_get(lab_namespace, "web-1") == QuorumRead.failed("TLS error talking to the apiserver")
        finally:
            kube.close()
    assert shared_lab.replicas[0].requests(path=f"/api/v1/namespaces/{lab_namespace}/pods/web-1") == []


def test_a_wrong_token_is_an_http_401(shared_lab, configuration):
    cfg = copy.deepcopy(configuration)
    cfg.api_key = {"authorization": "Bearer not-the-token"}
    cfg.refresh_api_key_hook = None  # the kubeconfig loader's hook would put the kubeconfig's token back
    kube = kube_for(cfg)
    try:
        assert kube.quorum_get("default", "p") == QuorumRead.failed("HTTP 401 Unauthorized", http_status=401)
    finally:
        kube.close()


def test_the_token_refresh_hook_runs_for_every_get(shared_lab, lab_namespace, configuration):
    """Exec plugins and in-cluster tokens rotate through ``refresh_api_key_hook``: each GET asks it, before
    the URL is built (the kubeconfig loader's hook also rewrites the host)."""
    shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("p"), _request_timeout=5)
    cfg = copy.deepcopy(configuration)
    # An expired token the hook replaces (the client asks the hook only when a token is configured).
    cfg.api_key, cfg.api_key_prefix = {"authorization": "Bearer expired"}, {}
    calls = []

    def refresh(c) -> None:
        calls.append(1)
        c.api_key = {"authorization": shared_lab.token}
        c.api_key_prefix = {"authorization": "Bearer"}
        c.host = shared_lab.urls[0]

    cfg.refresh_api_key_hook = refresh
    cfg.host = f"https://127.0.0.1:{free_port()}"  # nothing listens there: only the hook's host answers
    kube = kube_for(cfg)
    try:
        reads = [kube.quorum_get(lab_namespace, "p").status for _ in range(3)]
    finally:
        kube.close()
    assert (reads, len(calls)) == ([ReadStatus.FOUND] * 3, 3)


def test_a_proxy_from_the_environment_is_kept_across_token_refreshes(shared_lab, monkeypatch):
    """The kubeconfig's token hook re-assigns the host on every GET; the proxy resolved at load
    time (here: HTTPS_PROXY, where nothing listens) is still the one every GET goes through."""
    for var in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{free_port()}")
    cfg = load_configuration(shared_lab.kubeconfig(0))
    assert cfg.refresh_api_key_hook is not None
    kube = kube_for(cfg)
    try:
        reads = [kube.quorum_get("default", "p") for _ in range(2)]
    finally:
        kube.close()
    assert reads == [QuorumRead.failed("connection error: ProxyError")] * 2


def test_a_token_that_cannot_be_read_fails_open(configuration):
    """An in-cluster token file gone missing (the hook raises): no verdict from it, a connection error."""
    cfg = copy.deepcopy(configuration)

    def refresh(c) -> None:
        open("/nonexistent/serviceaccount/token").close()

    cfg.refresh_api_key_hook = refresh
    kube = kube_for(cfg)
    try:
        assert kube.quorum_get("default", "p") == QuorumRead.failed("connection error: FileNotFoundError")
    finally:
        kube.close()
