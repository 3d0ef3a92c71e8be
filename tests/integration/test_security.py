"""Security properties of a real ``ghost-guard serve`` and the shipped manifests.

- TLS 1.2 is the floor: a TLS 1.0/1.1 ClientHello (raw bytes, independent of
  the local OpenSSL's client policy) gets a fatal ``protocol_version`` alert;
- with ``--client-ca`` a client without a certificate, or with one from another
  CA, is refused in the handshake: no handler runs (no access-log line, no
  request counted);
- no bearer token, private key or certificate reaches the logs, stdout or an
  error body, even at ``--log-level debug`` with failing apiserver calls;
- the audit CLI refuses paths and input that would escape its store (exit 2,
  one clear line, foreign files untouched, nothing created);
- the RBAC in ``manifests/`` grants exactly what ``guard/`` calls, derived from
  the code (every kubernetes client call) and from the client's own paths. The CLI's
  light twin of the client (guard/kube/api.py) has the same method names and sends the
  same requests for every method the code calls (tests/component/test_light_api.py), so the
  derivation covers it too.
"""

from __future__ import annotations

import ast
import base64
import inspect
import os
import re
import socket
import sqlite3
import ssl
import struct
import subprocess
import time
from pathlib import Path

import orjson
import pytest
import requests
import yaml
from clirun import ghost_guard

from guard.tools.certs import generate
from guard.lab.harness import GuardProcess, eventually, make_ghost, tls_files

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)

NAMES = ["node-a", "node-b"]


# --- TLS ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    base = tmp_path_factory.mktemp("pki")
    return {"ours": generate(base / "ours", ips=["127.0.0.1"]), "other": generate(base / "other", ips=["127.0.0.1"])}


@pytest.fixture(scope="module")
def mtls_guard(pki, dead_kubeconfig, tmp_path_factory, module_guard):
    ours = pki["ours"]
    tls = tls_files(ours)
    db = tmp_path_factory.mktemp("mtls") / "audit.db"
    return module_guard(["--kubeconfig", dead_kubeconfig, "--audit-db", str(db), "--get-timeout", "0.2"], tls=tls,
                        wait="/healthz")


def client_hello(version: int) -> bytes:
    """A minimal ClientHello offering only ``version`` (0x0301 TLS 1.0, 0x0302 TLS 1.1), no supported_versions."""
    suites = [0xC02B, 0xC02F, 0xC009, 0xC013, 0xC00A, 0xC014, 0x002F, 0x0035]
    sni = b"localhost"
    ext = b""
    server_name = struct.pack("!BH", 0, len(sni)) + sni
    ext += struct.pack("!HH", 0x0000, len(server_name) + 2) + struct.pack("!H", len(server_name)) + server_name
    groups = struct.pack("!HHH", 0x001D, 0x0017, 0x0018)
    ext += struct.pack("!HHH", 0x000A, len(groups) + 2, len(groups)) + groups
    ext += struct.pack("!HHBB", 0x000B, 2, 1, 0)  # ec_point_formats: uncompressed
    sigalgs = struct.pack("!HHHHH", 0x0403, 0x0804, 0x0401, 0x0503, 0x0501)
    ext += struct.pack("!HHH", 0x000D, len(sigalgs) + 2, len(sigalgs)) + sigalgs
    body = struct.pack("!H", version) + os.urandom(32) + b"\x00"
    body += struct.pack("!H", 2 * len(suites)) + b"".join(struct.pack("!H", s) for s in suites)
    body += b"\x01\x00" + struct.pack("!H", len(ext)) + ext
    handshake = b"\x01" + struct.pack("!I", len(body))[1:] + body
    return b"\x16" + struct.pack("!HH", 0x0301, len(handshake)) + handshake


def first_record(port: int, hello: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(hello)
        data = b""
        while len(data) < 7:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        return data


@pytest.mark.parametrize("version,label", [(0x0301, "TLS 1.0"), (0x0302, "TLS 1.1")])
def test_old_tls_gets_a_protocol_version_alert(mtls_guard, version, label):
    data = first_record(mtls_guard.port, client_hello(version))
    # content type 21 (alert), level 2 (fatal), description 70 (protocol_version); never 22 (a ServerHello)
    assert data[:1] == b"\x15", f"{label}: server answered {data[:16]!r}, not an alert"
    assert data[5:7] == b"\x02\x46", f"{label}: alert {data[5:7]!r}"


def test_the_raw_hello_is_a_real_probe(mtls_guard):
    """The same hand-made hello offering TLS 1.2 gets a ServerHello: the alert above is about the version."""
    data = first_record(mtls_guard.port, client_hello(0x0303))
    assert data[:1] == b"\x16", data[:16]


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_tls12_and_13_with_our_client_cert_are_served(mtls_guard, pki, version):
    ours = pki["ours"]
    ctx = ssl.create_default_context(cafile=str(ours.ca_cert))
    ctx.minimum_version = ctx.maximum_version = version
    ctx.load_cert_chain(str(ours.monitoring_cert), str(ours.monitoring_key))  # /healthz is the monitoring role's
    with socket.create_connection(("127.0.0.1", mtls_guard.port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            assert s.version() == {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}[version]
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


def access_lines(g: GuardProcess) -> list[dict]:
    return g.log_records("guard.access")


@pytest.mark.parametrize("who", ["no-certificate", "certificate-from-another-ca", "ca-certificate-as-client"])
def test_mtls_refuses_bad_clients_in_the_handshake(mtls_guard, pki, who):
    ours, other = pki["ours"], pki["other"]
    before_lines = len(access_lines(mtls_guard))
    before_count = mtls_guard.metric("ghost_guard_requests_total", endpoint="/filter")
    s = requests.Session()
    s.verify = str(ours.ca_cert)
    if who == "certificate-from-another-ca":
        s.cert = (str(other.client_cert), str(other.client_key))
    elif who == "ca-certificate-as-client":
        s.cert = (str(other.ca_cert), str(other.ca_key))
    body = orjson.dumps({"Pod": {"metadata": {"name": "p", "uid": "u"}}, "NodeNames": NAMES})
    for _ in range(3):
        with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
            s.post(mtls_guard.url("/filter"), data=body, headers={"Content-Type": "application/json"}, timeout=5)
    s.close()
    # Our own client on the same server is served: the refusals above are about the certificate.
    ok = mtls_guard.post("/filter", body)
    assert ok.status_code == 200
    lines = access_lines(mtls_guard)[before_lines:]
    assert [(e["method"], e["path"]) for e in lines] == [("POST", "/filter")], lines
    assert mtls_guard.metric("ghost_guard_requests_total", endpoint="/filter") == before_count + 1


def test_plain_http_to_the_tls_port_gets_no_handler(mtls_guard):
    before = len(access_lines(mtls_guard))
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"http://127.0.0.1:{mtls_guard.port}/healthz", timeout=5)
    assert access_lines(mtls_guard)[before:] == []


# --- secrets never logged -------------------------------------------------------------------------


def secret_markers(*texts: str) -> list[str]:
    return [m for m in ("PRIVATE KEY", "BEGIN CERTIFICATE", "Bearer ", "Authorization", "authorization") if
            any(m in t for t in texts)]


def test_no_token_key_or_certificate_in_logs_or_bodies(shared_lab, lab_namespace, pki, tmp_path, start_guard):
    """Debug logging, TLS with mTLS, apiserver answering 500/429/401 and hanging: nothing secret leaks."""
    ours = pki["ours"]
    lab = shared_lab
    wrong = tmp_path / "wrong-token.kubeconfig"
    cfg = orjson.loads(Path(lab.kubeconfig(0)).read_text())
    wrong_token = "wrong-token-" + base64.b32encode(os.urandom(10)).decode()
    cfg["users"][0]["user"]["token"] = wrong_token
    wrong.write_text(orjson.dumps(cfg).decode())
    ca_data = cfg["clusters"][0]["cluster"]["certificate-authority-data"]
    tls = tls_files(ours)
    guards = []
    bodies: list[str] = []
    try:
        for kubeconfig in (lab.kubeconfig(0), str(wrong)):
            guards.append(start_guard(["--kubeconfig", kubeconfig, "--log-level", "debug", "--get-timeout", "0.3",
                                       "--audit-db", str(tmp_path / f"audit-{len(guards)}.db")], tls=tls,
                                      wait="/healthz"))
        good, bad = guards
        uid = make_ghost(lab, lab_namespace, "g")
        pods = f"/api/v1/namespaces/{lab_namespace}/pods"

        def calls() -> None:
            for g in guards:
                for name, u in (("g", uid), ("never", "u-1")):
                    r = g.post("/filter", {"Pod": {"metadata": {"name": name, "namespace": lab_namespace, "uid": u}},
                                           "NodeNames": NAMES})
                    assert r.status_code == 200
                    bodies.append(r.text)
                bodies.append(g.get("/readyz", timeout=5).text)
                bodies.append(g.post("/filter", b"{not json").text)
                bodies.append(g.post("/validate/binding", {"kind": "x"}).text)

        for fault in ({"action": "status", "status": 500}, {"action": "status", "status": 429}, {"action": "hang"}):
            since = time.time()
            lab.replicas[0].faults.add(method="GET", path=rf"{pods}/.*", **fault)

            def answered_by_the_fault() -> bool:
                # the guard's read of each pod met this fault (a read of the previous round may still be
                # reused for --alive-ttl: call again until fresh reads went out)
                calls()
                return {r.path for r in lab.replicas[0].requests(method="GET", since=since)
                        if r.source == "fault"} >= {f"{pods}/g", f"{pods}/never"}

            eventually(answered_by_the_fault, 20, what=f"reads answered by the fault {fault}", interval=0.0)
            lab.replicas[0].faults.clear()
        bodies.append(bad.get("/readyz", timeout=5).text)
        assert "401" in bodies[-1], bodies[-1]  # the wrong token really failed
        assert good.metric("ghost_guard_fail_open_total", reason="apiserver") >= 3
        start_guard.stop(*guards)  # everything the guards will ever log is written once they have exited
        texts = [g.logs(tail=None) + g.stdout() for g in guards] + bodies
        everything = "\n".join(texts)
        assert '"level":"debug"' in everything  # debug logging was really on
        for secret in (lab.token, wrong_token, ca_data[:40], Path(ours.tls_key).read_text().splitlines()[1][:40],
                       Path(ours.client_key).read_text().splitlines()[1][:40]):
            assert secret not in everything, f"secret material {secret[:8]}... found in logs or bodies"
        assert secret_markers(everything) == []
    finally:
        start_guard.stop(*guards)


# --- audit CLI ---------------------------------------------------------------------------------


def audit_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``ghost-guard audit`` in-process (tests/clirun.py), without the caller's GHOST_GUARD_* variables."""
    return ghost_guard("audit", *args, env=env, clean_env=True)


def snapshot(path: Path) -> tuple:
    return (path.read_bytes(), sorted(p.name for p in path.parent.iterdir()))


@pytest.mark.parametrize("make,message", [
    pytest.param(lambda d: str(d), "is a directory, not a file", id="directory"),
    pytest.param(lambda d: "/dev/null", "is not a regular file", id="device"),
    pytest.param(lambda d: ":memory:", "no audit store at :memory:", id="memory"),
    pytest.param(lambda d: f"file:{d}/x.db?mode=rwc", "no audit store at file:", id="sqlite-uri"),
    pytest.param(lambda d: f"{d}/missing/dir/audit.db", "no audit store at ", id="missing-dir"),
    pytest.param(lambda d: f"{d}/../{d.name}/nope.db", "no audit store at ", id="dot-dot-missing"),
])
def test_audit_cli_refuses_paths_outside_a_store(tmp_path, make, message):
    before = sorted(os.listdir(tmp_path))
    r = audit_cli("--db", make(tmp_path))
    assert r.returncode == 2, r
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path)) == before  # nothing created


@pytest.mark.parametrize("kind", ["text-file", "foreign-sqlite", "symlink-to-text-file"])
def test_audit_cli_leaves_foreign_files_untouched(tmp_path, kind):
    target = tmp_path / "victim"
    if kind == "foreign-sqlite":
        conn = sqlite3.connect(target)
        conn.execute("CREATE TABLE accounts (name TEXT, secret TEXT)")
        conn.execute("INSERT INTO accounts VALUES ('root', 'hunter2')")
        conn.commit()
        conn.close()
    else:
        target.write_text("root:x:0:0:root:/root:/bin/bash\n")
    path = target
    if kind == "symlink-to-text-file":
        path = tmp_path / "audit.db"
        path.symlink_to(target)
    before = snapshot(target)
    r = audit_cli("--db", str(path), "-o", "json")
    assert r.returncode == 2, r
    assert r.stdout == "" and "hunter2" not in r.stderr and "root:x" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert snapshot(target) == before


@pytest.mark.parametrize("args,message", [
    pytest.param(["--since", "yesterdayish"], "Invalid value for --since", id="since"),
    pytest.param(["--since", "1h; DROP TABLE ghosts"], "Invalid value for --since", id="since-injection"),
    pytest.param(["--verdict", "ghost' OR '1'='1"], "Invalid value for '--verdict'", id="verdict-injection"),
    pytest.param(["--limit", "0"], "Invalid value for '--limit'", id="limit-zero"),
    pytest.param(["--limit", "-1"], "Invalid value for '--limit'", id="limit-negative"),
    pytest.param(["--output", "html"], "Invalid value for '--output'", id="output"),
])
def test_audit_cli_rejects_nonsense_filters(recorded_store, args, message):
    db, _ = recorded_store
    before = snapshot(db)
    r = audit_cli("--db", str(db), *args)
    assert r.returncode == 2, r
    assert message in r.stderr, r.stderr
    assert snapshot(db)[0] == before[0]


@pytest.mark.parametrize("namespace", ["x' OR '1'='1", "%", "*", "x\" OR 1=1 --", "' UNION SELECT * FROM sqlite_master --"])
def test_audit_cli_filters_are_data_not_sql(recorded_store, namespace):
    db, ns = recorded_store
    r = audit_cli("--db", str(db), "--namespace", namespace, "-o", "json")
    assert r.returncode == 0, r
    assert orjson.loads(r.stdout) == []
    r = audit_cli("--db", str(db), "--namespace", ns, "-o", "json")
    assert r.returncode == 0, r
    assert [rec["namespace"] for rec in orjson.loads(r.stdout)] == [ns]


@pytest.fixture(scope="module")
def recorded_store(_shared_lab_session, tmp_path_factory, module_guard):
    """An audit store written by a real guard that blocked one real ghost."""
    lab = _shared_lab_session
    tmp = tmp_path_factory.mktemp("recorded")
    ns = f"sec-{os.urandom(4).hex()}"
    lab.core_v1(0).create_namespace({"metadata": {"name": ns}}, _request_timeout=5)
    db = tmp / "audit.db"
    g = module_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", str(db), "--no-events"])
    try:
        uid = make_ghost(lab, ns, "ghost")
        body = {"Pod": {"metadata": {"name": "ghost", "namespace": ns, "uid": uid}}, "NodeNames": NAMES}
        deadline = time.monotonic() + 10  # for both
        eventually(lambda: g.post("/filter", body).json()["FailedAndUnresolvableNodes"] != {}, 10,
                   what="the ghost rejected", interval=0.1, process=g)

        def recorded() -> bool:
            r = audit_cli("--db", str(db), "--namespace", ns, "-o", "json")
            return r.returncode == 0 and bool(orjson.loads(r.stdout))

        eventually(recorded, deadline - time.monotonic(), what="the ghost in the audit", interval=0.2, process=g)
    finally:
        module_guard.stop(g)
    return db, ns


# --- RBAC ---------------------------------------------------------------------------------------------

VERBS = {"read": "get", "list": "list", "create": "create", "patch": "patch", "replace": "update", "delete": "delete",
         "delete_collection": "deletecollection"}


def _api_classes(tree: ast.AST) -> dict[str, str]:
    """Attribute names bound to kubernetes API objects, e.g. ``self.core = client.CoreV1Api(...)`` -> core."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            fn = node.value.func
            if isinstance(fn, ast.Attribute) and fn.attr.endswith("Api"):
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        out[target.attr] = fn.attr
    return out


def _path_of(cls_name: str, method: str) -> str:
    from kubernetes import client

    cls = getattr(client, cls_name)
    # kubernetes >= 33 builds the request in ``_<method>_serialize``; older clients in ``<method>_with_http_info``.
    fn = getattr(cls, f"_{method}_serialize", None) or getattr(cls, f"{method}_with_http_info")
    found = re.search(r"""['"](/apis?/[^'"]+)['"]""", inspect.getsource(fn))
    assert found, f"no resource path in kubernetes.client.{cls_name}.{fn.__name__}"
    return found.group(1)


def _rule_of(path: str) -> tuple[str, str]:
    """(apiGroup, resource) of a client path like /apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices."""
    parts = path.strip("/").split("/")
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if rest and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    return group, rest[0]


def _guard_trees() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text()) for path in sorted(
        p for p in (REPO / "guard").rglob("*.py") if "lab" not in p.relative_to(REPO / "guard").parts)}


def _all_api_classes(trees: dict[Path, ast.AST]) -> dict[str, str]:
    """``_api_classes`` over every module: ``kube.core`` in guard/kube/writes.py is the ``self.core`` that
    guard/kube/reads.py binds. One attribute name is one API class everywhere, or the derivation would guess."""
    out: dict[str, str] = {}
    for path, tree in trees.items():
        for attr, cls in _api_classes(tree).items():
            assert out.setdefault(attr, cls) == cls, f"{path.name}: .{attr} is {cls} here, {out[attr]} elsewhere"
    return out


def code_calls() -> set[tuple[str, str, str, str]]:
    """Every (namespace or '*', apiGroup, resource, verb) the guard's code can call on the API."""
    calls = set()
    trees = _guard_trees()
    attrs = _all_api_classes(trees)
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            recv, method = node.func.value, node.func.attr
            if any(isinstance(a, ast.Call) and isinstance(a.func, ast.Attribute) and a.func.attr == "_pod_path"
                   for a in ast.walk(node) if a is not node):
                # Kube.quorum_get: GET of one pod on its own connections (guard/kube/transport.py), or through
                # the client's urllib3 pool behind a proxy (no CoreV1Api call)
                assert method in ("get", "request"), f"{path.name}: unknown use of _pod_path in {method}()"
                verb = node.args[0].value.lower() if method == "request" else "get"
                calls.add(("*", "", "pods", verb))
                continue
            if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Attribute) and recv.func.attr.endswith("Api"):
                cls = recv.func.attr
            elif isinstance(recv, ast.Attribute) and recv.attr in attrs:
                cls = attrs[recv.attr]
            else:
                continue
            if cls == "VersionApi":
                continue  # GET /version: a non-resource URL every authenticated user may read
            if cls == "CustomObjectsApi":
                continue  # referenced, not called: _custom_object_calls below
            prefix = next((p for p in sorted(VERBS, key=len, reverse=True) if method.startswith(p + "_")), None)
            assert prefix, f"{path.name}: unknown kubernetes call {cls}.{method}"
            group, resource = _rule_of(_path_of(cls, method))
            namespaced = "_namespaced_" in method
            at = 1 if method.startswith(("read_", "patch_")) else 0  # (name, namespace) or (namespace, ...)
            ns = node.args[at] if namespaced and len(node.args) > at else None
            namespace = ns.value if namespaced and isinstance(ns, ast.Constant) else "*"
            calls.add((namespace, group, resource, VERBS[prefix]))
            if any(k.arg == "watch" and isinstance(k.value, ast.Constant) and k.value.value for k in node.keywords):
                calls.add((namespace, group, resource, "watch"))
        calls |= _custom_object_calls(tree, attrs)
    return calls


def _custom_object_calls(tree: ast.AST, attrs: dict[str, str]) -> set[tuple[str, str, str, str]]:
    """CustomObjectsApi methods the code references (guard/kube/writes.py GhostPods passes them to one error-translating
    wrapper). Their paths are generic (/apis/{group}/...): the group and plural are guard.kube.writes' GHOSTPOD_*; a
    ``cluster`` method serves the cluster-scoped GhostNodes, and (a LIST across namespaces) the GhostPods too."""
    from guard.kube.writes import GHOSTNODE_PLURAL, GHOSTPOD_GROUP, GHOSTPOD_PLURAL

    out = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and attrs.get(node.value.attr) == "CustomObjectsApi"):
            continue
        m = re.fullmatch(r"(read|get|list|create|patch|replace|delete)_(namespaced|cluster)_custom_object(_status)?",
                         node.attr)
        assert m, f"unknown CustomObjectsApi method {node.attr}"
        verb = {"read": "get", "get": "get"}.get(m.group(1)) or VERBS[m.group(1)]
        plurals = (GHOSTPOD_PLURAL, GHOSTNODE_PLURAL) if m.group(2) == "cluster" else (GHOSTPOD_PLURAL,)
        for plural in plurals:
            out.add(("*", GHOSTPOD_GROUP, plural + ("/status" if m.group(3) else ""), verb))
    return out


OPT_IN_WRITES = "heal"  # manifests/heal: the pod writes of `serve --heal` / `ghost-guard heal`, applied on purpose only


def manifest_grants(*, opt_in: bool = True) -> set[tuple[str, str, str, str]]:
    """Every (namespace or '*', apiGroup, resource, verb) granted by a Role or ClusterRole in manifests/
    (without ``opt_in``: leaving out the opt-in manifests/heal)."""
    grants = set()
    for path in sorted((REPO / "manifests").rglob("*.yaml")):
        if not opt_in and path.relative_to(REPO / "manifests").parts[0] == OPT_IN_WRITES:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict) or doc.get("kind") not in ("Role", "ClusterRole"):
                continue
            if any(k.startswith("rbac.authorization.k8s.io/aggregate-to-") for k in doc["metadata"].get("labels", {})):
                continue  # a role for people (ghost-guard-ghostpods-view, aggregated to view), never bound to the guard
            namespace = doc["metadata"].get("namespace", "*") if doc["kind"] == "Role" else "*"
            for rule in doc.get("rules") or []:
                for url in rule.get("nonResourceURLs", []):  # the guard needs none (/version is public-info)
                    for verb in rule.get("verbs", []):
                        grants.add(("*", "nonResourceURL", url, verb))
                for group in rule.get("apiGroups", []):
                    for resource in rule.get("resources", []):
                        for verb in rule.get("verbs", []):
                            assert "*" not in (group, resource, verb), f"{path}: wildcard in {rule}"
                            grants.add((namespace, group, resource, verb))
    return grants


def covered(call: tuple[str, str, str, str], grants: set) -> bool:
    ns, group, resource, verb = call
    return any(g[1:] == (group, resource, verb) and g[0] in ("*", ns) for g in grants)


def test_code_calls_are_derived():
    """The derivation itself: it must find the quorum GET and the pod watch, or the RBAC checks prove nothing."""
    calls = code_calls()
    assert ("*", "", "pods", "get") in calls
    assert ("*", "", "pods", "watch") in calls
    assert ("default", "discovery.k8s.io", "endpointslices", "list") in calls
    assert ("kube-system", "coordination.k8s.io", "leases", "list") in calls
    assert ("*", "kube-ghost-guard.io", "ghostpods/status", "patch") in calls
    assert {("*", "", "nodes", v) for v in ("get", "list", "watch", "create", "delete")} <= calls  # ghost Nodes


def test_rbac_grants_every_call_the_code_makes():
    grants = manifest_grants()
    missing = sorted(c for c in code_calls() if not covered(c, grants))
    assert missing == [], f"called but not granted: {missing}"


def test_rbac_grants_nothing_beyond_the_calls():
    calls = code_calls()
    extra = sorted(g for g in manifest_grants() if not any(
        c[1:] == g[1:] and (g[0] == c[0] or (g[0] != "*" and c[0] == "*")) for c in calls))
    assert extra == [], f"granted but never called: {extra}"


def test_rbac_grants_no_write_to_pods_and_no_secrets():
    """Whatever else changes: the guard as installed by default can never change a pod or a Node, and no
    manifest lets it read a Secret. Writing pods and Nodes (the heal) is opt-in, in manifests/heal alone, and
    only these verbs (Nodes: heal node/NAME's placeholder, held to its shape by manifests/heal's policy)."""
    for ns, group, resource, verb in manifest_grants(opt_in=False):
        assert not (resource.startswith(("pods", "nodes")) and verb not in ("get", "list", "watch")), \
            (ns, group, resource, verb)
    for ns, group, resource, verb in manifest_grants():
        assert resource not in ("secrets", "serviceaccounts/token", "bindings", "pods/binding",
                                "pods/eviction") and not resource.startswith("nodes/"), (ns, group, resource, verb)
    assert manifest_grants() - manifest_grants(opt_in=False) == {
        ("*", "", "pods", "create"), ("*", "", "pods", "delete"), ("*", "", "pods", "patch"),
        ("*", "", "nodes", "create"), ("*", "", "nodes", "delete")}
