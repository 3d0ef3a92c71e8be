"""The shipped pieces against the real ``ghost-guard serve`` and the lab apiserver.

Certificates come from ``ghost-guard certs`` (as docs/INSTALL.md does); the
guard starts with the Deployment's own arguments (paths moved to a temporary
directory, the port made free); the probes are the Deployment's exec commands
and the Dockerfile's HEALTHCHECK, run as processes. kube-scheduler's side is
played by a client that dials 127.0.0.1 and checks the certificate against
``serverName`` ghost-guard.ghost-guard.svc, as the scheduler config says.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from clirun import ghost_guard  # `ghost-guard certs` in-process: the same command object, no interpreter start
from cryptography import x509

from guard.lab.harness import GuardProcess, eventually, free_port

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "manifests"
TLS_DIR = "/etc/ghost-guard/tls"
SERVER_NAME = "ghost-guard.ghost-guard.svc"


def deployment_container() -> dict:
    (dep,) = [d for d in yaml.safe_load_all((MANIFESTS / "base/deployment.yaml").read_text()) if d]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def sidecar_container() -> dict:
    pod = yaml.safe_load((MANIFESTS / "overlays/sidecar/node/kube-scheduler.yaml").read_text())
    (c,) = [c for c in pod["spec"]["containers"] if c["name"] == "ghost-guard"]
    return c


def healthcheck_command() -> list[str]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    (line,) = [ln for ln in text.splitlines() if ln.startswith("HEALTHCHECK ")]
    return json.loads(line.split(" CMD ", 1)[1])


@pytest.fixture
def run_guard(start_guard, tmp_path):
    """``run_guard(args, port)``: ``python -m guard *args`` as a manifest spells them (no flag added), with
    none of the caller's ``GHOST_GUARD_*`` but the audit database (the manifests' /var/lib/ghost-guard) moved."""
    started = 0

    def start(args: list[str], port: int) -> GuardProcess:
        nonlocal started
        env = {"GHOST_GUARD_AUDIT_DB": str(tmp_path / f"audit-{started}.db")}
        started += 1
        return start_guard(args, port=port, verbatim=True, clean_env=True, env=env, wait=None)

    return start


def wait_until(check, what: str, guard: GuardProcess | None = None):
    """Poll ``check`` for 30 s; connection errors mean "not yet"; the guard must stay up."""
    return eventually(check, 30.0, what=what, ignore=(OSError,), process=guard)


def https_request(port: int, path: str, ctx: ssl.SSLContext, *, method: str = "GET", body: bytes | None = None,
                  server_name: str = SERVER_NAME) -> tuple[int, bytes, int]:
    """One request on a fresh connection to 127.0.0.1, verifying the certificate for ``server_name``
    (kube-scheduler's urlPrefix IP + tlsConfig.serverName). Returns (status, body, serving serial)."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    with ctx.wrap_socket(raw, server_hostname=server_name) as tls:
        serial = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number
        head = f"{method} {path} HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        tls.sendall(head.encode() + b"\r\n" + (body or b""))
        resp = http.client.HTTPResponse(tls)
        resp.begin()
        return resp.status, resp.read(), serial


def client_ctx(certs: Path, *, cert: bool = True, role: str = "client") -> ssl.SSLContext:
    """``role``: "client" (kube-scheduler's, for the verbs) or "monitoring" (the probes and /metrics)."""
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if cert:
        ctx.load_cert_chain(str(certs / f"{role}.crt"), str(certs / f"{role}.key"))
    return ctx


def serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


# The ghost-guard-tls Secret's keys (docs/INSTALL.md): no kube-scheduler or apiserver key in the cluster.
SECRET_FILES = ("ca.crt", "tls.crt", "tls.key", "monitoring.crt", "monitoring.key")


def kubelet_secret_volume(root: Path, version: str, source: Path) -> None:
    """Lay out ``root`` as the kubelet mounts a Secret: name -> ..data/name, ..data -> ..<version> (swapped atomically)."""
    d = root / f"..{version}"
    d.mkdir(parents=True)
    for name in SECRET_FILES:
        shutil.copy2(source / name, d / name)
    tmp = root / "..data_tmp"
    tmp.symlink_to(d.name)
    os.replace(tmp, root / "..data")
    for name in SECRET_FILES:
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")


def deployment_args(tls_dir: Path, port: int, kubeconfig: str) -> list[str]:
    """The Deployment's args, with the Secret mount moved to ``tls_dir`` and a free port."""
    out = []
    for arg in deployment_container()["args"]:
        arg = arg.replace(TLS_DIR, str(tls_dir))
        if arg.startswith("--bind="):
            assert arg == "--bind=0.0.0.0:8443"
            arg = f"--bind=127.0.0.1:{port}"
        out.append(arg)
    return out + [f"--kubeconfig={kubeconfig}"]


@pytest.fixture
def installed(tmp_path, shared_lab, run_guard):
    """`ghost-guard certs` + the guard started with the Deployment's arguments on a kubelet-style volume."""
    certs = tmp_path / "certs"
    r = ghost_guard("certs", "--out", str(certs))
    assert r.returncode == 0, r.stderr
    vol = tmp_path / "secret"
    kubelet_secret_volume(vol, "v1", certs)
    port = free_port()
    g = run_guard(deployment_args(vol, port, shared_lab.kubeconfig(0)), port)
    ctx = client_ctx(certs, role="monitoring")
    status = {}

    def ready() -> bool:
        status["last"] = https_request(port, "/readyz", ctx)[:2]
        return status["last"][0] == 200

    try:
        wait_until(ready, "guard ready over mTLS", guard=g)
    except AssertionError as e:
        raise AssertionError(f"{e}; last /readyz {status.get('last')}\n{g.logs()}") from None
    return {"certs": certs, "vol": vol, "port": port, "guard": g, "tmp": tmp_path}


def probe_env(vol: Path, *, with_cert: bool = True) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GHOST_GUARD_")}
    if with_cert:
        for e in deployment_container()["env"]:
            if e["name"].startswith("GHOST_GUARD_PROBE_"):
                env[e["name"]] = e["value"].replace(TLS_DIR, str(vol))
    return env


def run_probe(command: list[str], port: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable if c == "python" else c.replace(":8443/", f":{port}/") for c in command]
    return subprocess.run(command, capture_output=True, text=True, timeout=30, env=env)


def test_mtls_with_generated_certs(installed):
    certs, port = installed["certs"], installed["port"]
    ok = https_request(port, "/healthz", client_ctx(certs, role="monitoring"))
    assert ok[0] == 200 and ok[2] == serial(certs / "tls.crt")
    with pytest.raises(OSError):  # no client certificate: refused during or right after the handshake
        https_request(port, "/healthz", client_ctx(certs, cert=False))
    other = installed["tmp"] / "other"
    assert ghost_guard("certs", "--out", str(other)).returncode == 0
    foreign = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    foreign.load_cert_chain(str(other / "client.crt"), str(other / "client.key"))
    with pytest.raises(OSError):  # a client certificate from another CA
        https_request(port, "/healthz", foreign)
    with pytest.raises(ssl.SSLCertVerificationError):  # the scheduler checks the guard against ITS ca.crt
        https_request(port, "/healthz", ssl.create_default_context(cafile=str(other / "ca.crt")))
    assert https_request(port, "/healthz", client_ctx(certs, role="monitoring"))[0] == 200  # refusals did not hurt


def test_scheduler_filter_call_over_mtls(installed):
    """What kube-scheduler sends with nodeCacheCapable: true, through urlPrefix IP + serverName."""
    body = json.dumps({"Pod": {"metadata": {"name": "never-existed", "namespace": "default", "uid": "0000-ghost"},
                               "spec": {}}, "Nodes": None, "NodeNames": ["node-a", "node-b"]}).encode()
    status, payload, _ = https_request(installed["port"], "/filter", client_ctx(installed["certs"]), method="POST", body=body)
    assert status == 200, payload
    reply = json.loads(payload)
    assert {"NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"} <= set(reply)
    assert sorted(reply["FailedAndUnresolvableNodes"]) == ["node-a", "node-b"]  # quorum GET: no such pod


def test_deployment_exec_probes_and_docker_healthcheck(installed):
    vol, port = installed["vol"], installed["port"]
    c = deployment_container()
    for probe in ("livenessProbe", "readinessProbe"):
        r = run_probe(c[probe]["exec"]["command"], port, probe_env(vol))
        assert r.returncode == 0, (probe, r.stderr)
        refused = run_probe(c[probe]["exec"]["command"], port, probe_env(vol, with_cert=False))
        assert refused.returncode != 0, probe  # the port requires the client certificate
    r = run_probe(healthcheck_command(), port, probe_env(vol))
    assert r.returncode == 0, r.stderr


def test_renewal_under_load_zero_failures(installed):
    certs, vol, port, tmp = installed["certs"], installed["vol"], installed["port"], installed["tmp"]
    renewed = tmp / "renewed"
    renewed.mkdir()
    shutil.copy2(certs / "ca.crt", renewed / "ca.crt")
    shutil.copy2(certs / "ca.key", renewed / "ca.key")
    r = ghost_guard("certs", "--out", str(renewed), "--renew")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("caBundle: ")
    ctx = client_ctx(certs, role="monitoring")
    failures: list[str] = []
    serials: list[int] = []
    on_last: list[int] = [0]  # calls answered with the newest serial
    done = threading.Event()

    def load() -> None:
        while not done.is_set():
            try:
                status, _, s = https_request(port, "/healthz", ctx)
            except OSError as e:
                failures.append(repr(e))
                continue
            if status != 200:
                failures.append(f"HTTP {status}")
            elif not serials or serials[-1] != s:
                serials.append(s)
                on_last[0] = 1
            else:
                on_last[0] += 1

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(serials) >= 1, "load running")
        kubelet_secret_volume(vol, "v2", renewed)  # the kubelet's atomic ..data swap
        wait_until(lambda: serials and serials[-1] == serial(renewed / "tls.crt"), "renewed certificate served")
        wait_until(lambda: on_last[0] >= 20, "20 calls on the new certificate")  # the load goes on with it
    finally:
        done.set()
        for t in threads:
            t.join(30)
    assert failures == []
    assert sorted(set(serials)) == sorted({serial(certs / "tls.crt"), serial(renewed / "tls.crt")})
    assert installed["guard"].proc.poll() is None  # no restart


def test_sidecar_arguments_serve_the_static_pod_probes(shared_lab, run_guard):
    c = sidecar_container()
    port = free_port()
    args = []
    for arg in c["args"]:
        if arg.startswith("--bind="):
            assert arg == "--bind=127.0.0.1:8443"
            arg = f"--bind=127.0.0.1:{port}"
        elif arg.startswith("--kubeconfig="):
            arg = f"--kubeconfig={shared_lab.kubeconfig(0)}"
        args.append(arg)
    g = run_guard(args, port)

    def get(path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        finally:
            conn.close()

    wait_until(lambda: get(c["readinessProbe"]["httpGet"]["path"]) == 200, "sidecar ready", guard=g)
    assert get(c["livenessProbe"]["httpGet"]["path"]) == 200
    env = {k: v for k, v in os.environ.items() if not k.startswith("GHOST_GUARD_")}
    env["GHOST_GUARD_PROBE_URL"] = f"http://127.0.0.1:{port}/healthz"
    r = subprocess.run([sys.executable if a == "python" else a for a in healthcheck_command()], capture_output=True,
                       text=True, timeout=30, env=env)
    assert r.returncode == 0, r.stderr
