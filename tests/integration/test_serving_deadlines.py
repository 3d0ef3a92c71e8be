"""Hostile connections against a real ``ghost-guard serve`` (guard/serving/connection.py), over real loopback sockets.

100 hostile connections (one byte then silence, stalled TLS handshakes or silent
connects, stalled bodies, slow readers of the reply) from 127.0.0.2-5 while a
client on 127.0.0.1 makes well-formed ``/filter`` calls for a live pod of the
lab: every call is answered, their p99 stays within a generous bound (the
figures are printed and recorded in docs/RELIABILITY.md), every hostile
connection is closed by its deadline and counted, and afterwards all threads
answer again. The same over HTTPS with mTLS. Then the connection limits (a
fast 503 with the reason), and the TLS parameters actually negotiated.

Each attack is bounded in count and time and stays on 127.0.0.0/8.
"""

from __future__ import annotations

import socket
import ssl
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import requests

from guard.tools.certs import generate
from guard.lab.harness import eventually, metric_sum, parse_metrics, pod_manifest, tls_files

pytestmark = pytest.mark.timeout(240)

ATTACKERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
# Defaults of guard.core.settings.Settings: the deadlines under test.
HANDSHAKE, HEADERS, BODY, WRITE = 2.0, 5.0, 5.0, 5.0
# The hostile-connections test starts its guard with the header, body and write deadlines at 3 s (--header-timeout,
# --body-timeout, --write-timeout): still past the 1.8 s of well-formed calls made while the hostile connections
# are open, and past the TLS handshake's 2 s, so each kind is closed by its own deadline; every close is waited for.
ATTACK_DEADLINE = 3.0
# A call queued behind a thread that a hostile connection holds waits until that connection's deadline
# (>= HANDSHAKE). Every call answered in under half the shortest deadline: no thread was held. (How fast
# the calls are is a benchmark's question, not a test's: a latency bound flakes on a shared machine.)
HELD_BOUND = HANDSHAKE / 2
TICK = 0.05  # guard.serving.connection checks deadlines on this tick (slack for a lower bound, never an upper one)
NAMES = ["node-a", "node-b"]
MIX = {"one-byte": 30, "stalled-start": 25, "stalled-body": 25, "slow-reader": 20}  # 100 connections


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("pki"), ips=["127.0.0.1"])


@pytest.fixture
def live_pod(shared_lab, lab_namespace) -> dict:
    created = shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest("web-0"), _request_timeout=5)
    return {"metadata": {"name": "web-0", "namespace": lab_namespace, "uid": created.metadata.uid}}


def client_ctx(pki, role: str = "client", **versions) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    for key, value in versions.items():
        setattr(ctx, key, value)
    ctx.load_cert_chain(str(getattr(pki, f"{role}_cert")), str(getattr(pki, f"{role}_key")))
    return ctx


def dial(port: int, source: str, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    return s


def half_client_hello() -> bytes:
    """The first half of a real ClientHello (from this machine's OpenSSL)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    hello = outgoing.read()
    return hello[:len(hello) // 2]


def filter_request(pod: dict, names: list[str]) -> bytes:
    body = orjson.dumps({"Pod": pod, "NodeNames": names})
    return (b"POST /filter HTTP/1.1\r\nHost: guard\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


class Attack:
    """The hostile connections: opened at once, held until the guard closes them."""

    def __init__(self, port: int, pki, pod: dict, tls: bool) -> None:
        self.port, self.pki, self.pod, self.tls = port, pki, pod, tls
        self.socks: dict[str, list] = {kind: [] for kind in MIX}
        self.threads: list[threading.Thread] = []
        self.closed_at: dict[int, float] = {}
        self.started = 0.0

    def _wrap(self, s: socket.socket, role: str = "client"):
        return client_ctx(self.pki, role).wrap_socket(s, server_hostname="localhost") if self.tls else s

    def start(self) -> Attack:
        hello = half_client_hello()
        self.started = time.monotonic()
        n = 0
        for kind, count in MIX.items():
            for _ in range(count):
                source = ATTACKERS[n % len(ATTACKERS)]
                n += 1
                if kind == "one-byte":
                    s = dial(self.port, source)
                    s.sendall(b"\x16" if self.tls else b"P")
                elif kind == "stalled-start":  # half a ClientHello, or (plain) a connection that says nothing
                    s = dial(self.port, source)
                    if self.tls:
                        s.sendall(hello)
                elif kind == "stalled-body":
                    s = self._wrap(dial(self.port, source))
                    s.sendall(b"POST /filter HTTP/1.1\r\nHost: guard\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 4096\r\n\r\n{\"Pod\": ")
                else:  # slow reader: 80 pipelined 65 KB requests, replies never read
                    s = self._wrap(dial(self.port, source, rcvbuf=4096))
                    data = filter_request(self.pod, [f"node-{i:05d}" for i in range(5000)]) * 80
                    t = threading.Thread(target=self._push, args=(s, data), daemon=True)
                    t.start()
                    self.threads.append(t)
                self.socks[kind].append(s)
        return self

    @staticmethod
    def _push(s, data: bytes) -> None:
        try:
            s.settimeout(WRITE + 3)
            s.sendall(data)
        except OSError:
            pass  # the guard stopped reading (blocked reply), then closed the connection

    def closed_by_guard(self, within: float) -> dict[str, int]:
        """Per kind, how many connections the guard closed by ``within`` seconds from now.

        Read from the kernel's TCP state (no longer ESTABLISHED: the guard's FIN or reset arrived),
        not by reading: reading a slow reader's replies would make it a fast one.
        """
        deadline = time.monotonic() + within
        while True:
            now = time.monotonic()
            for kind, socks in self.socks.items():
                for s in socks:
                    if id(s) not in self.closed_at and tcp_state(s) != 1:
                        self.closed_at[id(s)] = now - self.started
            out = {kind: sum(1 for s in socks if id(s) in self.closed_at) for kind, socks in self.socks.items()}
            if out == MIX or now > deadline:
                return out
            time.sleep(0.05)  # poll interval: the kernel's TCP state is read until every connection is closed

    def last_closed(self) -> dict[str, float]:
        """Per kind, seconds from the attack's start until the last of its connections was closed."""
        return {kind: round(max((self.closed_at.get(id(s), float("nan")) for s in socks), default=0.0), 2)
                for kind, socks in self.socks.items()}

    def close(self) -> None:
        for socks in self.socks.values():
            for s in socks:
                try:
                    s.close()
                except OSError:
                    pass
        for t in self.threads:
            t.join(timeout=10)


def tcp_state(s: socket.socket) -> int:
    """The connection's state from TCP_INFO (1 ESTABLISHED, 7 CLOSE, 8 CLOSE_WAIT, ...)."""
    try:
        return socket.socket.getsockopt(s, socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    except OSError:
        return 7


def well_formed_calls(guard, pod: dict, seconds: float) -> list[float]:
    body = orjson.dumps({"Pod": pod, "NodeNames": NAMES})
    latencies = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        start = time.perf_counter()
        r = guard.post("/filter", body, timeout=5)
        latencies.append(time.perf_counter() - start)
        assert r.status_code == 200, r.text
        assert r.json()["NodeNames"] == NAMES, r.text  # a live pod passes
    return latencies


def p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[98]


def all_threads_answer(guard, pod: dict) -> None:
    """16 concurrent fresh connections (every pool thread at once) are all answered."""
    body = orjson.dumps({"Pod": pod, "NodeNames": NAMES})

    def one(_):
        with requests.Session() as s:
            s.trust_env = False
            s.verify, s.cert = guard.session.verify, guard.session.cert
            return s.post(guard.url("/filter"), data=body, headers={"Content-Type": "application/json"},
                          timeout=5).status_code

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [200] * 16


@pytest.mark.parametrize("scheme", ["http", "https+mtls"])
def test_100_hostile_connections_never_hold_a_thread(scheme, shared_lab, live_pod, start_guard, pki, tmp_path):
    tls = tls_files(pki) if scheme != "http" else None
    guard = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--no-prepare", "--no-access-log",
                         *(arg for flag in ("--header-timeout", "--body-timeout", "--write-timeout")
                           for arg in (flag, str(ATTACK_DEADLINE))),
                         "--audit-db", str(tmp_path / "audit.db")], tls=tls)
    before = guard.metrics()
    assert guard.post("/filter", orjson.dumps({"Pod": live_pod, "NodeNames": NAMES})).status_code == 200
    attack = Attack(guard.port, pki, live_pod, tls is not None).start()
    try:
        started = time.monotonic()
        latencies = well_formed_calls(guard, live_pod, seconds=1.8)  # all hostile connections still open
        took_attack = time.monotonic() - started
        closed = attack.closed_by_guard(within=ATTACK_DEADLINE + 5 - took_attack)
    finally:
        attack.close()
    measured = p99(latencies)
    print(f"\n{scheme}: {len(latencies)} well-formed /filter calls under 100 hostile connections: "
          f"p50 {statistics.median(latencies) * 1000:.1f} ms, p99 {measured * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms; closed by the guard: {closed}, the last of each kind after "
          f"{attack.last_closed()} s")
    # Each call is a check of its own (one behind a held thread waits >= HANDSHAKE); how many fit in the 1.8 s is
    # the machine's load (15 on a loaded 2-core run, where the old floor of 20 failed): a few suffice.
    assert len(latencies) >= 3
    assert max(latencies) < HELD_BOUND, f"a call waited {max(latencies) * 1000:.1f} ms: behind a held thread?"
    assert closed == MIX, f"hostile connections still open past their deadlines: {closed} of {MIX}"

    after = guard.metrics()

    def counted(reason: str) -> float:
        key = ("ghost_guard_connections_rejected_total", (("reason", reason),))
        return after.get(key, 0) - before.get(key, 0)

    if tls:
        assert counted("tls-handshake-timeout") >= MIX["one-byte"] + MIX["stalled-start"]
    else:
        assert counted("header-timeout") >= MIX["one-byte"] + MIX["stalled-start"]
    assert counted("body-timeout") >= MIX["stalled-body"]
    assert counted("write-timeout") >= 1
    all_threads_answer(guard, live_pod)


@pytest.fixture(scope="module")
def limits_guard(_shared_lab_session, module_guard, tmp_path_factory):
    """One guard for the slow-body and connection-limits tests (each reads its counts as differences, on
    connections closed before it returns: no connection of theirs stays open to count towards a limit)."""
    guard = module_guard(["--kubeconfig", _shared_lab_session.kubeconfig(0), "--no-prepare", "--body-timeout", "1",
                          "--max-connections", "20", "--max-connections-per-client", "8",
                          "--audit-db", str(tmp_path_factory.mktemp("limits") / "audit.db")], wait=None)
    ready_without_keepalive(guard)
    return guard


def rejected(guard, reason: str) -> float:
    """``ghost_guard_connections_rejected_total{reason}``, read on a connection closed before this returns."""
    return metric_in(served_and_closed(guard.port, "127.0.0.1", METRICS), "ghost_guard_connections_rejected_total",
                     reason=reason)


def test_a_slow_body_is_served_within_its_deadline_and_cut_off_past_it(limits_guard, live_pod):
    """A body sent one byte at a time within the deadline is served; past it, closed and counted."""
    guard = limits_guard
    cut = rejected(guard, "body-timeout")
    body = orjson.dumps({"Pod": live_pod, "NodeNames": NAMES})
    head = b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    with dial(guard.port, "127.0.0.2") as s:
        s.sendall(head)
        for i in range(0, len(body), 20):  # within the 1 s body deadline
            s.sendall(body[i:i + 20])
            time.sleep(0.01)  # the behaviour: a client that drips its body on purpose
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    before = time.monotonic()  # before the connection exists: the guard's deadline starts later
    with dial(guard.port, "127.0.0.2") as s:
        s.sendall(head + body[:10])
        assert s.recv(65536) == b""  # closed by the guard, no reply (within dial's 5 s socket timeout)
        assert time.monotonic() - before >= 1.0 - TICK  # not before the 1 s body deadline
    assert rejected(guard, "body-timeout") == cut + 1


def read_reply(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def request_on(s: socket.socket, request: bytes) -> bytes:
    """``request`` (with ``Connection: close``) on an open connection; the reply, read until the guard closes it.

    The guard stops counting a connection towards the limits before it half-closes it (guard.serving.connection
    ``_linger``): once this returns, the connection counts no more. No pause needed."""
    s.sendall(request)
    return read_reply(s)


def served_and_closed(port: int, source: str, request: bytes) -> bytes:
    """``request_on`` a fresh connection from ``source``."""
    with dial(port, source) as s:
        return request_on(s, request)


METRICS = b"GET /metrics HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n"


def metric_in(reply: bytes, name: str, **labels: str) -> float:
    """A metric from a /metrics reply read with ``request_on``."""
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"chunked" not in head.lower(), head
    return metric_sum(parse_metrics(body.decode()), name, **labels)


def ready_without_keepalive(guard) -> None:
    """Wait for /healthz on connections the guard has closed (and stopped counting) before this returns: no
    kept-alive connection of the test's own is left to count towards a limit."""
    eventually(lambda: served_and_closed(guard.port, "127.0.0.1", b"GET /healthz HTTP/1.1\r\nHost: g\r\n"
                                         b"Connection: close\r\n\r\n").startswith(b"HTTP/1.1 200 "),
               20, what="/healthz", ignore=(OSError,), process=guard)


def kept_alive(port: int, source: str) -> socket.socket:
    """A connection from ``source`` that has made a request and is kept alive, idle."""
    s = dial(port, source)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: g\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    return s


def test_connection_limits_answer_a_fast_503_with_the_reason(limits_guard, live_pod):
    guard = limits_guard
    ready_without_keepalive(guard)
    refused = {reason: rejected(guard, reason) for reason in ("over-client-limit", "over-total-limit")}
    # One event loop accepts the connections in the order they were made (the kernel's accept queue):
    # a connection dialled after others is admitted or refused after them, so no pause is needed between.
    held = [kept_alive(guard.port, "127.0.0.6") for _ in range(8)]
    try:
        # The 8 are accepted (the open-connections gauge is sampled every second).
        eventually(lambda: metric_in(served_and_closed(guard.port, "127.0.0.10", METRICS),
                                     "ghost_guard_connections_open") >= 8, 10, what="8 connections open")
        with dial(guard.port, "127.0.0.6") as s:
            start = time.monotonic()
            reply = read_reply(s)
            # Refused at once, without a byte sent: not closed at the header deadline.
            assert time.monotonic() - start < HEADERS
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), reply
        assert orjson.loads(body) == {"error": "too many connections from 127.0.0.6 (limit 8, "
                                               "--max-connections-per-client)"}
        # Another client is served meanwhile (on a connection closed after it: it would count towards the 20).
        body = orjson.dumps({"Pod": live_pod, "NodeNames": NAMES})
        reply = served_and_closed(guard.port, "127.0.0.10", b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: "
                                  b"application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert reply.startswith(b"HTTP/1.1 200 "), reply
        # 20 open in all, each past its first request (a connection that has not sent one would make room)
        held += [kept_alive(guard.port, src) for src in ("127.0.0.7",) * 8 + ("127.0.0.8",) * 4]
        with dial(guard.port, "127.0.0.9") as s:
            reply = read_reply(s)
        assert reply.startswith(b"HTTP/1.1 503 "), reply
        assert b"too many connections (limit 20, --max-connections)" in reply
        for h in held[8:]:  # the 20 admitted connections were not refused
            h.setblocking(False)
            with pytest.raises(BlockingIOError):
                h.recv(100)
            h.setblocking(True)
        # read on an admitted connection (a new one would be refused): one refusal of each kind
        metrics = request_on(held.pop(), METRICS)
        for reason, before in refused.items():
            assert metric_in(metrics, "ghost_guard_connections_rejected_total", reason=reason) == before + 1, reason
    finally:
        for s in held:
            s.close()
    # Once the guard has seen them closed, new clients are served again (on a connection closed after it).
    body = orjson.dumps({"Pod": live_pod, "NodeNames": NAMES})
    call = b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\nConnection: close\r\n" \
           b"Content-Length: %d\r\n\r\n" % len(body) + body
    eventually(lambda: served_and_closed(guard.port, "127.0.0.1", call).startswith(b"HTTP/1.1 200 "),
               10, what="a call served after the held connections closed", ignore=(OSError,), process=guard)


# --- TLS: what is negotiated -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_guard(module_guard, dead_kubeconfig, tmp_path_factory):
    """One guard on a dead apiserver for the oversized-request and keep-alive tests, which read their counts
    as differences on connections the guard closes (its 1 s idle deadline would close a kept-alive one)."""
    return module_guard(["--kubeconfig", dead_kubeconfig, "--max-body-bytes", "1000", "--keepalive-timeout", "1",
                         "--get-timeout", "0.2", "--audit-db", str(tmp_path_factory.mktemp("small") / "audit.db")],
                        wait="/healthz")


def test_oversized_head_and_body_are_refused_before_they_are_read(small_guard):
    guard = small_guard
    before = {reason: rejected(guard, reason) for reason in ("body-too-large", "head-too-large")}
    with dial(guard.port, "127.0.0.2") as s:  # the body is never sent: the head alone is refused
        s.sendall(b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1001\r\n\r\n")
        reply = read_reply(s)
    assert reply.startswith(b"HTTP/1.1 413 "), reply
    assert orjson.loads(reply.partition(b"\r\n\r\n")[2]) == {
        "error": "request body of 1001 bytes is larger than the limit (1000 bytes, --max-body-bytes)"}
    with dial(guard.port, "127.0.0.2") as s:  # chunked: refused at the chunk that crosses the limit
        s.sendall(b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n200\r\n" + b"x" * 512 + b"\r\n3e9\r\n")
        assert read_reply(s).startswith(b"HTTP/1.1 413 ")
    with dial(guard.port, "127.0.0.2") as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 70000)
        reply = read_reply(s)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:100]
    assert rejected(guard, "body-too-large") == before["body-too-large"] + 2
    assert rejected(guard, "head-too-large") == before["head-too-large"] + 1


def handshake(port: int, ctx: ssl.SSLContext) -> tuple[str, str] | None:
    """(version, cipher) negotiated, or None when the server refuses the handshake."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                return s.version(), s.cipher()[0]
        except (ssl.SSLError, ConnectionError):
            return None


def tls12_suites() -> list[str]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_ciphers("ALL:@SECLEVEL=0")
    return sorted({c["name"] for c in ctx.get_ciphers() if c["protocol"] == "TLSv1.2" or "TLSv1.0" in c["protocol"]
                   or c["protocol"] == "SSLv3"})


@pytest.fixture(scope="module")
def tls_guard(module_guard, pki, dead_kubeconfig, tmp_path_factory):
    """One HTTPS guard with the default TLS parameters for the cipher-suite test (its handshakes come from
    127.0.0.1, one at a time) and the over-the-limit test (from 127.0.0.2, at most 2 admitted)."""
    return module_guard(["--kubeconfig", dead_kubeconfig, "--max-connections-per-client", "2",
                         "--audit-db", str(tmp_path_factory.mktemp("tls") / "audit.db")], tls=tls_files(pki),
                        wait="/healthz")


def test_tls_offers_only_ecdhe_with_aead(tls_guard, pki):
    guard = tls_guard
    accepted, refused = [], []
    for suite in tls12_suites():
        ctx = client_ctx(pki, "monitoring", maximum_version=ssl.TLSVersion.TLSv1_2)
        try:
            ctx.set_ciphers(suite + ":@SECLEVEL=0")
        except ssl.SSLError:
            continue
        got = handshake(guard.port, ctx)
        (accepted if got else refused).append(suite)
    tls13 = handshake(guard.port, client_ctx(pki, "monitoring", minimum_version=ssl.TLSVersion.TLSv1_3))
    print(f"\nTLS 1.2 accepted ({len(accepted)}): {accepted}\nTLS 1.2 refused: {len(refused)} suites"
          f"\nTLS 1.3: {tls13}")
    # An ECDSA serving certificate (the `certs` default): the three ECDHE-ECDSA AEAD suites, nothing else.
    assert sorted(accepted) == ["ECDHE-ECDSA-AES128-GCM-SHA256", "ECDHE-ECDSA-AES256-GCM-SHA384",
                                "ECDHE-ECDSA-CHACHA20-POLY1305"]
    for cbc in ("AES256-SHA256", "ECDHE-ECDSA-AES128-SHA256", "ECDHE-ECDSA-AES256-SHA", "AES128-GCM-SHA256"):
        if cbc in tls12_suites():
            assert cbc in refused, cbc
    assert tls13 is not None and tls13[0] == "TLSv1.3"


def test_tls_min_version_13_refuses_tls12(start_guard, pki, dead_kubeconfig, tmp_path):
    guard = start_guard(["--kubeconfig", dead_kubeconfig, "--tls-min-version", "1.3",
                         "--audit-db", str(tmp_path / "audit.db")], tls=tls_files(pki), wait="/healthz")
    assert handshake(guard.port, client_ctx(pki, "monitoring", maximum_version=ssl.TLSVersion.TLSv1_2)) is None
    assert handshake(guard.port, client_ctx(pki, "monitoring"))[0] == "TLSv1.3"


def test_sigterm_lets_the_request_in_flight_finish(shared_lab, lab_namespace, start_guard, tmp_path):
    """gunicorn's graceful stop still holds with GuardWorker: the answer in flight goes out, then the guard exits."""
    import signal

    name = "slow-0"
    uid = shared_lab.core_v1(0).create_namespaced_pod(lab_namespace, pod_manifest(name), _request_timeout=5).metadata.uid
    pod = {"metadata": {"name": name, "namespace": lab_namespace, "uid": uid}}
    guard = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--no-prepare", "--get-timeout", "1.5",
                         "--audit-db", str(tmp_path / "audit.db")])
    idle = dial(guard.port, "127.0.0.2")  # a connection that never sends a request: closed at the stop
    slow = shared_lab.replicas[0].faults.add("latency", method="GET",
                                             path=rf"/api/v1/namespaces/{lab_namespace}/pods/{name}$", seconds=1.0)
    try:
        replies: list[requests.Response] = []
        caller = threading.Thread(target=lambda: replies.append(
            guard.post("/filter", orjson.dumps({"Pod": pod, "NodeNames": NAMES}), timeout=5)))
        caller.start()
        # The quorum GET has reached the replica (the rule counts its hit on arrival) and is held there for 1 s.
        eventually(lambda: slow.hits >= 1, 5, what="the quorum GET under way", interval=0.01)
        guard.proc.send_signal(signal.SIGTERM)
        caller.join(timeout=5)
        assert replies and replies[0].status_code == 200, replies
        assert replies[0].json()["NodeNames"] == NAMES  # a real verdict (the GET finished), not a dropped call
        assert guard.proc.wait(timeout=12) == 0
        idle.settimeout(1)
        assert idle.recv(1) == b""
    finally:
        shared_lab.replicas[0].faults.clear()
        idle.close()


def test_keepalive_pipelining_and_the_idle_deadline(small_guard):
    guard = small_guard
    body = orjson.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}, "NodeNames": NAMES})
    one = (b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
           % len(body)) + body
    with dial(guard.port, "127.0.0.2") as s:
        sent = time.monotonic()
        s.sendall(one + b"GET /healthz HTTP/1.1\r\nHost: g\r\n\r\n" + one)  # three requests in one write
        data = b""
        while data.count(b"HTTP/1.1 200 ") < 3:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
        replies = data.split(b"HTTP/1.1 200 ")[1:]
        assert [r.rsplit(b"\r\n\r\n", 1)[1][:12] for r in replies] == [b'{"Nodes":nul', b'{"status":"o', b'{"Nodes":nul']
        assert s.recv(1) == b""  # idle past --keepalive-timeout: closed by the guard (within 5 s)
        # Not before the idle deadline, which starts after the last reply (so after ``sent``).
        assert time.monotonic() - sent >= 1.0 - TICK


@pytest.fixture(scope="module")
def budget_guard(module_guard, dead_kubeconfig, tmp_path_factory):
    """One guard on a dead apiserver for the tests below that need no fresh one (each reads its counts as
    differences): the large-requests budget and Expect/chunked framing."""
    return module_guard(["--kubeconfig", dead_kubeconfig, "--get-timeout", "0.2", "--max-body-bytes", "1000000",
                         "--max-buffered-bytes", "1500000",
                         "--audit-db", str(tmp_path_factory.mktemp("budget") / "audit.db")], wait="/healthz")


def test_large_requests_share_a_memory_budget(budget_guard):
    """Requests over 64 KiB reserve from --max-buffered-bytes what they have sent, as it arrives, until
    answered; a request whose bytes cross it gets a 503."""
    guard = budget_guard
    refused = guard.metric("ghost_guard_connections_rejected_total", reason="over-buffer-limit")
    assert guard.metric("ghost_guard_buffered_bytes") == 0
    head = (b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            b"Content-Length: 900000\r\n\r\n")
    with dial(guard.port, "127.0.0.2") as holder:
        holder.sendall(head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + b"{" + b" " * 799_999)
        eventually(lambda: guard.metric("ghost_guard_buffered_bytes") >= 800_000, 10,
                   what="the holder's 800 KB reserved as they arrived", process=guard)
        with dial(guard.port, "127.0.0.3") as s:
            s.sendall(head)
            s.sendall(b" " * 800_000)  # crosses the budget as it arrives
            reply = read_reply(s)
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
        assert b"too many large requests in flight (--max-buffered-bytes 1500000); retry" in reply
        small = orjson.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}, "NodeNames": NAMES})
        assert guard.post("/filter", small).status_code == 200  # small requests are never held back
        # The holder's body arrives and is answered: the guard releases the reservation once the reply is
        # out, before it closes the connection (guard.serving.connection ``_write``), so it is released when this returns.
        assert request_on(holder, b" " * 99_999 + b"}").startswith(b"HTTP/1.1 ")
    body = orjson.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}},
                         "NodeNames": [f"node-{i:06d}" for i in range(14000)]})
    assert 65536 < len(body) < 1000000
    assert guard.post("/filter", body).status_code == 200
    assert guard.metric("ghost_guard_connections_rejected_total", reason="over-buffer-limit") == refused + 1


def test_expect_continue_and_chunked_trailers(budget_guard):
    guard = budget_guard
    body = orjson.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}, "NodeNames": NAMES})
    with dial(guard.port, "127.0.0.2") as s:
        s.sendall(b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"  # asked before the body is sent
        s.sendall(body + b"GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
        replies = read_reply(s)
    assert replies.startswith(b"HTTP/1.1 200 ") and replies.count(b"HTTP/1.1 ") == 2, replies
    with dial(guard.port, "127.0.0.2") as s:  # chunked, split oddly, with a trailer: the Flask lane's 200
        chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
        s.sendall(b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                  b"Connection: close\r\n\r\n" + chunks + b"0\r\nX-Trailer: 1\r\n\r\n")
        reply = read_reply(s)
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
    assert orjson.loads(reply.partition(b"\r\n\r\n")[2])["NodeNames"] == NAMES


def test_over_the_limit_on_https_the_503_comes_after_a_bounded_handshake(tls_guard, pki):
    guard = tls_guard
    ctx = client_ctx(pki, "monitoring")
    held = [ctx.wrap_socket(dial(guard.port, "127.0.0.2"), server_hostname="localhost") for _ in range(2)]
    try:
        with ctx.wrap_socket(dial(guard.port, "127.0.0.2"), server_hostname="localhost") as s:
            reply = read_reply(s)
        assert reply.startswith(b"HTTP/1.1 503 "), reply
        assert b"too many connections from 127.0.0.2 (limit 2, --max-connections-per-client)" in reply
        before = time.monotonic()  # before the connection exists: the guard's handshake deadline starts later
        with dial(guard.port, "127.0.0.2") as s:  # over the limit and silent: closed at the handshake deadline
            s.sendall(b"\x16")
            assert s.recv(100) == b""  # closed by the guard (within dial's 5 s socket timeout)
            assert time.monotonic() - before >= HANDSHAKE - TICK  # not before the 2 s handshake deadline
    finally:
        for s in held:
            s.close()


def test_at_the_total_limit_a_stalled_connection_makes_room_never_a_kept_alive_one(start_guard, dead_kubeconfig,
                                                                                  tmp_path):
    guard = start_guard(["--kubeconfig", dead_kubeconfig, "--max-connections", "4", "--max-connections-per-client", "4",
                         "--audit-db", str(tmp_path / "audit.db")], wait=None)
    ready_without_keepalive(guard)  # no connection of ours left open
    healthz = b"GET /healthz HTTP/1.1\r\nHost: g\r\n\r\n"
    # Connections are admitted in the order they were made (one event loop, the kernel's accept queue).
    idle = dial(guard.port, "127.0.0.2")
    idle.sendall(healthz)
    assert idle.recv(65536).startswith(b"HTTP/1.1 200 ")  # now kept alive, idle
    silent = [dial(guard.port, "127.0.0.3") for _ in range(3)]  # 4 open: the limit
    try:
        # A new client at the limit is admitted: the oldest connection that never sent a head is closed for it.
        with dial(guard.port, "127.0.0.4") as s:
            reply = request_on(s, b"GET /healthz HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200 "), reply
        assert silent[0].recv(1) == b""  # the oldest stalled one, closed by the guard
        idle.sendall(healthz)  # the kept-alive one is still there
        assert idle.recv(65536).startswith(b"HTTP/1.1 200 ")
        for s in silent[1:]:  # the other two send a head now: 4 open again, none stalled
            s.sendall(healthz)
            assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
        silent.append(dial(guard.port, "127.0.0.4"))
        silent[-1].sendall(healthz)
        assert silent[-1].recv(65536).startswith(b"HTTP/1.1 200 ")
        with dial(guard.port, "127.0.0.5") as s:  # none stalled: the newcomer is refused, nobody is evicted
            assert read_reply(s).startswith(b"HTTP/1.1 503 ")
        metrics = request_on(idle, METRICS)
        assert metric_in(metrics, "ghost_guard_connections_rejected_total", reason="stalled-evicted") == 1
        assert metric_in(metrics, "ghost_guard_connections_rejected_total", reason="over-total-limit") == 1
        assert metric_in(metrics, "ghost_guard_connections_rejected_total", reason="idle-evicted") == 0
    finally:
        idle.close()
        for s in silent:
            s.close()
