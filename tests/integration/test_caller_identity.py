"""Callers authorized by client certificate, per role, on a real ``ghost-guard serve`` (guard.core.identity).

With ``--client-ca``: ``/filter`` and ``/preempt`` answer only kube-scheduler's
certificate, ``/validate/binding`` only kube-apiserver's, ``/metrics`` and the
probes only the monitoring one; a valid certificate of another role gets a 403
with ``{"error": reason}``, counted, on both lanes (the fast lane's
Content-Length bodies and Flask's chunked ones). Without ``--client-ca``
(server-only TLS) there is no identity check. The guard's apiserver is dead
(every check fails open): these tests are about who may ask, not the answers.
"""

from __future__ import annotations

import pytest
import requests

from guard.tools.certs import generate
from guard.lab.harness import tls_files
from role_calls import CALLS, OWNER

pytestmark = pytest.mark.timeout(120)

FLAG = {"client": "scheduler", "apiserver": "apiserver", "monitoring": "monitoring"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("pki"), ips=["127.0.0.1"])


def call(guard, path: str, role: str | None, pki, *, chunked: bool = False) -> requests.Response:
    with requests.Session() as s:
        s.trust_env = False
        s.verify = str(pki.ca_cert)
        if role:
            s.cert = (str(getattr(pki, f"{role}_cert")), str(getattr(pki, f"{role}_key")))
        body = CALLS[path]
        if body is None:
            return s.get(guard.url(path), timeout=5)
        data = iter([body]) if chunked else body  # a generator: requests sends it chunked (the Flask lane)
        return s.post(guard.url(path), data=data, headers={"Content-Type": "application/json"}, timeout=5)


@pytest.fixture(scope="module")
def mtls_guard(pki, dead_kubeconfig, tmp_path_factory, module_guard):
    return module_guard(["--kubeconfig", dead_kubeconfig, "--get-timeout", "0.2", "--no-prepare",
                         "--audit-db", str(tmp_path_factory.mktemp("db") / "audit.db")], tls=tls_files(pki),
                        wait="/healthz")


@pytest.mark.parametrize("path", list(CALLS))
@pytest.mark.parametrize("role", ["client", "apiserver", "monitoring"])
def test_each_endpoint_answers_only_its_role(mtls_guard, pki, path, role):
    before = mtls_guard.metric("ghost_guard_requests_forbidden_total", endpoint=path)
    lanes = [False, True] if CALLS[path] is not None else [False]
    for chunked in lanes:
        r = call(mtls_guard, path, role, pki, chunked=chunked)
        if role == OWNER[path]:  # /readyz is 503 here (the apiserver is dead): answered, not refused
            assert r.status_code == (503 if path == "/readyz" else 200), (path, role, chunked, r.text)
        else:
            assert r.status_code == 403, (path, role, chunked, r.text)
            assert r.headers["Content-Type"] == "application/json"
            reason = r.json()["error"]
            assert set(r.json()) == {"error"}
            assert f"not allowed to call {path}" in reason and f"--{FLAG[OWNER[path]]}-identities" in reason, reason
    refused = 0 if role == OWNER[path] else len(lanes)
    assert mtls_guard.metric("ghost_guard_requests_forbidden_total", endpoint=path) == before + refused
    if refused:
        assert mtls_guard.metric("ghost_guard_requests_forbidden_total", endpoint=path,
                                 role=FLAG[OWNER[path]]) >= refused


def test_identities_are_configurable_by_environment(pki, dead_kubeconfig, start_guard, tmp_path):
    """GHOST_GUARD_SCHEDULER_IDENTITIES replaces the scheduler's names: here the monitoring certificate's."""
    guard = start_guard(["--kubeconfig", dead_kubeconfig, "--get-timeout", "0.2", "--no-prepare",
                         "--audit-db", str(tmp_path / "audit.db")], tls=tls_files(pki), wait="/healthz",
                        env={"GHOST_GUARD_SCHEDULER_IDENTITIES": "ghost-guard-monitoring"})
    assert call(guard, "/filter", "monitoring", pki).status_code == 200
    assert call(guard, "/filter", "client", pki).status_code == 403


def test_server_only_tls_checks_no_identity(pki, dead_kubeconfig, start_guard, tmp_path):
    guard = start_guard(["--kubeconfig", dead_kubeconfig, "--get-timeout", "0.2", "--no-prepare",
                         "--audit-db", str(tmp_path / "audit.db")], tls=tls_files(pki, client_ca=False),
                        wait="/healthz")
    for path in CALLS:
        expected = 503 if path == "/readyz" else 200  # the apiserver is dead
        assert call(guard, path, None, pki).status_code == expected, path
        assert call(guard, path, "apiserver", pki).status_code == expected, path  # a certificate is not even asked for


def test_help_says_where_identities_are_checked():
    from click.testing import CliRunner

    from guard.cli import main

    text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output.split())
    assert "No client identities are checked." in text  # --insecure-http
    assert "without it (server-only TLS) and with --insecure-http there is no identity check" in text
