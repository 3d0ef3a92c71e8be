"""The etcd fault proxy on REAL Kubernetes: a kube-apiserver replica behind it goes stale as in the incident.

Real etcd, two real kube-apiserver replicas (A direct, B through an ``EtcdProxy``). With
``drop_deletes`` on one pod, B's watch cache keeps serving the pod after its deletion
(``LIST resourceVersion=0``) while A's does not, B's quorum GET says 404, and B's cache
resourceVersion keeps advancing; with ``freeze_watch`` B's cache stops, and resumes on unfreeze.

The apiservers are started by a small helper local to this module (``tests/real/conftest.py``'s
``real_lab`` fixture is the shared one). Skipped, with one reason, without a kube-apiserver binary.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc", reason="real tier: the etcd proxy needs grpcio (the lab extra)")
requests = pytest.importorskip("requests")

from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from guard.lab.etcd import Etcd, free_port  # noqa: E402
from guard.lab.harness import eventually  # noqa: E402
from guard.lab.pki import CA  # noqa: E402
from guard.lab.real.etcdproxy import EtcdProxy  # noqa: E402


def _kube_apiserver() -> str | None:
    """GHOST_GUARD_KUBE_BIN, then KUBEBUILDER_ASSETS; with neither set, this machine's /work/kube-bin
    (until tests/real/conftest.py's binary lookup, guard/lab/real/binaries.py, replaces this)."""
    dirs = [d for d in (os.environ.get("GHOST_GUARD_KUBE_BIN"), os.environ.get("KUBEBUILDER_ASSETS")) if d]
    for d in dirs or ["/work/kube-bin"]:
        if os.access(os.path.join(d, "kube-apiserver"), os.X_OK):
            return os.path.join(d, "kube-apiserver")
    return None


KUBE_APISERVER = _kube_apiserver()
if KUBE_APISERVER is None:
    pytest.skip("real tier: no kube-apiserver binary (set GHOST_GUARD_KUBE_BIN or KUBEBUILDER_ASSETS)",
                allow_module_level=True)
pytestmark = pytest.mark.real

TOKEN = "ghost-proxy-test-admin-token"


class Apiserver:
    """One real kube-apiserver replica on 127.0.0.``index`` (own process group; stopped before etcd)."""

    def __init__(self, index: int, etcd_url: str, workdir: Path, ca: CA) -> None:
        self.host = f"127.0.0.{index}"
        self.port = free_port(self.host)
        self.url = f"https://{self.host}:{self.port}"
        self.dir = workdir / f"apiserver-{index}"
        self.dir.mkdir()
        pair = ca.serving(self.host)
        (self.dir / "tls.crt").write_bytes(pair.cert_pem)
        (self.dir / "tls.key").write_bytes(pair.key_pem)
        self.log_path = self.dir / "apiserver.log"
        self.cmd = [
            str(KUBE_APISERVER),
            f"--etcd-servers={etcd_url}",
            f"--bind-address={self.host}", f"--secure-port={self.port}",
            f"--advertise-address=192.0.2.{index}", "--endpoint-reconciler-type=lease",
            f"--tls-cert-file={self.dir / 'tls.crt'}", f"--tls-private-key-file={self.dir / 'tls.key'}",
            f"--cert-dir={self.dir}",
            f"--token-auth-file={workdir / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={workdir / 'sa.pub'}",
            f"--service-account-signing-key-file={workdir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--enable-priority-and-fairness=false",
        ]
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {TOKEN}"
        self.ca = str(workdir / "ca.crt")  # passed on each call: REQUESTS_CA_BUNDLE would override session.verify
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def start_ready(self, attempts: int = 2) -> None:
        """Start and wait for ``/readyz``. On a loaded machine a starting apiserver may exit when its
        post-start hooks time out (``rbac/bootstrap-roles``); it is started again once."""
        for attempt in range(attempts):
            self.start()
            try:
                self.wait_ready()
                return
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                print(f"kube-apiserver {self.host} exited while starting; starting it again:\n{self.log_tail(5)}")

    def wait_ready(self, timeout: float = 120.0) -> None:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"kube-apiserver {self.host} exited: {self.log_tail()}")
            return self.session.get(self.url + "/readyz", timeout=5, verify=self.ca).status_code == 200

        eventually(ready, timeout, what=f"kube-apiserver {self.host} ready", interval=0.2,
                   ignore=(requests.RequestException,))

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # --- API calls ------------------------------------------------------------

    def call(self, method: str, path: str, **kw) -> requests.Response:
        return self.session.request(method, self.url + path, timeout=30, verify=self.ca, **kw)

    def cached_pods(self, namespace: str = "default") -> tuple[int, set[str]]:
        """(list resourceVersion, pod names) of ``LIST resourceVersion=0``: this replica's watch cache."""
        r = self.call("GET", f"/api/v1/namespaces/{namespace}/pods", params={"resourceVersion": "0"})
        r.raise_for_status()
        body = r.json()
        return int(body["metadata"]["resourceVersion"]), {p["metadata"]["name"] for p in body["items"]}


def pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}


@pytest.fixture(scope="module")
def cluster():
    """(A, B, B's proxy): etcd, replica A straight on etcd, replica B through an EtcdProxy."""
    workdir = Path(tempfile.mkdtemp(prefix="ghost-real-proxy-"))
    ca = CA()
    (workdir / "ca.crt").write_bytes(ca.cert_pem)
    (workdir / "tokens.csv").write_text(f'{TOKEN},admin,admin-uid,"system:masters"\n')
    sa_key = ec.generate_private_key(ec.SECP256R1())
    (workdir / "sa.key").write_bytes(sa_key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.TraditionalOpenSSL,
                                                          serialization.NoEncryption()))
    (workdir / "sa.pub").write_bytes(sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    etcd = Etcd()
    proxy = None
    servers: list[Apiserver] = []
    try:
        etcd.start()
        proxy = EtcdProxy(f"127.0.0.1:{etcd.client_port}").start()
        a = Apiserver(1, etcd.url, workdir, ca)
        b = Apiserver(2, proxy.url, workdir, ca)
        servers = [a, b]
        for s in servers:  # one at a time: two starting together overload a 2-core machine
            s.start_ready()
        sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
        r = a.call("POST", "/api/v1/namespaces/default/serviceaccounts", json=sa)
        assert r.status_code in (201, 409), r.text
        yield a, b, proxy
    finally:
        for s in servers:  # apiservers before etcd (and before the proxy B dials)
            s.stop()
        if proxy is not None:
            proxy.close()
        etcd.close()
        shutil.rmtree(workdir, ignore_errors=True)


def create(server: Apiserver, name: str) -> int:
    r = server.call("POST", "/api/v1/namespaces/default/pods", json=pod(name))
    assert r.status_code == 201, r.text
    return int(r.json()["metadata"]["resourceVersion"])


def test_a_lost_delete_leaves_a_ghost_in_the_proxied_replica(cluster):
    a, b, proxy = cluster
    proxy.faults.clear()
    rv = create(a, "ghost")
    eventually(lambda: all(s.cached_pods()[0] >= rv and "ghost" in s.cached_pods()[1] for s in (a, b)), 30,
               what="both caches hold the new pod")
    proxy.faults.drop_deletes("default", "ghost")

    r = a.call("DELETE", "/api/v1/namespaces/default/pods/ghost")
    assert r.status_code == 200, r.text
    dropped = eventually(lambda: [e for e in proxy.faults.dropped if e.type == "DELETED"], 30,
                         what="the proxy dropped the DELETE")
    delete_rv = dropped[0].resource_version
    assert (dropped[0].namespace, dropped[0].name) == ("default", "ghost")

    eventually(lambda: "ghost" not in a.cached_pods()[1], 30, what="replica A's cache lost the pod")
    # B's cache went past the deletion (progress notifications carry the revision on) yet holds the pod
    b_rv = eventually(lambda: (lambda c: c[0] if c[0] >= delete_rv else 0)(b.cached_pods()), 30,
                      what="replica B's cache at or past the delete revision")
    assert "ghost" in b.cached_pods()[1]
    assert b_rv >= delete_rv
    # a quorum read through B goes to etcd: no such pod
    assert b.call("GET", "/api/v1/namespaces/default/pods/ghost").status_code == 404
    assert a.call("GET", "/api/v1/namespaces/default/pods/ghost").status_code == 404

    # other writes still reach B's cache and move its resourceVersion on; the ghost stays
    later = create(a, "after-ghost")
    eventually(lambda: {"after-ghost", "ghost"} <= b.cached_pods()[1] and b.cached_pods()[0] >= later, 30,
               what="replica B's cache took a later write")
    assert b.cached_pods()[0] > b_rv
    assert "ghost" not in a.cached_pods()[1]
    kinds = sorted(e.type for e in proxy.faults.dropped if e.name == "ghost")
    assert "DELETED" in kinds, kinds
    proxy.faults.clear()


def test_a_frozen_watch_stops_the_proxied_cache_until_unfrozen(cluster):
    a, b, proxy = cluster
    proxy.faults.clear()
    first = create(a, "before-freeze")
    eventually(lambda: b.cached_pods()[0] >= first, 30, what="replica B's cache caught up")
    proxy.faults.freeze_watch()
    # a write that B's cache may still see (it was on its way), then one it must not
    create(a, "frozen-0")
    frozen_rv = b.cached_pods()[0]
    rv = create(a, "frozen-1")
    eventually(lambda: a.cached_pods()[0] >= rv and "frozen-1" in a.cached_pods()[1], 30,
               what="replica A's cache took the write")
    rv_b, names_b = b.cached_pods()
    assert "frozen-1" not in names_b and rv_b < rv
    # B's quorum read still works: only its watch is frozen
    assert b.call("GET", "/api/v1/namespaces/default/pods/frozen-1").status_code == 200
    assert b.cached_pods()[0] <= max(frozen_rv, rv_b)

    proxy.faults.unfreeze_watch()
    eventually(lambda: "frozen-1" in b.cached_pods()[1] and b.cached_pods()[0] >= rv, 30,
               what="replica B's cache resumed after unfreeze")
