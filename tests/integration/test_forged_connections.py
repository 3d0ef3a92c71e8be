"""Forged calls and exhausted connections (issue 25, holes 3-6) against a real ``ghost-guard serve``,
over real loopback sockets.

3. a request must not make the guard allocate or send much more than it read: one short reason per
   node, ``--max-nodes`` in names mode too, reply bytes held against ``--max-buffered-bytes``;
4. a kept-alive connection (kube-scheduler's) survives a flood of stalled connections, and
   connections refused from one address cost the other clients nothing;
5. stalled request heads reserve nothing from ``--max-buffered-bytes`` (bytes are reserved as they
   arrive, never from a declared Content-Length);
6. large calls from one address take one pool thread at a time: another client's call is not
   queued behind them.

Every wait is on the guard's state (its metrics, its replies, what reached its apiserver); every
attack is bounded in count and stays on 127.0.0.0/8.
"""

from __future__ import annotations

import socket
import ssl
import threading

import orjson
import pytest

from guard.tools.certs import generate
from guard.lab.harness import eventually, tls_files
from test_serving_deadlines import METRICS, client_ctx, dial, metric_in, read_reply, request_on

pytestmark = pytest.mark.timeout(240)

POD = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("pki"), ips=["127.0.0.1"])


def serving(start_guard, args: list[str], **options):
    """A guard answering /healthz (a shared 2-core machine may take a while to boot one)."""
    guard = start_guard(args, wait=None, **options)
    guard.wait("/healthz", timeout=90)
    return guard


def filter_call(body: bytes, close: bool = False) -> bytes:
    return (b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"") + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def names_body(names: list[str], pod: dict = POD) -> bytes:
    """kube-scheduler's names-mode body (Go's field order)."""
    return b'{"Pod":' + orjson.dumps(pod) + b',"Nodes":null,"NodeNames":' + orjson.dumps(names) + b"}"


def one_reply(s: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one reply with a Content-Length on a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed by the guard after {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        chunk = s.recv(65536)
        assert chunk, "closed by the guard mid-reply"
        body += chunk
    return head, body


# --- 3. amplification ------------------------------------------------------------------------------


def test_a_blocked_pod_s_reply_names_each_node_with_a_short_reason(start_guard, dead_kubeconfig, tmp_path):
    """The pod's identity is not repeated per node: 10,000 three-character names with the longest pod
    name make a reply under 8 times the request (it was 103 times, with the whole reason per node)."""
    guard = serving(start_guard, ["--kubeconfig", dead_kubeconfig, "--fail-closed", "--get-timeout", "0.2",
                         "--audit-db", str(tmp_path / "audit.db")])
    pod = {"metadata": {"name": "n" * 253, "namespace": "s" * 63, "uid": "u" * 36}}
    names = [f"{i:03x}"[:3] for i in range(4096)] * 2 + [f"{i:03x}"[:3] + "z" for i in range(1808)]
    body = names_body(names, pod)
    assert len(body) < 64 * 1024
    reply = guard.post("/filter", body)
    assert reply.status_code == 200, reply.text[:300]
    failed = reply.json()["FailedAndUnresolvableNodes"]
    assert set(failed.values()) == {"unknown: failing closed (see kube-ghost-guard log)"}
    assert len(reply.content) < 8 * len(body), (len(reply.content), len(body))


def test_max_nodes_bounds_names_mode_too(start_guard, dead_kubeconfig, tmp_path):
    guard = serving(start_guard, ["--kubeconfig", dead_kubeconfig, "--max-nodes", "100", "--get-timeout", "0.2",
                         "--audit-db", str(tmp_path / "audit.db")])
    names = [f"node-{i}" for i in range(101)]
    for body in (names_body(names), orjson.dumps({"NodeNames": names, "Pod": POD})):  # fast path and decoded
        reply = guard.post("/filter", body)
        assert reply.status_code == 413, reply.text[:300]
        assert reply.json() == {"error": "NodeNames has 101 nodes, more than the limit of 100 (--max-nodes); a "
                                         "Kubernetes cluster has at most 5,000 nodes"}
    assert guard.post("/filter", names_body(names[:100])).status_code == 200


def test_unread_replies_hold_the_buffer_budget(start_guard, dead_kubeconfig, tmp_path):
    """Clients that never read their replies hold at most --max-buffered-bytes of them: a reply that
    does not fit is a short 503 instead. Each reply (100,000 nodes refused, about 6 MB) is larger
    than what the kernel's socket buffers take (tcp_wmem's 4 MiB at most)."""
    budget = 8 * 1024 * 1024
    guard = serving(start_guard, ["--kubeconfig", dead_kubeconfig, "--fail-closed", "--get-timeout", "0.2",
                                  "--max-body-bytes", str(1024 * 1024), "--max-buffered-bytes", str(budget),
                                  "--max-nodes", "100000", "--audit-db", str(tmp_path / "audit.db")])
    names = [f"{i:05x}" for i in range(100_000)]
    request = filter_call(names_body(names))
    readers = [dial(guard.port, "127.0.0.2", rcvbuf=4096) for _ in range(3)]
    try:
        for s in readers:
            s.sendall(request)  # and never read
        eventually(lambda: guard.metric("ghost_guard_connections_rejected_total", reason="over-buffer-limit") >= 1,
                   30, what="a reply refused for the budget", process=guard)
        held = guard.metric("ghost_guard_buffered_bytes")
        assert held <= budget, held
        replies = b""
        for s in readers:  # the ones refused got a 503 with the reason
            s.setblocking(False)
            try:
                replies += s.recv(4096)
            except BlockingIOError:
                pass
        assert b"does not fit --max-buffered-bytes (8388608) while other replies wait to be read; retry" in replies
    finally:
        for s in readers:
            s.close()
    eventually(lambda: guard.metric("ghost_guard_buffered_bytes") == 0, 20, what="the budget given back",
               process=guard)
    with dial(guard.port, "127.0.0.3") as s:  # a reader is served whole
        s.settimeout(20)
        s.sendall(request)
        head, body = one_reply(s)
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert len(orjson.loads(body)["FailedAndUnresolvableNodes"]) == 100_000


# --- 4. connection exhaustion ----------------------------------------------------------------------


def test_kept_alive_connections_survive_stalled_and_refused_floods(start_guard, pki, dead_kubeconfig, tmp_path):
    """At the total limit, stalled connections (no request head yet) only displace each other: the
    scheduler's kept-alive mTLS connection keeps answering, and new clients get in. 150 connections
    from one address beyond its limit are refused without holding the hard cap (twice the total
    limit) while their handshakes would run."""
    guard = serving(start_guard, ["--kubeconfig", dead_kubeconfig, "--get-timeout", "0.2", "--max-connections", "40",
                         "--max-connections-per-client", "8", "--tls-handshake-timeout", "20",
                         "--header-timeout", "20", "--audit-db", str(tmp_path / "audit.db")],
                        tls=tls_files(pki))
    call = filter_call(names_body(["node-a", "node-b"]))
    scheduler = client_ctx(pki).wrap_socket(dial(guard.port, "127.0.0.1"), server_hostname="localhost")
    monitor = client_ctx(pki, "monitoring").wrap_socket(dial(guard.port, "127.0.0.1"), server_hostname="localhost")
    held: list[socket.socket] = []

    def metric(name: str, **labels: str) -> float:
        monitor.sendall(METRICS.replace(b"Connection: close\r\n", b""))
        head, body = one_reply(monitor)
        return metric_in(head + b"\r\n\r\n" + body, name, **labels)

    def new_clients_get_in() -> None:
        for _ in range(5):
            with client_ctx(pki).wrap_socket(dial(guard.port, "127.0.0.1"), server_hostname="localhost") as s:
                assert request_on(s, filter_call(names_body(["node-a"]), close=True)).startswith(b"HTTP/1.1 200 ")

    try:
        scheduler.sendall(call)
        assert one_reply(scheduler)[0].startswith(b"HTTP/1.1 200 ")
        # 150 connections from one address, silent (their handshakes would run until the 20 s deadline):
        # 8 admitted, 142 refused, of which at most max(16, 40 / 8) wait for a handshake to say why
        held += [dial(guard.port, "127.0.0.9") for _ in range(150)]
        eventually(lambda: metric("ghost_guard_connections_rejected_total", reason="over-client-limit") >= 142, 20,
                   what="the one address's connections refused", process=guard)
        new_clients_get_in()  # the refused ones hold no room (they did, up to twice --max-connections)
        # 48 stalled connections from 6 more addresses (8 each, the per-client limit): the total limit of 40
        # is reached, and every connection over it displaces the oldest stalled one of the address with
        # the most connections (here, the first flood's own), never a connection that has sent a request
        held += [dial(guard.port, f"127.0.0.{a}") for a in range(2, 8) for _ in range(8)]
        eventually(lambda: metric("ghost_guard_connections_rejected_total", reason="stalled-evicted")
                   + metric("ghost_guard_connections_rejected_total", reason="over-client-limit") >= 142 + 18, 20,
                   what="the 18 connections over the total limit displacing stalled ones", process=guard)
        for _ in range(20):  # the scheduler's kept-alive connection answers every call
            scheduler.sendall(call)
            assert one_reply(scheduler)[0].startswith(b"HTTP/1.1 200 ")
        new_clients_get_in()  # each in place of a stalled connection
        assert metric("ghost_guard_connections_rejected_total", reason="idle-evicted") == 0
    finally:
        for s in held + [scheduler, monitor]:
            s.close()


# --- 5. stalled heads ------------------------------------------------------------------------------


def test_stalled_heads_reserve_nothing_from_the_buffer_budget(start_guard, dead_kubeconfig, tmp_path):
    """Five heads declaring the largest body (4 MiB each, 20 MiB in all against the 16 MiB default
    budget), read by the guard (it answers 100 Continue) and never followed by their bodies: large
    legitimate requests are still served."""
    guard = serving(start_guard, ["--kubeconfig", dead_kubeconfig, "--get-timeout", "0.2", "--header-timeout", "20",
                         "--body-timeout", "20", "--audit-db", str(tmp_path / "audit.db")])
    stalled = [dial(guard.port, "127.0.0.2") for _ in range(5)]
    try:
        for s in stalled:
            s.sendall(b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                      b"Expect: 100-continue\r\nContent-Length: 4194304\r\n\r\n")
            assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"  # the head was read
        large = names_body([f"node-{i:05d}".ljust(63, "x") for i in range(10_000)])
        assert len(large) > 600_000
        for _ in range(5):
            reply = guard.post("/filter", large)
            assert reply.status_code == 200, reply.text[:300]
        assert guard.metric("ghost_guard_connections_rejected_total", reason="over-buffer-limit") == 0
    finally:
        for s in stalled:
            s.close()


# --- 6. large forged calls -------------------------------------------------------------------------


class HangingApiserver:
    """A TCP server that reads request heads and never answers: every quorum GET the guard makes
    waits out --get-timeout. Records the pod name of each GET, in arrival order."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=256)
        self.port = self.listener.getsockname()[1]
        self.gets: list[str] = []
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                s, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.socks.append(s)
            threading.Thread(target=self._read, args=(s,), daemon=True).start()

    def _read(self, s: socket.socket) -> None:
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            data += chunk
            while b"\r\n\r\n" in data:
                head, _, data = data.partition(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                if "/pods/" in path and "watch" not in path:
                    with self.lock:
                        self.gets.append(path.rsplit("/pods/", 1)[1].split("?")[0])

    def kubeconfig(self, path) -> str:
        path.write_text("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: "
                        f"'http://127.0.0.1:{self.port}'}}\nusers:\n- name: u\n  user: {{token: t}}\ncontexts:\n"
                        "- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n")
        return str(path)

    def close(self) -> None:
        self.stopped = True
        self.listener.close()
        with self.lock:
            for s in self.socks:
                s.close()


def test_large_calls_of_one_address_take_one_thread_at_a_time(start_guard, tmp_path):
    """20 large calls (over 16 KiB) at once from one address, each waiting 1.5 s on its quorum GET:
    one runs, the others wait their turn without a thread (ghost_guard_calls_queued), so another
    client's large call reaches the apiserver at once, not after 16 threads' worth of them."""
    api = HangingApiserver()
    try:
        guard = serving(start_guard, ["--kubeconfig", api.kubeconfig(tmp_path / "kc"), "--no-prepare", "--get-timeout", "1.5",
                             "--audit-db", str(tmp_path / "audit.db")])
        names = [f"node-{i:05d}" for i in range(2000)]
        flood = []
        for i in range(20):
            s = dial(guard.port, "127.0.0.2")
            s.settimeout(10)
            s.sendall(filter_call(names_body(names, {"metadata": {"name": f"f{i}", "namespace": "ns", "uid": "u"}}),
                                  close=True))
            flood.append(s)
        eventually(lambda: guard.metric("ghost_guard_calls_queued") >= 19, 20, what="19 of the flood's calls queued",
                   process=guard)
        with api.lock:
            assert len(api.gets) <= 1, api.gets  # one of the flood's calls at a time
        legit = {"metadata": {"name": "legit", "namespace": "ns", "uid": "u"}}
        with dial(guard.port, "127.0.0.3") as s:
            s.settimeout(10)
            s.sendall(filter_call(names_body(names, legit), close=True))
            eventually(lambda: "legit" in api.gets, 10, what="the other client's GET", process=guard)
            with api.lock:
                before = api.gets[:api.gets.index("legit")]
            assert len(before) <= 2, before  # not behind 16 of the flood's calls (gunicorn's thread pool)
            assert read_reply(s).startswith(b"HTTP/1.1 200 ")  # failing open after its GET timed out
        for s in flood:  # every flood call answered in turn or refused with the reason, within its budget
            reply = read_reply(s)
            assert reply.startswith(b"HTTP/1.1 200 ") or b"too many large calls from 127.0.0.2" in reply, reply[:200]
            s.close()
    finally:
        api.close()
