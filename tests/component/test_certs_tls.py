"""ReloadingTLS on a real TLS server: mTLS, protocol floor, and renewal under load.

The server is the stdlib ``http.server`` over real sockets in a thread. Two
ways of using :class:`guard.serving.tls.ReloadingTLS` are exercised:

* ``fixed``: the listening socket is wrapped once with ``context()``; only the
  handshake callback can move connections to a renewed certificate;
* ``per-connection``: ``context()`` is called for every accepted connection, as
  gunicorn's ``ssl_context`` hook does.
"""

from __future__ import annotations

import http.client
import http.server
import os
import shutil
import socket
import ssl
import threading
from pathlib import Path

import pytest
from cryptography import x509

from guard.serving import tls as tls_module
from guard.tools.certs import generate
from guard.lab.harness import eventually
from guard.serving.tls import ReloadingTLS, TLSError

pytestmark = pytest.mark.timeout(120)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so one connection can span a renewal

    def do_GET(self) -> None:  # noqa: N802
        self.server.served += 1
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class TLSServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, tls: ReloadingTLS, per_connection: bool) -> None:
        self.tls, self.per_connection, self.served = tls, per_connection, 0
        super().__init__(("127.0.0.1", 0), Handler)
        if not per_connection:
            self.socket = tls.context().wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def get_request(self):
        sock, addr = self.socket.accept()
        if self.per_connection:
            sock = self.tls.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def finish_request(self, request, client_address) -> None:
        request.settimeout(10)
        request.do_handshake()  # in the handler thread: a bad client never blocks accept()
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        pass  # refused handshakes are the point of several tests


@pytest.fixture
def serve():
    servers: list[TLSServer] = []

    def start(tls: ReloadingTLS, per_connection: bool = False) -> TLSServer:
        srv = TLSServer(tls, per_connection)
        threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    generate(d)
    return d


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("other")
    generate(d)
    return d


def client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


def get(srv: TLSServer, ctx: ssl.SSLContext, host: str = "127.0.0.1") -> tuple[int, int]:
    """One request on a fresh connection: (status, serial of the certificate served)."""
    conn = http.client.HTTPSConnection(host, srv.server_address[1], context=ctx, timeout=10)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        resp.read()
        der = conn.sock.getpeercert(binary_form=True)
        return resp.status, x509.load_der_x509_certificate(der).serial_number
    finally:
        conn.close()


def serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


# --- mTLS and protocol floor -------------------------------------------------


@pytest.mark.parametrize("per_connection", [False, True], ids=["fixed", "per-connection"])
def test_mtls_accepts_the_scheduler_client_cert(certs, serve, per_connection):
    srv = serve(ReloadingTLS(certs / "tls.crt", certs / "tls.key", client_ca=certs / "ca.crt"), per_connection)
    ctx = client_context(certs / "ca.crt", certs / "client.crt", certs / "client.key")
    assert get(srv, ctx) == (200, serial(certs / "tls.crt"))
    assert get(srv, ctx, host="localhost")[0] == 200  # with SNI as well as without (IP)


REFUSED = [
    ("no-client-cert", lambda c, o: (None, None)),
    ("client-cert-from-other-ca", lambda c, o: (o / "client.crt", o / "client.key")),
    ("serving-cert-as-client-cert", lambda c, o: (c / "tls.crt", c / "tls.key")),  # our CA, but serverAuth only
]


@pytest.mark.parametrize("pick", [r[1] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_mtls_refuses(certs, other_certs, serve, pick):
    srv = serve(ReloadingTLS(certs / "tls.crt", certs / "tls.key", client_ca=certs / "ca.crt"))
    cert, key = pick(certs, other_certs)
    with pytest.raises(OSError):  # ssl.SSLError or a reset, depending on when TLS 1.3 reports it
        get(srv, client_context(certs / "ca.crt", cert, key))
    assert srv.served == 0


def test_without_client_ca_no_client_cert_needed(certs, serve):
    srv = serve(ReloadingTLS(certs / "tls.crt", certs / "tls.key"))
    assert get(srv, client_context(certs / "ca.crt"))[0] == 200


def test_client_refuses_guard_with_other_ca(certs, other_certs, serve):
    srv = serve(ReloadingTLS(certs / "tls.crt", certs / "tls.key"))
    with pytest.raises(ssl.SSLCertVerificationError):
        get(srv, client_context(other_certs / "ca.crt"))


def test_tls_1_1_refused_by_the_server(certs, serve):
    srv = serve(ReloadingTLS(certs / "tls.crt", certs / "tls.key"))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # let this client offer TLS 1.1 at all
    ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1_1
    with socket.create_connection(srv.server_address, timeout=10) as raw:
        with pytest.raises(ssl.SSLError) as e:
            ctx.wrap_socket(raw)
    assert e.value.reason in {"TLSV1_ALERT_PROTOCOL_VERSION", "UNSUPPORTED_PROTOCOL"}, e.value
    # and TLS 1.2 exactly is accepted
    ctx12 = client_context(certs / "ca.crt")
    ctx12.maximum_version = ssl.TLSVersion.TLSv1_2
    assert get(srv, ctx12)[0] == 200


def test_unusable_files_refused_at_start(tmp_path, certs):
    with pytest.raises(TLSError) as e:
        ReloadingTLS(tmp_path / "missing.crt", certs / "tls.key")
    assert str(e.value).startswith(f"cannot load TLS files {tmp_path / 'missing.crt'}, {certs / 'tls.key'}:")


# --- renewal --------------------------------------------------------------


class Load:
    """A client hammering the server with fresh connections; counts failures and serials seen."""

    def __init__(self, srv: TLSServer, ctx: ssl.SSLContext) -> None:
        self.srv, self.ctx = srv, ctx
        self.ok, self.failures, self.serials = 0, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                status, s = get(self.srv, self.ctx)
            except OSError as e:
                self.failures.append(repr(e))
                continue
            if status != 200:
                self.failures.append(status)
            else:
                self.ok += 1
                if not self.serials or self.serials[-1] != s:
                    self.serials.append(s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def wait_for(self, wanted: int, deadline: float = 20.0) -> None:
        eventually(lambda: self.serials and self.serials[-1] == wanted, deadline,
                   what=f"certificate serial {wanted} served", interval=0.02)

    def wait_requests(self, n: int, deadline: float = 20.0) -> None:
        start = self.ok + len(self.failures)
        eventually(lambda: self.ok + len(self.failures) >= start + n, deadline, what=f"{n} more requests answered",
                   interval=0.01)


def secret_volume(root: Path, version: str, source: Path) -> Path:
    """Lay out ``root`` like a kubelet Secret volume: files -> ..data/ -> ..<version>/."""
    d = root / f"..{version}"
    d.mkdir()
    for name in ("ca.crt", "tls.crt", "tls.key"):
        shutil.copy2(source / name, d / name)
    tmp = root / "..data_tmp"
    tmp.symlink_to(d.name)
    os.replace(tmp, root / "..data")  # the atomic swap the kubelet and cert-manager's csi driver do
    for name in ("ca.crt", "tls.crt", "tls.key"):
        if not (root / name).is_symlink():
            (root / name).symlink_to(f"..data/{name}")
    return root


def renewed(tmp: Path, ca_dir: Path, name: str) -> Path:
    """A new serving certificate from the same CA (what cert-manager's renewal produces)."""
    d = tmp / name
    d.mkdir()
    shutil.copy2(ca_dir / "ca.crt", d / "ca.crt")
    shutil.copy2(ca_dir / "ca.key", d / "ca.key")
    generate(d, renew=True)
    return d


@pytest.mark.parametrize("per_connection", [False, True], ids=["fixed", "per-connection"])
def test_symlink_renewal_under_load_zero_failures(tmp_path, certs, serve, per_connection):
    (tmp_path / "vol").mkdir()
    vol = secret_volume(tmp_path / "vol", "v1", certs)
    tls = ReloadingTLS(vol / "tls.crt", vol / "tls.key", client_ca=vol / "ca.crt", check_interval=0.05)
    srv = serve(tls, per_connection)
    ctx = client_context(certs / "ca.crt", certs / "client.crt", certs / "client.key")
    v2 = renewed(tmp_path, certs, "v2")
    v3 = renewed(tmp_path, certs, "v3")

    # a keep-alive connection opened before the renewal
    keep = http.client.HTTPSConnection("127.0.0.1", srv.server_address[1], context=ctx, timeout=10)
    keep.request("GET", "/")
    assert keep.getresponse().read() == b"ok"

    with Load(srv, ctx) as load:
        load.wait_requests(20)
        secret_volume(vol, "v2", v2)
        load.wait_for(serial(v2 / "tls.crt"))
        load.wait_requests(20)
        secret_volume(vol, "v3", v3)
        load.wait_for(serial(v3 / "tls.crt"))
        load.wait_requests(20)

    assert load.failures == []
    assert load.serials == [serial(certs / "tls.crt"), serial(v2 / "tls.crt"), serial(v3 / "tls.crt")]
    assert tls.reloads == 2 and tls.check() is None
    # the connection established before both renewals still works, on its original certificate
    keep.request("GET", "/")
    assert keep.getresponse().read() == b"ok"
    assert x509.load_der_x509_certificate(keep.sock.getpeercert(binary_form=True)).serial_number == serial(certs / "tls.crt")
    keep.close()


def test_a_stamp_taken_mid_swap_loads_the_renewed_pair_once(tmp_path, certs, monkeypatch):
    """The files' stamp is three stats: one taken before a ``..data`` swap and two after (scripted
    here) must not make the guard load the new pair now and again at the next check."""
    (tmp_path / "vol").mkdir()
    vol = secret_volume(tmp_path / "vol", "v1", certs)
    tls = ReloadingTLS(vol / "tls.crt", vol / "tls.key", check_interval=0)
    v2 = renewed(tmp_path, certs, "v2")
    secret_volume(vol, "v2", v2)
    real = tls_module._stamp
    stamps: list[tuple] = []

    def first_mid_swap(paths):
        stamp = real(paths)
        stamps.append(stamp)
        return (("before the swap",), *stamp[1:]) if len(stamps) == 1 else stamp

    monkeypatch.setattr(tls_module, "_stamp", first_mid_swap)
    tls.context()
    assert tls.reloads == 1
    tls.context()
    tls.context()
    assert tls.reloads == 1, "the renewed pair was loaded twice"
    assert tls.check() is None


def test_in_place_renewal_and_broken_pair_keep_serving(tmp_path, certs, serve):
    d = tmp_path / "certs"
    shutil.copytree(certs, d)
    tls = ReloadingTLS(d / "tls.crt", d / "tls.key", check_interval=0.05, failure_grace=0)
    srv = serve(tls)
    ctx = client_context(d / "ca.crt")
    first = serial(d / "tls.crt")
    other = renewed(tmp_path, certs, "other")

    with Load(srv, ctx) as load:
        load.wait_requests(10)
        # half a renewal: the new certificate without its key. Kept serving the old pair.
        shutil.copy2(other / "tls.crt", d / "tls.crt")
        load.wait_requests(10)
        eventually(lambda: tls.check() is not None, 10, what="the half renewal reported", interval=0.02)
        reason = tls.check()
        load.wait_requests(10)
        # the key arrives: the pair loads
        shutil.copy2(other / "tls.key", d / "tls.key")
        load.wait_for(serial(other / "tls.crt"))
        load.wait_requests(10)

    assert load.failures == []
    assert load.serials == [first, serial(other / "tls.crt")]
    assert reason is not None and reason.startswith("cannot load renewed TLS files (")
    assert reason.endswith("still serving the certificate loaded before")
    assert tls.check() is None and tls.reloads == 1

    # ghost-guard certs --renew in place (atomic replace of the files) is picked up too
    generate(d, renew=True)
    eventually(lambda: get(srv, ctx)[1] == serial(d / "tls.crt"), 10, what="the renewed certificate served",
               interval=0.02)
    assert get(srv, ctx) == (200, serial(d / "tls.crt"))
    assert tls.reloads == 2


def test_check_reports_expired_certificate(tmp_path, certs):
    import datetime as dt

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "expired")])
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - dt.timedelta(days=2)).not_valid_after(now - dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    (tmp_path / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "tls.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    tls = ReloadingTLS(tmp_path / "tls.crt", tmp_path / "tls.key")
    expired = now - dt.timedelta(days=1)
    assert tls.check() == f"serving certificate {tmp_path / 'tls.crt'} expired at {expired:%Y-%m-%d %H:%M}Z"
    assert ReloadingTLS(certs / "tls.crt", certs / "tls.key").check() is None
