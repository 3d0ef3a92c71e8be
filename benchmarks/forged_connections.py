"""Forged calls and exhausted connections (issue 25, holes 3-6), measured against one real guard each.

- ``rss``: worker peak RSS (VmHWM) with 300 connections (60 from each of 127.0.0.2-6) that never
  read, each having sent the most amplifying request the defaults accept (``--fail-closed``: every
  node refused, 15,000 distinct names of at most 3 characters, the longest pod name).
- ``stalled``: kube-scheduler's kept-alive mTLS connection (127.0.0.1) calling ``/filter`` back to
  back, plus a new mTLS connection every 100 ms, while 512 silent connections from 127.0.0.2-9 (64
  each) are kept open (reopened as the guard closes them), then while 1,100 from 127.0.0.2 alone are.
- ``heads``: five ~100-byte heads declaring 4 MiB bodies, stalled; then 20 legitimate 650 KB calls.
- ``flood``: a kept-alive ``/filter`` (127.0.0.1) while 127.0.0.2 sends 16 threads of 63 KiB calls,
  then 4 threads of the largest accepted bodies (15,000 names, decoded whole).

Every guard reads an apiserver that does not exist (a closed port: every quorum GET fails at once,
the calls fail open). Bounded: each phase runs ``--seconds`` (default 10). Loopback only.

Run from the repository root: ``python -m benchmarks.forged_connections [--only rss,stalled,heads,flood]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import platform
import socket
import ssl
import statistics
import tempfile
import threading
import time
from pathlib import Path

import orjson

from guard.tools.certs import generate
from guard.lab.harness import GuardProcess, child_pids, tls_files

DEAD = ("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'http://127.0.0.1:9'}\n"
        "users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
        "current-context: x\n")
POD = {"metadata": {"name": "web-0", "namespace": "default", "uid": "5d0e8a52-2f4e-4f8e-9c2a-7b1d2e3f4a5b"}}


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(key)


def names_body(names: list[str], pod: dict = POD) -> bytes:
    return b'{"Pod":' + orjson.dumps(pod) + b',"Nodes":null,"NodeNames":' + orjson.dumps(names) + b"}"


def call(body: bytes, close: bool = False) -> bytes:
    return (b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"") + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def dial(port: int, source: str, rcvbuf: int | None = None, timeout: float = 5) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((source, 0))
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    return s


def one_reply(s) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(x.split(b":", 1)[1] for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")))
    got, parts = len(body), [body]
    while got < length:
        chunk = s.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed mid-reply")
        got += len(chunk)
        parts.append(chunk)
    return head


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def start(args: list[str], tmp: Path, **kw) -> GuardProcess:
    (tmp / "kc").write_text(DEAD)
    g = GuardProcess(["--kubeconfig", str(tmp / "kc"), "--get-timeout", "0.2", "--no-access-log",
                      "--audit-db", str(tmp / f"a{time.monotonic_ns()}.db"), *args], **kw)
    g.wait("/healthz", timeout=120)
    return g


def smallest_names(n: int) -> list[str]:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = list(digits)
    out += [a + b for a in digits for b in digits]
    out += [a + b + c for a in digits for b in digits for c in digits]
    return out[:n]


def rss(tmp: Path) -> None:
    g = start(["--fail-closed"], tmp)
    try:
        (worker,) = g.workers()
        before = status_kb(worker, "VmHWM")
        pod = {"metadata": {"name": "n" * 253, "namespace": "s" * 63, "uid": "u" * 36}}
        request = call(names_body(smallest_names(15_000), pod))
        socks = []
        for i in range(300):
            s = dial(g.port, f"127.0.0.{2 + i // 60}", rcvbuf=4096)
            s.sendall(request)
            socks.append(s)
        deadline = time.monotonic() + 30
        answered = 0.0
        while time.monotonic() < deadline:  # every call answered (the access log is off: count the verdicts)
            answered = g.metric("ghost_guard_verdicts_total") + g.metric(
                "ghost_guard_connections_rejected_total", reason="over-buffer-limit") + g.metric(
                "ghost_guard_connections_rejected_total", reason="over-client-calls")
            if answered >= 300:
                break
            time.sleep(0.5)
        after = status_kb(worker, "VmHWM")
        held = g.metric("ghost_guard_buffered_bytes")
        refused = g.metric("ghost_guard_connections_rejected_total", reason="over-buffer-limit")
        turns = g.metric("ghost_guard_connections_rejected_total", reason="over-client-calls")
        print(f"| rss | request {len(request)} B, reply ~{15_000 * 58 // 1024} KiB each | 300 never read | "
              f"VmHWM {before / 1024:.1f} -> **{after / 1024:.1f} MiB**; {held / 2**20:.1f} MiB held at the end; "
              f"503s: {refused:.0f} over --max-buffered-bytes, {turns:.0f} whose turn did not come within the "
              f"budget; {answered:.0f} of 300 answered |")
        for s in socks:
            s.close()
    finally:
        g.stop()


class Flood:
    """Keep ``count`` silent connections per source address open for the run (reopened when closed), from
    a process of its own per address (so the measuring client shares no GIL with it)."""

    def __init__(self, port: int, sources: list[str], count: int) -> None:
        self.stop = multiprocessing.Event()
        self.opened = multiprocessing.Value("i", 0)
        self.procs = [multiprocessing.Process(target=_keep_open, args=(port, src, count, self.stop, self.opened),
                                              daemon=True) for src in sources]
        for proc in self.procs:
            proc.start()

    def close(self) -> None:
        self.stop.set()
        for proc in self.procs:
            proc.join(10)


def _keep_open(port: int, source: str, count: int, stop, opened) -> None:
    socks: list[socket.socket] = []
    while not stop.is_set():
        for s in list(socks):
            try:
                if s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                    socks.remove(s)
                    s.close()
            except BlockingIOError:
                pass
            except OSError:
                socks.remove(s)
                s.close()
        while len(socks) < count and not stop.is_set():
            try:
                socks.append(dial(port, source, timeout=1))
                with opened.get_lock():
                    opened.value += 1
            except OSError:
                break
        stop.wait(0.2)
    for s in socks:
        s.close()


def scheduler_calls(g: GuardProcess, ctx: ssl.SSLContext, seconds: float) -> tuple[int, int, list[float], int, int]:
    """(ok, failed, latencies, new connections ok, new failed): a kept-alive connection calling back to back
    (reconnecting on a failure) and a new connection every 100 ms, for ``seconds``."""
    request = call(names_body([f"node-{i}" for i in range(100)]))
    ok = failed = new_ok = new_failed = 0
    lat: list[float] = []
    stop = time.monotonic() + seconds
    news: list[int] = [0, 0]

    def newcomer() -> None:
        while time.monotonic() < stop:
            try:
                with ctx.wrap_socket(dial(g.port, "127.0.0.1", timeout=5), server_hostname="localhost") as s:
                    s.sendall(call(names_body(["node-a"]), close=True))
                    if one_reply(s).startswith(b"HTTP/1.1 200 "):
                        news[0] += 1
                    else:
                        news[1] += 1
            except (OSError, ssl.SSLError, ConnectionError):
                news[1] += 1
            time.sleep(0.1)

    t = threading.Thread(target=newcomer, daemon=True)
    t.start()
    conn = None
    while time.monotonic() < stop:
        try:
            if conn is None:
                conn = ctx.wrap_socket(dial(g.port, "127.0.0.1", timeout=5), server_hostname="localhost")
            t0 = time.perf_counter()
            conn.sendall(request)
            head = one_reply(conn)
            lat.append(time.perf_counter() - t0)
            if head.startswith(b"HTTP/1.1 200 "):
                ok += 1
            else:
                failed += 1
        except (OSError, ssl.SSLError, ConnectionError):
            failed += 1
            if conn is not None:
                conn.close()
            conn = None
    if conn is not None:
        conn.close()
    t.join(10)
    new_ok, new_failed = news
    return ok, failed, lat, new_ok, new_failed


def stalled(tmp: Path, seconds: float) -> None:
    pki = generate(tmp / "pki", ips=["127.0.0.1"])
    g = start([], tmp, tls=tls_files(pki))
    ctx = ssl.create_default_context(cafile=str(pki.ca_cert))
    ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    try:
        for label, sources, count in (("512 silent from 8 addresses", [f"127.0.0.{a}" for a in range(2, 10)], 64),
                                      ("1,100 silent from 1 address", ["127.0.0.2"], 1100)):
            # kube-scheduler's connection is open (and has called) before the attack
            flood = Flood(g.port, sources, count)
            time.sleep(2)  # let the flood reach its size (a benchmark, not a test)
            ok, failed, lat, new_ok, new_failed = scheduler_calls(g, ctx, seconds)
            flood.close()
            rate = ok / max(1, ok + failed) * 100
            print(f"| stalled | {label} (opened {flood.opened.value} in all) | kept-alive: {ok} of {ok + failed} "
                  f"(**{rate:.2f} %**), p50 {p(lat, 0.5):.1f} ms, **p99 {p(lat, 0.99):.1f} ms**; new mTLS "
                  f"connections: {new_ok} of {new_ok + new_failed} |")
            time.sleep(3)
    finally:
        g.stop()


def heads(tmp: Path) -> None:
    g = start(["--header-timeout", "30", "--body-timeout", "30"], tmp)
    try:
        stalled_socks = []
        for _ in range(5):
            s = dial(g.port, "127.0.0.2")
            s.sendall(b"POST /filter HTTP/1.1\r\nHost: g\r\nContent-Type: application/json\r\n"
                      b"Expect: 100-continue\r\nContent-Length: 4194304\r\n\r\n")
            s.recv(100)  # 100 Continue: the head was read
            stalled_socks.append(s)
        large = call(names_body([f"node-{i:05d}".ljust(63, "x") for i in range(10_000)]), close=True)
        refused = 0
        for _ in range(20):
            with dial(g.port, "127.0.0.1", timeout=10) as s:
                s.sendall(large)
                if not one_reply(s).startswith(b"HTTP/1.1 200 "):
                    refused += 1
        print(f"| heads | 5 stalled heads declaring 4 MiB | **{refused} of 20** legitimate {len(large) // 1024} KiB "
              f"calls refused |")
        for s in stalled_socks:
            s.close()
    finally:
        g.stop()


def flood(tmp: Path, seconds: float) -> None:
    g = start([], tmp)
    try:
        names63k = [f"n{i:05d}" for i in range(7000)]
        small_flood = call(names_body(names63k, {"metadata": {"name": "forged", "namespace": "x", "uid": "f"}}))
        assert len(small_flood) < 64 * 1024
        long = [f"node-{i:05d}-".ljust(253, "x") for i in range(15_000)]
        big_flood = call(orjson.dumps({"NodeNames": long, "Pod": {"metadata": {"name": "forged", "namespace": "x"}}}))
        for label, request, threads in (("none (baseline, same machine, same minute)", b"", 0),
                                        ("16 processes x 63 KiB calls", small_flood, 16),
                                        (f"4 processes x {len(big_flood) // 2**20:.0f} MiB calls (decoded whole)",
                                         big_flood, 4)):
            stop = multiprocessing.Event()
            sent = multiprocessing.Value("i", 0)
            ts = [multiprocessing.Process(target=_attacker, args=(g.port, request, stop, sent), daemon=True)
                  for _ in range(threads)]
            for t in ts:
                t.start()
            time.sleep(1)
            legit = call(names_body([f"node-{i}" for i in range(100)]))
            lat: list[float] = []
            failed = 0
            end = time.monotonic() + seconds
            with dial(g.port, "127.0.0.1") as s:
                while time.monotonic() < end:
                    t0 = time.perf_counter()
                    s.sendall(legit)
                    if not one_reply(s).startswith(b"HTTP/1.1 200 "):
                        failed += 1
                    lat.append(time.perf_counter() - t0)
            stop.set()
            for t in ts:
                t.join(20)
            print(f"| flood | {label} ({sent.value} forged calls answered) | legit kept-alive: {len(lat)} calls, "
                  f"{failed} failed, p50 {p(lat, 0.5):.1f} ms, **p99 {p(lat, 0.99):.1f} ms**, max {p(lat, 1):.1f} ms |")
        worker = g.workers()[0]
        helpers = [pid for pid in child_pids(worker) if b"guard.serving.offload" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        print(f"| flood | peak RSS (VmHWM) | worker {status_kb(worker, 'VmHWM') / 1024:.1f} MiB; helper processes: "
              + (", ".join(f"{status_kb(h, 'VmHWM') / 1024:.1f} MiB" for h in helpers) or "none")
              + f"; helper calls late (503) {g.logs(tail=None).count('missed its deadline')}, failed (answered by the "
              f"worker) {g.logs(tail=None).count('the worker answers it itself')} |")
    finally:
        g.stop()


def _attacker(port: int, request: bytes, stop, sent) -> None:
    """A forged caller (a process of its own): sends ``request`` and reads the reply, back to back."""
    while not stop.is_set():
        try:
            with dial(port, "127.0.0.2", timeout=10) as s:
                while not stop.is_set():
                    s.sendall(request)
                    one_reply(s)
                    with sent.get_lock():
                        sent.value += 1
        except (OSError, ConnectionError):
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="rss,stalled,heads,flood")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {model}, Python {platform.python_version()}\n")
    print("| phase | attack | result |\n|---|---|---|")
    only = args.only.split(",")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "rss" in only:
            rss(tmp)
        if "stalled" in only:
            stalled(tmp, args.seconds)
        if "heads" in only:
            heads(tmp)
        if "flood" in only:
            flood(tmp, args.seconds)


if __name__ == "__main__":
    main()
