"""Real guard processes for tests and benchmarks: ``ghost-guard serve`` over real HTTP(S).

Import it as ``from guardproc import GuardProcess`` (tests/ is on sys.path; a benchmark
puts it there): a test module must never import ``conftest``, whose name is shared by
every conftest.py in the tree.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from guard.lab.demo import stop_group

REPO = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


class GuardProcess:
    """``ghost-guard serve`` as a child process (its own process group).

    By default ``args`` follow ``serve --bind 127.0.0.1:<free port>``, and ``--insecure-http``
    (no ``tls``) or the ``tls`` files' flags are added. ``verbatim=True`` runs
    ``python -m guard *args`` exactly as given (the subcommand, ``--bind`` with ``port``
    and any TLS flags included, as a manifest spells them). ``clean_env`` drops the
    caller's ``GHOST_GUARD_*`` variables (``env`` is applied after). ``cwd``: the
    process's working directory. ``logdir``: where the stderr (``.log``) and stdout
    (``.out``) files go (default: the temp dir).

    As a context manager it is stopped on exit (``with GuardProcess(args) as g: g.wait(); ...``).
    """

    def __init__(self, args: list[str], *, tls: dict | None = None, env: dict | None = None,
                 port: int | None = None, verbatim: bool = False, clean_env: bool = False,
                 cwd: str | Path | None = None, logdir: str | Path | None = None) -> None:
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
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.log, env=full_env, start_new_session=True,
                                     cwd=cwd)
        self.session = requests.Session()
        # requests lets REQUESTS_CA_BUNDLE override a Session's verify (psf/requests#3829): ignore the environment.
        self.session.trust_env = False
        # With --client-ca each endpoint answers only its role's certificate (guard.identity): the verbs
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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"guard exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if self.get(path, timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"guard not ready on {path} after {timeout}s:\n{self.logs()}")

    def get(self, path: str, **kw) -> requests.Response:
        """A GET of a probe or /metrics, with the monitoring certificate when there is one."""
        if self.monitoring_cert and "cert" not in kw:
            kw["cert"] = self.monitoring_cert
        return self.session.get(self.url(path), **kw)

    def post(self, path: str, body: bytes | dict, **kw) -> requests.Response:
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

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-8000:]

    def stdout(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text(errors="replace")

    def __enter__(self) -> GuardProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        stop_group(self.proc)
        self.session.close()
