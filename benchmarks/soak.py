"""Soak: a steady /filter load on a real guard over a real lab, then a flood of distinct ghost UIDs.

One command::

    python -m benchmarks.soak --minutes 10        # from the repository root

Assumption: one kube-scheduler schedules at most ~100 pods/s (its default
client QPS is 50; large tuned clusters report ~100-300 pods/s), and calls the
extender's /filter once per scheduling attempt. The load is 3x that: 300
/filter per second, open loop (every request has a scheduled send time; a slow
answer does not slow the load down, and latency is measured from the scheduled
time, so queueing is not hidden).

Phase 1, steady (``--minutes``): the mix is live pods (pending pods that exist;
the guard must pass them), recurring ghosts (real ghosts: deleted, still served
by a stale replica's watch cache; the guard must reject them) and new ghost
UIDs (pods that never existed, each request a fresh UID). About 1 % of the
guard's quorum GETs are answered 500 by the lab (a ``status`` fault with a
``count`` topped up every second from the guard's own GET counter): those
requests fail open (counted).

Phase 2, bound (``--flood-uids``): distinct ghost UIDs as fast as the guard
takes them, to show the ghost cache stays at ``--ghost-cache-size``: the most
recent UIDs are still cached (no new block when re-sent), the oldest are
evicted (re-sent, each is blocked anew), and RSS stays flat.

Reports (stdout, and JSON to ``--out``): failed requests (transport errors,
non-200, malformed replies, live pods rejected, cached ghosts passed: must all
be 0), p50/p99/max latency, RSS of the guard's worker every 10 s, the fail-open
count, and the cache-bound check. Needs the ``lab`` extra.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import orjson

from benchmarks.soak_lab import LabProcess
from guard.lab.harness import GuardProcess, child_pids, metric_sum, parse_metrics, stop_group

REPO = Path(__file__).resolve().parent.parent

NODE_NAMES = [f"node-{i}" for i in range(50)]
SCHEDULER_HTTP_TIMEOUT = 5.0  # kube-scheduler's extender httpTimeout: a later reply is a failed request
FILTER_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


# --- processes -----------------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Guard(GuardProcess):
    """``ghost-guard serve`` over plain HTTP, none of the caller's ``GHOST_GUARD_*``, logs in the work directory.
    /metrics is scraped with ``request()`` (a fresh http.client connection each time), like the load itself."""

    def __init__(self, kubeconfig: str, workdir: Path, extra: list[str]) -> None:
        super().__init__(["--kubeconfig", kubeconfig, "--audit-db", str(workdir / "audit.db"), *extra],
                         clean_env=True, cwd=REPO, logdir=workdir)
        self.log_path = Path(self.log.name)

    def wait_ready(self, timeout: float = 60) -> None:
        try:
            self.wait("/readyz", timeout)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None

    def worker(self) -> int | None:
        kids = self.workers()
        return kids[0] if kids else None

    def metrics(self) -> dict[tuple, float]:
        _, body = request(self.port, "GET", "/metrics")
        return parse_metrics(body.decode())


def histogram_quantile(before: dict, after: dict, name: str, q: float, **labels: str) -> float | None:
    """Upper bound (seconds) of the bucket holding quantile ``q`` of a histogram's samples between two scrapes."""
    buckets: dict[float, float] = {}
    for (n, lab), v in after.items():
        d = dict(lab)
        if n == name + "_bucket" and all(d.get(k) == x for k, x in labels.items()):
            le = float(d["le"])
            buckets[le] = buckets.get(le, 0) + v - before.get((n, lab), 0)
    if not buckets:
        return None
    total = buckets[max(buckets)]
    if total <= 0:
        return None
    for le in sorted(buckets):
        if buckets[le] >= q * total:
            return le
    return float("inf")


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes and their reaped children (seconds)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / tick
    return total


def request(port: int, method: str, path: str, body: bytes | None = None, conn: http.client.HTTPConnection | None = None
            ) -> tuple[int, bytes]:
    own = conn is None
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        if own:
            c.close()


# --- load ---------------------------------------------------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latencies: list[float] = []  # from the scheduled send time
        self.service: list[float] = []  # from the actual send
        self.failures: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.kinds: Counter[str] = Counter()
        self.passed_ghosts = 0  # ghosts passed (fail open on an apiserver error): counted, not failures

    def fail(self, why: str, detail: str) -> None:
        with self.lock:
            self.failures[why] += 1
            self.examples.setdefault(why, detail[:500])


def filter_body(namespace: str, name: str, uid: str) -> bytes:
    return orjson.dumps({"Pod": {"metadata": {"name": name, "namespace": namespace, "uid": uid},
                                 "spec": {"schedulerName": "default-scheduler"}, "status": {"phase": "Pending"}},
                         "Nodes": None, "NodeNames": NODE_NAMES})


def check_reply(stats: Stats, kind: str, status: int, data: bytes) -> None:
    if status != 200:
        stats.fail(f"http-{status}", data.decode(errors="replace"))
        return
    try:
        reply = orjson.loads(data)
    except orjson.JSONDecodeError:
        stats.fail("malformed-reply", data.decode(errors="replace"))
        return
    if set(reply) != FILTER_KEYS or reply["Nodes"] is not None:
        stats.fail("malformed-reply", str(reply))
        return
    passed = reply["NodeNames"] == NODE_NAMES and not reply["FailedAndUnresolvableNodes"]
    rejected = reply["NodeNames"] == [] and sorted(reply["FailedAndUnresolvableNodes"]) == sorted(NODE_NAMES)
    if not (passed or rejected):
        stats.fail("malformed-reply", str(reply)[:500])
    elif kind == "live" and rejected:
        stats.fail("live-pod-rejected", str(reply))
    elif kind == "ghost" and passed:
        with stats.lock:
            stats.passed_ghosts += 1


def run_load(port: int, rate: float, seconds: float, pick, stats: Stats, threads: int) -> int:
    """Open loop: request i is due at start + i/rate; ``threads`` senders take the next due request."""
    start = time.monotonic() + 0.2
    total = int(rate * seconds)
    counter = iter(range(total))
    counter_lock = threading.Lock()

    def sender() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        while True:
            with counter_lock:
                i = next(counter, None)
            if i is None:
                break
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            kind, body = pick(i)
            sent_at = time.monotonic()
            try:
                status, data = request(port, "POST", "/filter", body, conn)
            except (OSError, http.client.HTTPException) as e:
                stats.fail("transport", f"{type(e).__name__}: {e}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                continue
            done = time.monotonic()
            check_reply(stats, kind, status, data)
            if done - sent_at > SCHEDULER_HTTP_TIMEOUT:
                stats.fail("late", f"answered after {done - sent_at:.2f}s (kube-scheduler gives up at 5s)")
            with stats.lock:
                stats.latencies.append(done - due)
                stats.service.append(done - sent_at)
                stats.kinds[kind] += 1
        conn.close()

    workers = [threading.Thread(target=sender, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return total


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


# --- main ---------------------------------------------------------------------------------------------------


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version(),
            "kernel": platform.release(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="steady phase length")
    p.add_argument("--rate", type=float, default=300.0, help="/filter per second (3x ~100 pods/s of one scheduler)")
    p.add_argument("--mix", default="70,20,10", help="percent live pods, recurring ghosts, new ghost UIDs")
    p.add_argument("--error-percent", type=float, default=1.0, help="percent of quorum GETs answered 500 by the lab")
    p.add_argument("--live-pods", type=int, default=2000)
    p.add_argument("--ghost-pods", type=int, default=50)
    p.add_argument("--ghost-cache-size", type=int, default=10_000, help="the guard's --ghost-cache-size")
    p.add_argument("--flood-uids", type=int, default=1_000_000, help="distinct ghost UIDs in phase 2 (0: skip)")
    p.add_argument("--flood-minutes", type=float, default=15.0, help="phase 2 stops after this long even if short")
    p.add_argument("--threads", type=int, default=32, help="load-generator connections (requests in flight at most)")
    p.add_argument("--guard-arg", action="append", default=[], help="extra `ghost-guard serve` argument (repeatable)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "soak_last.json"), help="JSON report path")
    return p.parse_args(argv)


def decide_ghosts(guard: Guard, st: dict) -> None:
    """Ghosts are decided once before the load: a ghost seen the first time during an injected 500 would pass."""
    for name, uid in st["ghosts"]:
        status, data = request(guard.port, "POST", "/filter", filter_body(st["namespace"], name, uid))
        assert status == 200 and orjson.loads(data)["FailedAndUnresolvableNodes"], (name, data[:300])


# --- background threads: RSS and counter samples, the 500 fault ------------------------------------------


class Sampler:
    """Every 10 s until ``stop`` is set: the guard's RSS and counters, appended to ``samples`` and printed."""

    def __init__(self, guard: Guard, stop: threading.Event) -> None:
        self.guard = guard
        self.stop = stop
        self.samples: list[dict] = []
        self.t0 = time.monotonic()

    def thread(self) -> threading.Thread:
        return threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        guard = self.guard
        while True:
            worker = guard.worker()
            m = guard.metrics()
            self.samples.append({
                "t": round(time.monotonic() - self.t0, 1), "worker_rss_mb": round(rss_mb(worker), 1) if worker else None,
                "arbiter_rss_mb": round(rss_mb(guard.proc.pid), 1),
                "ghosts_blocked": metric_sum(m, "ghost_guard_ghosts_blocked_total"),
                "fail_open": metric_sum(m, "ghost_guard_fail_open_total"),
                "quorum_gets": metric_sum(m, "ghost_guard_quorum_get_duration_seconds_count"),
                "requests": metric_sum(m, "ghost_guard_requests_total", endpoint="/filter"),
                "followups_dropped": metric_sum(m, "ghost_guard_followups_dropped_total"),
            })
            s = self.samples[-1]
            print(f"  t={s['t']:>6}s worker RSS {s['worker_rss_mb']} MB, /filter {int(s['requests'])}, "
                  f"quorum GETs {int(s['quorum_gets'])}, fail-open {int(s['fail_open'])}, "
                  f"ghosts blocked {int(s['ghosts_blocked'])}, follow-ups dropped {int(s['followups_dropped'])}", flush=True)
            if self.stop.wait(10):
                return


class Injector:
    """Top up a 500 fault so that ~error_percent of the guard's quorum GETs fail; ``injected`` counts them."""

    def __init__(self, lab: LabProcess, guard: Guard, error_percent: float, stop: threading.Event) -> None:
        self.lab = lab
        self.guard = guard
        self.error_percent = error_percent
        self.stop = stop
        self.injected = 0

    def thread(self) -> threading.Thread:
        return threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        debt = 0.0
        last = metric_sum(self.guard.metrics(), "ghost_guard_quorum_get_duration_seconds_count")
        while not self.stop.wait(1.0):
            now = metric_sum(self.guard.metrics(), "ghost_guard_quorum_get_duration_seconds_count")
            debt += (now - last) * self.error_percent / 100
            last = now
            k = int(debt)
            if k >= 1:
                self.lab.add_fault(0, {"action": "status", "status": 500, "method": "GET", "count": k,
                                       "path": r"/api/v1/namespaces/[^/]+/pods/[^/]+"})
                self.injected += k
                debt -= k


# --- phase 1: steady --------------------------------------------------------------------------------------


def steady_picker(a: argparse.Namespace, st: dict):
    """The request mix: ``pick(i)`` returns (kind, /filter body), seeded so runs are comparable."""
    live_pct, ghost_pct, _new_pct = (float(x) for x in a.mix.split(","))
    rng = random.Random(42)
    ns, live, ghosts = st["namespace"], st["live"], st["ghosts"]
    cut1, cut2 = live_pct / 100, (live_pct + ghost_pct) / 100

    def pick(i: int) -> tuple[str, bytes]:
        x = rng.random()
        if x < cut1:
            name, uid = rng.choice(live)
            return "live", filter_body(ns, name, uid)
        if x < cut2:
            name, uid = rng.choice(ghosts)
            return "ghost", filter_body(ns, name, uid)
        return "new-ghost", filter_body(ns, f"never-{rng.randrange(100)}", str(uuid.uuid4()))

    return pick


def steady_phase(a: argparse.Namespace, lab: LabProcess, guard: Guard, stop_bg: threading.Event,
                 background: list[threading.Thread], injector: Injector) -> dict:
    """Phase 1: ``a.rate`` /filter per second for ``a.minutes``; stops the injector at the end; the report section."""
    pick = steady_picker(a, lab.state)
    steady = Stats()
    print(f"soak: phase 1, {a.rate:g} /filter/s for {a.minutes:g} min, mix {a.mix}, "
          f"~{a.error_percent:g}% GETs -> 500", flush=True)
    m0 = guard.metrics()
    procs = {"guard": lambda: [guard.proc.pid, *child_pids(guard.proc.pid)],
             "lab (replicas + etcd)": lambda: [lab.proc.pid, *child_pids(lab.proc.pid)],
             "load generator": lambda: [os.getpid()]}
    cpu0 = {k: cpu_seconds(f()) for k, f in procs.items()}
    p1_start = time.monotonic()
    sent = run_load(guard.port, a.rate, a.minutes * 60, pick, steady, a.threads)
    p1_secs = time.monotonic() - p1_start
    m1 = guard.metrics()
    cpu1 = {k: cpu_seconds(f()) for k, f in procs.items()}
    stop_bg.set()
    for t in background[1:]:
        t.join()
    lat = steady.latencies
    return {
        "requests": sent, "answered": len(lat), "seconds": round(p1_secs, 1),
        "achieved_rate": round(len(lat) / p1_secs, 1), "by_kind": dict(steady.kinds),
        "failed": sum(steady.failures.values()), "failures": dict(steady.failures), "examples": steady.examples,
        "latency_ms": {"p50": round(percentile(lat, 50) * 1000, 2), "p90": round(percentile(lat, 90) * 1000, 2),
                       "p99": round(percentile(lat, 99) * 1000, 2), "p999": round(percentile(lat, 99.9) * 1000, 2),
                       "max": round(max(lat) * 1000, 2) if lat else None,
                       "mean": round(statistics.fmean(lat) * 1000, 2) if lat else None},
        # From the actual send (excludes the load generator's own backlog when the guard falls behind).
        "service_ms": {f"p{q}": round(percentile(steady.service, q) * 1000, 2) for q in (50, 90, 99, 99.9)}
        | {"max": round(max(steady.service) * 1000, 2) if steady.service else None},
        "injected_500": injector.injected,
        "quorum_gets": metric_sum(m1, "ghost_guard_quorum_get_duration_seconds_count")
        - metric_sum(m0, "ghost_guard_quorum_get_duration_seconds_count"),
        "fail_open": metric_sum(m1, "ghost_guard_fail_open_total") - metric_sum(m0, "ghost_guard_fail_open_total"),
        "ghosts_passed_by_fail_open": steady.passed_ghosts,
        "followups_dropped": metric_sum(m1, "ghost_guard_followups_dropped_total")
        - metric_sum(m0, "ghost_guard_followups_dropped_total"),
        "http_500_from_guard": metric_sum(m1, "ghost_guard_requests_total", endpoint="/filter", code="500"),
        # Inside the guard (its own histogram; bucket upper bounds): excludes client-side queueing.
        "guard_side_ms": {f"p{q}": round(1000 * (histogram_quantile(
            m0, m1, "ghost_guard_request_duration_seconds", q / 100, endpoint="/filter") or float("nan")), 2)
            for q in (50, 90, 99)},
        "quorum_get_ms": {f"p{q}": round(1000 * (histogram_quantile(
            m0, m1, "ghost_guard_quorum_get_duration_seconds", q / 100) or float("nan")), 2) for q in (50, 99)},
        "cpu_share_of_2_cores": {k: round((cpu1[k] - cpu0[k]) / p1_secs / (os.cpu_count() or 1), 3) for k in cpu0},
    }


# --- phase 2: cache bound -----------------------------------------------------------------------------


def flood(a: argparse.Namespace, guard: Guard, ns: str, stats: Stats) -> list[tuple[int, str]]:
    """Distinct ghost UIDs from ``a.threads`` connections, as fast as the guard answers; the (index, UID) sent, sorted."""
    uids: list[tuple[int, str]] = []
    uid_lock = threading.Lock()
    deadline = time.monotonic() + a.flood_minutes * 60
    counter = iter(range(a.flood_uids))
    c_lock = threading.Lock()

    def flooder() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
        while time.monotonic() < deadline:
            with c_lock:
                i = next(counter, None)
            if i is None:
                break
            uid = f"flood-{i:07d}-{uuid.uuid4().hex[:8]}"
            t = time.monotonic()
            try:
                status, data = request(guard.port, "POST", "/filter", filter_body(ns, f"never-{i % 64}", uid), conn)
            except (OSError, http.client.HTTPException) as e:
                stats.fail("transport", f"{type(e).__name__}: {e}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", guard.port, timeout=10)
                continue
            check_reply(stats, "ghost", status, data)
            if time.monotonic() - t > SCHEDULER_HTTP_TIMEOUT:
                stats.fail("late", f"answered after {time.monotonic() - t:.2f}s (kube-scheduler gives up at 5s)")
            with stats.lock:
                stats.latencies.append(time.monotonic() - t)
            with uid_lock:
                uids.append((i, uid))
        conn.close()

    fl = [threading.Thread(target=flooder, daemon=True) for _ in range(a.threads)]
    for t in fl:
        t.start()
    for t in fl:
        t.join()
    uids.sort()
    return uids


def resend_blocked(guard: Guard, ns: str, sample: list[tuple[int, str]]) -> float:
    """Send these UIDs again; how many were blocked anew (not answered from the ghost cache)."""
    b = metric_sum(guard.metrics(), "ghost_guard_ghosts_blocked_total")
    for i, uid in sample:
        request(guard.port, "POST", "/filter", filter_body(ns, f"never-{i % 64}", uid))
    return metric_sum(guard.metrics(), "ghost_guard_ghosts_blocked_total") - b


def bound_phase(a: argparse.Namespace, guard: Guard, ns: str, stop_bg: threading.Event, sampler: Sampler) -> dict:
    """Phase 2: the flood, then the bound check (newest UIDs still cached, oldest evicted); the report section."""
    stop_bg.clear()
    sampler.thread().start()
    stats = Stats()
    before = guard.metrics()
    f_start = time.monotonic()
    print(f"soak: phase 2, up to {a.flood_uids} distinct ghost UIDs (at most {a.flood_minutes:g} min), "
          f"--ghost-cache-size {a.ghost_cache_size}", flush=True)
    uids = flood(a, guard, ns, stats)
    f_secs = time.monotonic() - f_start
    after = guard.metrics()
    # The bound: the most recent UIDs are still cached, the oldest were evicted.
    k = min(1000, a.ghost_cache_size // 2, len(uids) // 4)
    newest_reblocked = resend_blocked(guard, ns, uids[-k:]) if k else None
    oldest_reblocked = resend_blocked(guard, ns, uids[:k]) if k else None
    stop_bg.set()
    lat = stats.latencies
    return {
        "distinct_uids": len(uids), "seconds": round(f_secs, 1), "rate": round(len(uids) / f_secs, 1),
        "failed": sum(stats.failures.values()), "failures": dict(stats.failures), "examples": stats.examples,
        "ghosts_passed_by_fail_open": stats.passed_ghosts,
        "new_ghosts_blocked": metric_sum(after, "ghost_guard_ghosts_blocked_total")
        - metric_sum(before, "ghost_guard_ghosts_blocked_total"),
        "latency_ms": {"p50": round(percentile(lat, 50) * 1000, 2), "p99": round(percentile(lat, 99) * 1000, 2),
                       "max": round(max(lat) * 1000, 2) if lat else None},
        "resent": k, "newest_reblocked": newest_reblocked, "oldest_reblocked": oldest_reblocked,
        "cache_bounded": bool(k) and newest_reblocked == 0 and oldest_reblocked == k,
    }


# --- main ---------------------------------------------------------------------------------------------------


def conclude(report: dict, samples: list[dict], guard: Guard) -> int:
    """RSS summary, the guard's health and logged errors, and the verdict (PASS: no failed request, guard alive).
    Returns the number of failed requests."""
    report["rss_samples"] = samples
    rss = [s["worker_rss_mb"] for s in samples if s["worker_rss_mb"]]
    report["rss_mb"] = {"first": rss[0] if rss else None, "min": min(rss, default=None),
                        "max": max(rss, default=None), "last": rss[-1] if rss else None}
    report["guard_alive"] = guard.proc.poll() is None
    report["guard_errors_logged"] = sum(1 for line in guard.log_path.read_text(errors="replace").splitlines()
                                        if '"level":"error"' in line or "Traceback" in line)
    failed = report["steady"]["failed"] + report.get("bound", {}).get("failed", 0)
    report["verdict"] = "PASS" if failed == 0 and report["guard_alive"] else "FAIL"
    return failed


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ghost-soak-"))
    lab = guard = None
    stop_bg = threading.Event()
    report: dict = {"machine": machine(), "settings": vars(a)}
    print(f"soak: {report['machine']}", flush=True)
    try:
        lab = LabProcess(workdir / "lab", live=a.live_pods, ghosts=a.ghost_pods)
        st = lab.state
        guard = Guard(st["kubeconfigs"][0], workdir, ["--ghost-cache-size", str(a.ghost_cache_size), *a.guard_arg])
        guard.wait_ready()
        print(f"soak: lab {st['urls']} ({len(st['live'])} live pods, {len(st['ghosts'])} ghosts); guard {guard.cmd[2:]}",
              flush=True)
        decide_ghosts(guard, st)

        sampler = Sampler(guard, stop_bg)
        injector = Injector(lab, guard, a.error_percent, stop_bg)
        background = [sampler.thread()]
        if a.error_percent > 0:
            background.append(injector.thread())
        for t in background:
            t.start()

        report["steady"] = steady_phase(a, lab, guard, stop_bg, background, injector)
        print(f"soak: phase 1 done: {json.dumps(report['steady'])}", flush=True)
        if a.flood_uids > 0:
            report["bound"] = bound_phase(a, guard, st["namespace"], stop_bg, sampler)
            print(f"soak: phase 2 done: {json.dumps(report['bound'])}", flush=True)
        time.sleep(0.5)
        failed = conclude(report, sampler.samples, guard)
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"soak: {report['verdict']}: failed requests {failed}, steady p50 "
              f"{report['steady']['latency_ms']['p50']} ms p99 {report['steady']['latency_ms']['p99']} ms, "
              f"worker RSS {report['rss_mb']}; report in {a.out}", flush=True)
        return 0 if report["verdict"] == "PASS" else 1
    finally:
        stop_bg.set()
        if guard is not None:
            stop_group(guard.proc, term_timeout=20, kill_timeout=10)
            keep = workdir.parent / (workdir.name + "-guard.log")
            shutil.copy(guard.log_path, keep)
            print(f"soak: the guard's log is kept in {keep}", flush=True)
        if lab is not None:
            lab.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
