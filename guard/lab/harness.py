"""The one harness the demo, the tests and the benchmarks share (lab code: never on the serving path).

- :class:`GuardProcess`: ``ghost-guard serve`` as a child process in its own session, started
  over HTTP or HTTPS (+ mTLS), waited for with a deadline (:meth:`GuardProcess.wait`), stopped
  by process group (:func:`stop_group`: SIGTERM, then SIGKILL after a deadline); its metrics,
  logs and the kube-scheduler extender entry that points at it (:meth:`GuardProcess.extender`).
- :func:`eventually`: poll a condition with a deadline (:class:`NotReached` when it is not met).
- :func:`pod_manifest`, :func:`node_manifest`: a pending pod with requests, a Ready node.
- :func:`make_ghost`: a ghost: a pod created, its deletion lost by one replica's watch cache, deleted.
- :func:`create`, :func:`quorum_pod`, :func:`cached_names`: small API calls the above build on.

Import it as ``from guard.lab.harness import GuardProcess, eventually, make_ghost, pod_manifest``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import requests

from guard.lab.etcd import free_port

if TYPE_CHECKING:
    from guard.tools.certs import CertBundle
    from guard.lab.backend import LabBackend
    from guard.lab.scheduler import ExtenderConfig

__all__ = ["GuardProcess", "NotReached", "Samples", "cached_names", "child_pids", "create", "eventually", "free_port",
           "make_ghost", "metric_sum", "node_manifest", "parse_metrics", "pod_manifest", "quorum_pod", "stop_group",
           "tls_files"]

T = TypeVar("T")


# --- waiting ------------------------------------------------------------------------------------------------


class NotReached(AssertionError):
    """A condition the harness waited for did not come true before its deadline (an AssertionError,
    so that a test using the harness fails rather than errors)."""


def eventually(check: Callable[[], T], timeout: float = 20.0, *, what: str = "the condition",
               interval: float = 0.05, ignore: tuple[type[BaseException], ...] = (), process: Any = None) -> T:
    """Call ``check()`` until it returns something truthy, and return that.

    After ``timeout`` seconds, raise :class:`NotReached` naming ``what`` and the last exception
    ignored. ``ignore``: exception types that mean "not yet". ``process``: a process
    (``.proc`` and ``.logs()``, as GuardProcess) that must stay up: its exit fails at once.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        if process is not None and process.proc.poll() is not None:
            raise NotReached(f"exited with {process.proc.returncode} before {what}:\n{process.logs()}")
        try:
            value = check()
            if value:
                return value
        except ignore as e:
            last = e
        if time.monotonic() > deadline:
            raise NotReached(f"{what} not reached in {timeout}s (last error: {last!r})")
        time.sleep(interval)


# --- processes ----------------------------------------------------------------------------------------------


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


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a guard's gunicorn workers, a lab's replicas), sorted."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return sorted(out)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_metrics(text: str) -> Samples:
    """A Prometheus text exposition as {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(v for (n, lab), v in samples.items() if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def tls_files(bundle: CertBundle, *, client_ca: bool = True) -> dict[str, str]:
    """:class:`GuardProcess`'s ``tls`` for a :func:`guard.tools.certs.generate` bundle: serving certificate,
    ``--client-ca`` (mTLS; ``client_ca=False``: server-only TLS), and the scheduler's and the
    monitoring role's client certificates."""
    tls = {"cert": str(bundle.tls_cert), "key": str(bundle.tls_key), "ca": str(bundle.ca_cert),
           "client_cert": str(bundle.client_cert), "client_key": str(bundle.client_key),
           "monitoring_cert": str(bundle.monitoring_cert), "monitoring_key": str(bundle.monitoring_key)}
    if client_ca:
        tls["client_ca"] = str(bundle.ca_cert)
    return tls


class GuardProcess:
    """``ghost-guard serve`` as a child process (its own process group).

    By default ``args`` follow ``serve --bind 127.0.0.1:<free port>``, and ``--insecure-http``
    (no ``tls``) or the ``tls`` files' flags are added (``tls``: keys ``cert``, ``key``, and
    optionally ``client_ca``, ``ca``, ``client_cert``/``client_key``,
    ``monitoring_cert``/``monitoring_key``; :func:`tls_files` makes them from a certificate bundle).
    ``verbatim=True`` runs ``python -m guard *args`` exactly as given (the subcommand, ``--bind``
    with ``port`` and any TLS flags included, as a manifest spells them). ``clean_env`` drops the
    caller's ``GHOST_GUARD_*`` variables (``env`` is applied after). ``cwd``: the process's working
    directory. ``logdir``: where the stderr (``.log``) and stdout (``.out``) files go (default: the
    temp dir). ``cpus``: run it on these CPUs only (``sched_setaffinity``; benchmarks give it its own).

    As a context manager it is stopped on exit (``with GuardProcess(args) as g: g.wait(); ...``).
    """

    def __init__(self, args: list[str], *, tls: dict | None = None, env: dict | None = None,
                 port: int | None = None, verbatim: bool = False, clean_env: bool = False,
                 cwd: str | Path | None = None, logdir: str | Path | None = None,
                 cpus: set[int] | None = None) -> None:
        self.port = port or free_port()
        https = bool(tls) or (verbatim and any(a.split("=", 1)[0] == "--tls-cert" for a in args))
        self.scheme = "https" if https else "http"
        self.base = f"{self.scheme}://127.0.0.1:{self.port}"
        self.tls = tls or {}
        self.log = tempfile.NamedTemporaryFile(prefix="guard-", suffix=".log", delete=False, dir=logdir)
        self.out = tempfile.NamedTemporaryFile(prefix="guard-", suffix=".out", delete=False, dir=logdir)
        if verbatim:
            cmd = [sys.executable, "-m", "guard", *args]
        else:
            cmd = [sys.executable, "-m", "guard", "serve", "--bind", f"127.0.0.1:{self.port}", *args]
            if not tls:
                cmd.append("--insecure-http")
            else:
                cmd += ["--tls-cert", tls["cert"], "--tls-key", tls["key"]]
                if tls.get("client_ca"):
                    cmd += ["--client-ca", tls["client_ca"]]
        self.cmd = cmd
        base_env = {k: v for k, v in os.environ.items() if not (clean_env and k.startswith("GHOST_GUARD_"))}
        full_env = {**base_env, **(env or {})}
        full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.log, env=full_env, start_new_session=True,
                                     cwd=cwd, preexec_fn=pin)
        self.session = requests.Session()
        # requests lets REQUESTS_CA_BUNDLE override a Session's verify (psf/requests#3829): ignore the environment.
        self.session.trust_env = False
        # With --client-ca each endpoint answers only its role's certificate (guard.core.identity): the verbs
        # go out with ``client_cert`` (kube-scheduler's), the probes and /metrics with the monitoring
        # certificate (``monitoring_cert``, default: monitoring.crt next to client_cert when present).
        self.monitoring_cert: tuple[str, str] | None = None
        if tls:
            self.session.verify = tls.get("ca", False)
            if tls.get("client_cert"):
                self.session.cert = (tls["client_cert"], tls["client_key"])
                beside = Path(tls["client_cert"]).with_name("monitoring.crt")
                if tls.get("monitoring_cert"):
                    self.monitoring_cert = (tls["monitoring_cert"], tls["monitoring_key"])
                elif beside.exists():
                    self.monitoring_cert = (str(beside), str(beside.with_suffix(".key")))

    def url(self, path: str) -> str:
        return self.base + path

    def wait(self, path: str = "/readyz", timeout: float = 20.0) -> None:
        """Wait until ``path`` answers 200; RuntimeError (with the log tail) if the guard exits or
        ``timeout`` passes first."""

        def ok() -> bool:
            return self.get(path, timeout=2).status_code == 200

        try:
            eventually(ok, timeout, what=f"guard ready on {path}", ignore=(requests.RequestException,), process=self)
        except NotReached as e:
            raise RuntimeError(f"{e}\n{self.logs()}" if self.proc.poll() is None else str(e)) from None

    def get(self, path: str, **kw: Any) -> requests.Response:
        """A GET of a probe or /metrics, with the monitoring certificate when there is one."""
        if self.monitoring_cert and "cert" not in kw:
            kw["cert"] = self.monitoring_cert
        return self.session.get(self.url(path), **kw)

    def post(self, path: str, body: bytes | dict, **kw: Any) -> requests.Response:
        if isinstance(body, dict):
            import orjson

            body = orjson.dumps(body)
        headers = kw.pop("headers", {"Content-Type": "application/json"})
        return self.session.post(self.url(path), data=body, headers=headers, timeout=kw.pop("timeout", 10), **kw)

    def metrics(self) -> Samples:
        """One scrape of /metrics: {(sample name, sorted label items): value}."""
        return parse_metrics(self.get("/metrics", timeout=5).text)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples matching the labels (0 when absent)."""
        return metric_sum(self.metrics(), name, **labels)

    def workers(self) -> list[int]:
        """The gunicorn workers (the arbiter's children), sorted."""
        return child_pids(self.proc.pid)

    def extender(self, *, node_cache_capable: bool = True, preempt: bool = True) -> ExtenderConfig:
        """The KubeSchedulerConfiguration extender entry for this guard (``filter`` and ``preempt`` verbs;
        over HTTPS with the CA and the scheduler's client certificate when started with ``tls``)."""
        from guard.lab.scheduler import ExtenderConfig, TLSConfig

        tls = None
        if self.scheme == "https":
            tls = TLSConfig(ca_file=self.tls.get("ca", ""), cert_file=self.tls.get("client_cert", ""),
                            key_file=self.tls.get("client_key", ""))
        return ExtenderConfig(url_prefix=self.base, filter_verb="filter", preempt_verb="preempt" if preempt else "",
                              enable_https=self.scheme == "https", tls_config=tls, http_timeout=5.0,
                              node_cache_capable=node_cache_capable, ignorable=False)

    def _flushed(self, f: IO[bytes]) -> Path:
        if not f.closed:
            f.flush()
        return Path(f.name)

    def logs(self, tail: int | None = 8000) -> str:
        """The guard's log (stderr): its last ``tail`` characters (None: all of it); also after :meth:`stop`."""
        text = self._flushed(self.log).read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def log_records(self, logger: str | None = None) -> list[dict[str, Any]]:
        """The guard's JSON log lines (stderr), those of ``logger`` only when given."""
        found = []
        for line in self._flushed(self.log).read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and (logger is None or record.get("logger") == logger):
                found.append(record)
        return found

    def verdicts(self, uid: str, *, since: float = 0.0) -> list[str]:
        """The verdicts of the calls about pod ``uid`` (its access log lines after ``since``, epoch seconds), in
        order; ``unknown`` is an answer the guard failed open on."""
        return [r["verdict"] for r in self.log_records("guard.access")
                if r.get("uid") == uid and "verdict" in r and r.get("time", 0) > since]

    def stdout(self) -> str:
        return self._flushed(self.out).read_text(errors="replace")

    def __enter__(self) -> GuardProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop the process group (SIGTERM, SIGKILL after 30 s: the manifest's terminationGracePeriodSeconds, above
        the guard's graceful timeout); the log files stay readable."""
        stop_group(self.proc, term_timeout=30.0)
        self.session.close()
        self.log.close()
        self.out.close()


# --- objects ------------------------------------------------------------------------------------------------


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


def pod_manifest(name: str, *, namespace: str | None = None, labels: dict[str, str] | None = None,
                 cpu: str | None = "100m", memory: str | None = "64Mi", priority: int | None = None,
                 scheduler_name: str = "default-scheduler", node_selector: dict[str, str] | None = None,
                 node_name: str = "", finalizers: list[str] | None = None,
                 priority_class: str | None = None) -> dict[str, Any]:
    """A one-container pod with requests, pending unless ``node_name`` binds it.

    ``priority_class``: ``spec.priorityClassName`` (a real apiserver's Priority admission plugin refuses a
    ``priority`` that no class gives: there, name a PriorityClass instead of, or matching, ``priority``).

    ``namespace``: written into ``metadata`` (None: left out; :func:`create` then uses ``default``).
    ``cpu``, ``memory``: the container's requests (None: not requested; both None: no ``resources``).
    """
    container: dict[str, Any] = {"name": "app", "image": "registry.k8s.io/pause:3.10"}
    asked = {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}
    if asked:
        container["resources"] = {"requests": asked}
    spec: dict[str, Any] = {"schedulerName": scheduler_name, "containers": [container]}
    if priority is not None:
        spec["priority"] = priority
    if priority_class is not None:
        spec["priorityClassName"] = priority_class
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if node_name:
        spec["nodeName"] = node_name
    metadata: dict[str, Any] = {"name": name, "labels": dict(labels or {})}
    if namespace is not None:
        metadata["namespace"] = namespace
    if finalizers:
        metadata["finalizers"] = list(finalizers)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


# --- API calls ----------------------------------------------------------------------------------------------


NOT_READY_TAINT = "node.kubernetes.io/not-ready"


def create(api: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """Create a Node or a Pod (in its ``metadata.namespace``, default ``default``); returns it as JSON.

    A real apiserver taints every new Node ``node.kubernetes.io/not-ready:NoSchedule`` (admission plugin
    TaintNodesByCondition) and, with no kubelet and no node-lifecycle controller, nothing lifts it: a Node
    whose manifest has no such taint gets it removed here, so it is the Ready node it says it is."""
    if obj["kind"] == "Node":
        resp = api.create_node(obj, _preload_content=False, _request_timeout=5)
        node = json.loads(resp.data)
        taints = (node.get("spec") or {}).get("taints") or []
        asked = {t.get("key") for t in (obj.get("spec") or {}).get("taints") or []}
        if NOT_READY_TAINT not in asked and any(t.get("key") == NOT_READY_TAINT for t in taints):
            keep = [t for t in taints if t.get("key") != NOT_READY_TAINT]
            resp = api.patch_node(node["metadata"]["name"], [{"op": "replace", "path": "/spec/taints", "value": keep}],
                                  _preload_content=False, _request_timeout=5)
            node = json.loads(resp.data)
        return node
    else:
        namespace = obj["metadata"].get("namespace", "default")
        resp = api.create_namespaced_pod(namespace, obj, _preload_content=False, _request_timeout=5)
    return json.loads(resp.data)


def quorum_pod(api: Any, name: str, namespace: str = "default") -> dict[str, Any] | None:
    """The pod as etcd has it (GET without resourceVersion), as JSON, or None when it is gone."""
    from kubernetes.client.exceptions import ApiException

    try:
        return json.loads(api.read_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=5).data)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def cached_names(lab: LabBackend, replica: int, namespace: str) -> list[str]:
    """Pod names replica ``replica``'s watch cache serves (LIST resourceVersion=0)."""
    items = lab.core_v1(replica).list_namespaced_pod(namespace, resource_version="0", _request_timeout=5).items
    return sorted(p.metadata.name for p in items)


def make_ghost(lab: LabBackend, namespace: str, name: str, *, stale: int = 1, writer: int = 0, timeout: float = 10.0,
               **manifest: Any) -> str:
    """Make ``namespace/name`` a ghost on replica ``stale``: create it (``pod_manifest(name, **manifest)``)
    through replica ``writer``, make replica ``stale`` drop its deletion, delete it. Returns its UID.

    Returns once etcd no longer has the pod, every running replica's cache has reached etcd's
    revision, the other running replicas' caches let the pod go, and replica ``stale``'s cache still
    holds it, same UID, without ``deletionTimestamp``. On the Python lab the waits are read in-process
    (etcd and the caches), so the replicas' request logs show only the create and the delete; on the
    real backend the caches are read with ``GET resourceVersion=0`` and the namespace is created first
    when missing. :class:`NotReached` otherwise.
    """
    api = lab.core_v1(writer)
    if lab.backend != "python":
        lab.ensure_namespace(namespace, writer)
    uid = create(api, pod_manifest(name, namespace=namespace, **manifest))["metadata"]["uid"]
    if not lab.wait_synced(timeout):
        raise NotReached(f"replica caches did not reach etcd's revision after creating {namespace}/{name}")
    lab.replicas[stale].faults.drop_deletes(namespace=namespace, name=name)
    resp = api.delete_namespaced_pod(name, namespace, _preload_content=False, _request_timeout=5)
    resp.drain_conn()
    resp.release_conn()
    eventually(lambda: not lab.quorum_exists(namespace, name), timeout, what=f"{namespace}/{name} gone from etcd")
    if not lab.wait_synced(timeout):
        raise NotReached(f"replica caches did not reach etcd's revision after deleting {namespace}/{name}")
    for i, replica in enumerate(lab.replicas):
        if not replica.running:
            continue
        obj = lab.cached_pod(i, namespace, name)
        meta = (obj or {}).get("metadata", {})
        if i == stale and (obj is None or meta.get("uid") != uid or meta.get("deletionTimestamp")):
            raise NotReached(f"replica {i} did not keep {namespace}/{name} as a ghost: {meta}")
        if i != stale and obj is not None:
            raise NotReached(f"replica {i} still serves {namespace}/{name} after its deletion")
    return uid
