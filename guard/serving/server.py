"""gunicorn embedding: guard.serving.worker.GuardWorker (gthread with connection deadlines), TLS/mTLS,
Prometheus multiprocess, JSON logs.

The app is loaded in each worker after the fork (no ``preload_app``), so every
worker builds its own apiserver client (kubernetes-client/python#1000).
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import sys
import tempfile

import orjson
from gunicorn.app.base import BaseApplication

from guard.core.names import json_hidden_escaped
from guard.core.settings import Settings

# Seconds a SIGTERM'd worker has to finish its calls and write what its audit store holds (gunicorn's
# graceful_timeout; the manifest's terminationGracePeriodSeconds, 30, is above it).
GRACEFUL_TIMEOUT = 25


class JsonFormatter(logging.Formatter):
    """One JSON object per line. An access-log record's fields (``extra={"access": {...}}``) are merged in."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name}
        access = getattr(record, "access", None)
        if access is not None:
            entry.update(access)
        else:
            entry["msg"] = record.getMessage()
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json_hidden_escaped(orjson.dumps(entry).decode())  # U+202E and the like: escaped (guard.core.names)


def configure_logging(level: str) -> None:
    # JsonFormatter writes none of these, so no record collects them (the logging HOWTO's
    # "Optimization"): the thread, the process, and the caller's frame, file and line. A record costs
    # about 8 us less; with the access-log line that is once per scheduler call.
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def prepare_multiprocess_dir() -> str:
    """Point prometheus-client at a fresh per-instance directory (wiped at start)."""
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        os.makedirs(path, exist_ok=True)
        for entry in os.listdir(path):
            if entry.endswith(".db"):
                os.unlink(os.path.join(path, entry))
    else:
        path = tempfile.mkdtemp(prefix="ghost-guard-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


def tls_context_hook(holder):
    """gunicorn's ``ssl_context`` hook; gthread calls it for every new connection.

    The reloading holder re-reads the files when they change on disk (cert-manager
    renewals), so new connections get the new certificate without a restart and
    in-flight ones keep theirs.
    """

    def ssl_context(conf, default_ssl_context_factory) -> ssl.SSLContext:
        return holder.context()

    return ssl_context


class GuardServer(BaseApplication):
    def __init__(self, settings: Settings) -> None:
        from guard.serving.tls import ReloadingTLS

        self.settings = settings
        # Built before the fork; each worker inherits it and /readyz reports its state.
        self.tls = (ReloadingTLS(settings.tls_cert, settings.tls_key, settings.client_ca,
                                 min_version=settings.tls_min_version) if settings.tls_cert and settings.tls_key else None)
        super().__init__()

    def load_config(self) -> None:
        s = self.settings
        options = {
            "bind": [s.bind],
            "workers": s.workers,
            "threads": s.threads,
            # gthread's process model and pool, with every connection read and written under deadlines
            # by the worker's event loop before and after a pool thread sees it (guard/serving/connection.py).
            "worker_class": "guard.serving.worker.GuardWorker",
            "timeout": 30,
            # A SIGTERM'd worker finishes its calls, then writes the audit records it still holds (a rollout
            # mid-flood: hundreds, guard/audit/ghostpods.py CLOSE_DEADLINE); the manifest's
            # terminationGracePeriodSeconds (30) is above it.
            "graceful_timeout": GRACEFUL_TIMEOUT,
            "keepalive": max(1, round(s.keepalive_timeout)),  # unused by GuardWorker (it has its own deadline)
            "worker_connections": 2 * s.max_connections,
            "accesslog": None,
            "errorlog": "-",
            # gunicorn's own messages in the same JSON lines as ours
            "logconfig_dict": {
                "version": 1, "disable_existing_loggers": False,
                "formatters": {"json": {"()": "guard.serving.server.JsonFormatter"}},
                "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                                        "stream": "ext://sys.stderr"}},
                "root": {"handlers": ["stderr"], "level": s.log_level.upper()},
                "loggers": {"gunicorn.error": {"handlers": ["stderr"], "level": s.log_level.upper(),
                                               "propagate": False}},
            },
            "loglevel": s.log_level,
            "preload_app": False,
            "proc_name": "ghost-guard",
            "child_exit": _child_exit,
            "worker_exit": _worker_exit,
            "post_worker_init": lambda worker: configure_logging(s.log_level),
        }
        if "control_socket_disable" in self.cfg.settings:  # gunicorn >= 25: one fixed per-user path otherwise
            options["control_socket_disable"] = True
        if self.tls is not None:
            options.update(certfile=s.tls_cert, keyfile=s.tls_key, ssl_context=tls_context_hook(self.tls))
            if s.client_ca:
                options.update(ca_certs=s.client_ca, cert_reqs=ssl.CERT_REQUIRED)
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        from guard.http.app import create_app

        return create_app(self.settings, readiness_checks=[self.tls.check] if self.tls else [])


def _worker_exit(server, worker) -> None:
    """In the worker, after its loop ended and before the interpreter exits: stop the guard's
    background checks first (the interpreter's exit would shut their pools under a running round)."""
    guard = getattr(getattr(worker, "wsgi", None), "extensions", {}).get("ghost_guard")
    if guard is not None:
        guard.close()


def _child_exit(server, worker) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def preflight(settings: Settings) -> None:
    """Fail fast, before any worker starts: credentials and certificates must load.

    Raises ``StartupError`` with one line naming what to fix.
    """
    # The light reader: the same sources, order and errors as the official loader (which it defers to for
    # anything but plain credentials), without importing `kubernetes` into the master (~23 MiB it would hold
    # for its whole life; the workers import the client themselves).
    from guard.kube.config import KubeConfigError, load_cli_configuration

    try:
        load_cli_configuration(settings.kubeconfig)
    except KubeConfigError as e:
        raise StartupError(str(e)) from e
    if settings.tls_cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(settings.tls_cert, settings.tls_key)
            if settings.client_ca:
                ctx.load_verify_locations(settings.client_ca)
        except (OSError, ssl.SSLError) as e:
            raise StartupError(f"cannot load TLS files ({settings.tls_cert}, {settings.tls_key}"
                               f"{', ' + settings.client_ca if settings.client_ca else ''}): {e}") from e


class StartupError(RuntimeError):
    """The guard cannot start with these settings; the message says why."""


def serve(settings: Settings) -> int:
    """Run until SIGTERM/SIGINT. Settings must be validated and preflighted."""
    configure_logging(settings.log_level)
    metrics_dir = prepare_multiprocess_dir()
    owned_dir = metrics_dir.startswith(tempfile.gettempdir()) and "ghost-guard-metrics-" in metrics_dir
    logging.getLogger("guard.server").info(
        "serving on %s (%s), %d worker(s) x %d threads, quorum GET timeout %gs, fail-%s",
        settings.bind, "http" if settings.insecure_http else ("https+mtls" if settings.client_ca else "https"),
        settings.workers, settings.threads, settings.get_timeout, "closed" if settings.fail_closed else "open")
    try:
        GuardServer(settings).run()
    finally:
        if owned_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0
