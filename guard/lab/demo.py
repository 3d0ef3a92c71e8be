"""``ghost-guard demo``: the seed incident end to end, then the same with the guard.

Everything runs on this machine and is cleaned up on exit:

1. a lab (real etcd + 3 apiserver replicas with watch caches); nodes ``node-a``
   and ``node-b``;
2. Pod ``default/web-1`` is created Pending, replica 2 (``lab.replicas[1]``) is
   told to drop its deletion, and the pod is deleted: the quorum GET answers
   404 while replica 2's watch cache still serves it Pending (a ghost);
3. **without the guard**: a scheduler simulator whose informer reads replica 2
   loops on the ghost (every Binding POST answers 404), while a live pod still
   schedules;
4. **with the guard**: ``ghost-guard serve`` starts as a child process over
   HTTPS with mTLS (certificates from :mod:`guard.certs`), and a new scheduler
   on replica 2 registers it as extender (``filter`` + ``preempt`` verbs,
   ``nodeCacheCapable``): the ghost is rejected on every node, the loop stops.

:func:`run_demo` prints a before/after table and returns 0 only if the guard
broke the loop (at most one failed bind with the guard, several without, and
the live pods bound in both phases).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import IO, Any

from kubernetes.client.exceptions import ApiException

from guard.lab.scheduler import ExtenderConfig, PodStats, Scheduler, Timings, TLSConfig

__all__ = ["DEMO_TIMINGS", "create_ghost", "node_manifest", "pod_manifest", "run_demo", "start_guard_process",
           "stop_group"]

# Fast but shaped like the real ones (1 s -> 10 s backoff, 1 s flush), scaled down 10x.
DEMO_TIMINGS = Timings(
    pod_initial_backoff=0.1,
    pod_max_backoff=1.0,
    backoff_flush_period=0.1,
    pod_max_in_unschedulable=30.0,
    unschedulable_flush_period=3.0,
    request_timeout=5.0,
    retry_period=0.2,
)

PHASE_SECONDS = 6.0


def node_manifest(name: str, *, cpu: str = "4", memory: str = "8Gi", pods: str = "110",
                  labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A Ready node with the given allocatable."""
    resources = {"cpu": cpu, "memory": memory, "pods": pods}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


def pod_manifest(name: str, *, namespace: str = "default", cpu: str = "100m", memory: str = "64Mi",
                 priority: int | None = None, scheduler_name: str = "default-scheduler",
                 node_selector: dict[str, str] | None = None, node_name: str = "") -> dict[str, Any]:
    """A one-container pod with requests (``node_name`` set: already bound)."""
    spec: dict[str, Any] = {
        "schedulerName": scheduler_name,
        "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10",
                        "resources": {"requests": {"cpu": cpu, "memory": memory}}}],
    }
    if priority is not None:
        spec["priority"] = priority
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if node_name:
        spec["nodeName"] = node_name
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def _discard(resp: Any) -> None:
    resp.drain_conn()
    resp.release_conn()


def _wait(cond: Any, timeout: float, what: str, interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _cached(api: Any, namespace: str, name: str) -> list[dict[str, Any]]:
    """The pod as one replica's watch cache serves it (LIST resourceVersion=0, by name)."""
    resp = api.list_namespaced_pod(namespace, field_selector=f"metadata.name={name}", resource_version="0",
                                   _preload_content=False, _request_timeout=5)
    return json.loads(resp.data).get("items") or []


def _quorum_exists(api: Any, namespace: str, name: str) -> bool:
    try:
        _discard(api.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=5))
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def create_ghost(lab: Any, stale: int, pod: dict[str, Any], *, writer: int = 0, timeout: float = 10.0) -> str:
    """Make ``pod`` a ghost on replica ``stale``: create it, drop its deletion there, delete it.

    Returns the ghost's UID once the quorum GET answers 404 and the stale
    replica's cache still serves the pod without ``deletionTimestamp``.
    """
    namespace = pod["metadata"].get("namespace", "default")
    name = pod["metadata"]["name"]
    api = lab.core_v1(writer)
    stale_api = lab.core_v1(stale)
    created = api.create_namespaced_pod(namespace, pod, _preload_content=False, _request_timeout=5)
    uid = json.loads(created.data)["metadata"]["uid"]
    _wait(lambda: _cached(stale_api, namespace, name), timeout, f"{namespace}/{name} in replica {stale}'s cache")
    lab.replicas[stale].faults.drop_deletes(namespace=namespace, name=name)
    _discard(api.delete_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=5))
    _wait(lambda: not _quorum_exists(api, namespace, name), timeout, f"{namespace}/{name} gone from etcd")
    # Every healthy replica lets it go; the stale one keeps it, not even terminating.
    for i in range(len(lab.replicas)):
        if i != stale:
            _wait(lambda i=i: not _cached(lab.core_v1(i), namespace, name), timeout,
                  f"{namespace}/{name} gone from replica {i}'s cache")
    items = _cached(stale_api, namespace, name)
    if not items or items[0]["metadata"].get("deletionTimestamp") or items[0]["metadata"].get("uid") != uid:
        raise RuntimeError(f"replica {stale} did not keep {namespace}/{name} as a ghost: {items}")
    return uid


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GuardChild:
    """``ghost-guard serve`` over HTTPS + mTLS as a child process in its own session."""

    def __init__(self, kubeconfig: str, certs: Any, workdir: Path, extra_args: list[str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.certs = certs
        self.log_path = workdir / "guard.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.cmd = [
            sys.executable, "-m", "guard", "serve",
            "--bind", f"127.0.0.1:{self.port}",
            "--kubeconfig", kubeconfig,
            "--tls-cert", str(certs.tls_cert), "--tls-key", str(certs.tls_key),
            "--client-ca", str(certs.ca_cert),
            "--no-access-log",
            "--audit-db", str(workdir / "audit.db"),
            "--stale-confirm-delay", "0.5",
            # The demo's scheduler backs off 10x faster than kube-scheduler (0.1 s, not 1 s):
            # scale the guard's windows that are sized below that backoff the same way.
            "--prepared-grace", "0.05", "--alive-ttl", "0.05",
            *(extra_args or []),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GHOST_GUARD_")}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 30.0) -> None:
        import ssl
        import urllib.request

        ctx = ssl.create_default_context(cafile=str(self.certs.ca_cert))
        # /readyz answers the monitoring role's certificate only (guard.identity)
        ctx.load_cert_chain(str(self.certs.monitoring_cert), str(self.certs.monitoring_key))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ghost-guard serve exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2, context=ctx) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"ghost-guard serve not ready after {timeout}s:\n{self.logs()}")

    def extender(self) -> ExtenderConfig:
        """The extender entry kube-scheduler would be given for this guard."""
        return ExtenderConfig(
            url_prefix=self.url,
            filter_verb="filter",
            preempt_verb="preempt",
            enable_https=True,
            tls_config=TLSConfig(ca_file=str(self.certs.ca_cert), cert_file=str(self.certs.client_cert),
                                 key_file=str(self.certs.client_key)),
            http_timeout=5.0,
            node_cache_capable=True,
            ignorable=False,
        )

    def incident_lines(self) -> list[str]:
        """The messages the guard logged about stale replicas (logger ``guard.incident``)."""
        if not self._log.closed:
            self._log.flush()
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if '"guard.incident"' in line:
                try:
                    found.append(json.loads(line)["msg"])
                except (ValueError, KeyError):
                    continue
        return found

    def logs(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-8000:]

    def stop(self) -> None:
        stop_group(self.proc)
        self._log.close()


def stop_group(proc: subprocess.Popen, term_timeout: float = 10.0, kill_timeout: float = 5.0) -> None:
    """Stop a child started in its own session: SIGTERM to its process group, SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=term_timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=kill_timeout)


def start_guard_process(kubeconfig: str, workdir: Path, extra_args: list[str] | None = None) -> GuardChild:
    """Write certificates into ``workdir`` (guard.certs) and start ``ghost-guard serve``; waits for /readyz."""
    from guard import certs as guard_certs

    bundle = guard_certs.generate(workdir / "certs", ips=["127.0.0.1"])
    child = GuardChild(kubeconfig, bundle, workdir, extra_args)
    try:
        child.wait_ready()
    except BaseException:
        child.stop()
        raise
    return child


def _phase(lab: Any, scheduler: Scheduler, live: str, out: IO[str], seconds: float) -> PodStats:
    api = lab.core_v1(0)
    _discard(api.create_namespaced_pod("default", pod_manifest(live), _preload_content=False, _request_timeout=5))
    scheduler.wait_for(lambda s: bool(s.get(f"default/{live}", PodStats()).bound_node), timeout=seconds)
    deadline = time.monotonic() + seconds
    tty = out.isatty()
    shown = -1
    ghost = PodStats()
    while time.monotonic() < deadline:
        ghost = scheduler.stats().get("default/web-1", PodStats())
        if tty and ghost.bind_failures_total != shown:
            shown = ghost.bind_failures_total
            out.write(f"\r      ghost default/web-1: {ghost.attempts} scheduling attempts, {shown} failed binds   ")
            out.flush()
        time.sleep(0.1)
    if not tty:
        out.write(f"      ghost default/web-1: {ghost.attempts} scheduling attempts, {ghost.bind_failures_total} failed binds")
    out.write("\n")
    return scheduler.stats().get(f"default/{live}", PodStats())


def run_demo(out: IO[str] = sys.stdout, *, seconds: float = PHASE_SECONDS) -> int:
    """Run the incident without then with the guard; print a before/after table.

    Returns 0 only if the guard broke the loop, 1 if it did not, 2 if the demo
    could not run. Leaves no process behind.
    """
    from guard.lab import Lab

    started = time.monotonic()
    guards: list[GuardChild] = []

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    try:
        with tempfile.TemporaryDirectory(prefix="ghost-guard-demo-") as tmp, Lab(replicas=3) as lab:
            try:
                broke = _scenario(lab, Path(tmp), say, out, seconds, guards)
                if not broke and guards:
                    say("guard log (tail):\n" + guards[0].logs()[-2000:])
            finally:
                for guard in guards:
                    guard.stop()
    except Exception as e:  # noqa: BLE001 - the demo reports, never tracebacks at the user
        say(f"\ndemo failed: {type(e).__name__}: {e}")
        if guards and "ghost-guard serve" not in str(e):
            say("guard log (tail):\n" + guards[0].logs()[-2000:])
        return 2
    elapsed = time.monotonic() - started
    if broke:
        say(f"\nThe guard broke the loop: the ghost is rejected on every node, live pods still schedule ({elapsed:.0f} s).")
        return 0
    say(f"\nThe loop was NOT broken ({elapsed:.0f} s).")
    return 1


def _scenario(lab: Any, workdir: Path, say: Callable[[str], None], out: IO[str], seconds: float,
              guards: list[GuardChild]) -> bool:
    say("ghost-guard demo: a Pod deleted in etcd, still served by one apiserver replica's watch cache")
    say(f"  lab: etcd + 3 apiserver replicas: {', '.join(r.url for r in lab.replicas)}")
    api = lab.core_v1(0)
    for name in ("node-a", "node-b"):
        _discard(api.create_node(node_manifest(name), _preload_content=False, _request_timeout=5))
    uid = create_ghost(lab, 1, pod_manifest("web-1"))
    say(f"  default/web-1 (uid {uid}) deleted; replica 2 ({lab.replicas[1].url}) dropped the deletion:")
    say("    quorum GET -> 404 NotFound;  replica 2's cache (resourceVersion=0) -> still Pending")

    say(f"\n[1/2] kube-scheduler (simulated) reading replica 2, no extender, {seconds:.0f} s:")
    with Scheduler(lab.kubeconfig(1), timings=DEMO_TIMINGS) as scheduler:
        live_before = _phase(lab, scheduler, "web-2", out, seconds)
        before = scheduler.stats().get("default/web-1", PodStats())

    say("\n[2/2] ghost-guard serve (HTTPS, mTLS) registered as extender: filter + preempt verbs")
    guard = start_guard_process(lab.kubeconfig(0), workdir)
    guards.append(guard)
    say(f"      guard ready at {guard.url}; scheduler restarted on replica 2 (the ghost is listed again)")
    with Scheduler(lab.kubeconfig(1), extenders=[guard.extender()], timings=DEMO_TIMINGS) as scheduler:
        live_after = _phase(lab, scheduler, "web-3", out, seconds)
        after = scheduler.stats().get("default/web-1", PodStats())

    incident = guard.incident_lines()
    if incident:
        say("      guard: " + incident[0])
    rows = [
        ("ghost scheduling attempts", before.attempts, after.attempts),
        ("ghost failed binds (404)", before.bind_failures.get(404, 0), after.bind_failures.get(404, 0)),
        ("ghost status patches (404)", before.status_patch_failures.get(404, 0), after.status_patch_failures.get(404, 0)),
        ("extender filter calls", "-", after.filter_calls),
        ("live pod bound", f"web-2 -> {live_before.bound_node or 'NO'}", f"web-3 -> {live_after.bound_node or 'NO'}"),
    ]
    say("")
    say(f"  {'':28}{'without guard':>18}{'with guard':>18}")
    for label, left, right in rows:
        say(f"  {label:28}{left!s:>18}{right!s:>18}")
    return (before.bind_failures_total >= 2 and after.bind_failures_total <= 1
            and bool(live_before.bound_node) and bool(live_after.bound_node))
