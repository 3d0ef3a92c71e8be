"""What the guard and the CLI need of an audit store, and opening one from ``--audit-store``.

Two stores satisfy :class:`AuditBackend`: the embedded SQLite file
(:class:`guard.audit.sqlite.AuditStore`, the default of a bare ``ghost-guard serve``)
and GhostPod objects in the Kubernetes API (:class:`guard.audit.ghostpods.KubeAuditStore`,
what the manifests use). ``guard.engine.incident`` and ``guard.cli`` depend on this
Protocol only, so either store can be plugged in (a lower layer naming what it
needs of a higher one, kopf-style). What a record holds, and the errors both
stores raise, are :mod:`guard.core.records`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from guard.core.records import AuditError, AuditRecord, NewRecordHook


class AuditBackend(Protocol):
    def record_block(self, *, uid: str, namespace: str, name: str, verdict: str, evidence: Mapping[str, Any],
                     at: float) -> bool | None:
        """True: a new record; False: a known one counted again; None: dropped (the GhostPod store's queue was
        full: counted, and ``check()`` says so)."""

    def retract(self, *, uid: str, at: float, namespace: str | None = None, name: str | None = None) -> bool: ...

    def record_probe(self, *, uid: str, replica: str, serves: bool | None, cache_resource_version: str | None,
                     error: str | None, at: float, namespace: str | None = None, name: str | None = None) -> None: ...

    def record_heal(self, *, uid: str, action: str, outcome: str, detail: str, at: float) -> None: ...

    def records(self, *, namespace: str | None = None, verdict: str | None = None, replica: str | None = None,
                since: float | None = None, limit: int | None = None, retracted: bool = False) -> list[AuditRecord]: ...

    def record(self, uid: str) -> AuditRecord | None: ...

    def prune(self, *, now: float) -> int: ...

    def check(self) -> str | None: ...

    def close(self) -> None: ...


class StoreSpecError(ValueError):
    """``--audit-store`` is neither ``kubernetes`` nor ``sqlite[:PATH]``."""


def user_audit_db(environ: Mapping[str, str] | None = None) -> str:
    """The audit store of a user who cannot write the system default (``DEFAULT_AUDIT_DB``):
    ``$XDG_STATE_HOME/ghost-guard/audit.db``, by default ``~/.local/state/ghost-guard/audit.db``."""
    env = os.environ if environ is None else environ
    state = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "ghost-guard", "audit.db")


def writable_default(default_path: str) -> tuple[str, str | None]:
    """For ``serve`` without --audit-db: ``default_path`` when its directory exists and is writable, else :func:`user_audit_db` (its directory created); and, when it moved, one sentence saying
    so (None when it did not)."""
    directory = os.path.dirname(default_path)
    if os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK):
        return default_path, None  # the image and the manifests provide it (a volume); never created here
    fallback = user_audit_db()
    try:
        os.makedirs(os.path.dirname(fallback), mode=0o700, exist_ok=True)
    except OSError as e:
        return default_path, f"neither {directory} nor {os.path.dirname(fallback)} can be written here ({e.strerror})"
    return fallback, (f"{directory} cannot be written here: recording to {fallback} instead (`ghost-guard audit` and "
                      "`report` read it there too; --audit-db sets another place)")


def readable_default(default_path: str) -> str:
    """For the readers (``audit``, ``report``) without --db: ``default_path`` when it exists, else the user's
    store when that one exists (what ``serve`` wrote when it could not write the default), else ``default_path``."""
    if os.path.lexists(default_path):
        return default_path
    user = user_audit_db()
    return user if os.path.exists(user) else default_path


def parse_store(spec: str | None, default_path: str) -> tuple[str, str | None]:
    """``kubernetes`` -> ("kubernetes", None); ``sqlite:PATH`` -> ("sqlite", PATH); ``sqlite`` or None
    -> ("sqlite", ``default_path``: ``--audit-db``)."""
    if spec is None or spec.strip() in ("", "sqlite"):
        return "sqlite", default_path
    spec = spec.strip()
    if spec == "kubernetes":
        return "kubernetes", None
    kind, sep, path = spec.partition(":")
    if kind == "sqlite" and sep and path:
        return "sqlite", path
    raise StoreSpecError(f"--audit-store must be `kubernetes`, `sqlite` or `sqlite:PATH`, got {spec!r}")


def describe(spec: str | None, default_path: str) -> str:
    """The store as logs and /readyz name it: ``kubernetes (GhostPod objects)`` or the SQLite path."""
    kind, path = parse_store(spec, default_path)
    return "kubernetes (GhostPod objects)" if kind == "kubernetes" else str(path)


def open_store(spec: str | None, default_path: str, *, kubeconfig: str | None = None, max_age_seconds: float,
               max_records: int, on_new: NewRecordHook | None = None, write_qps: float = 20.0, queue_size: int = 50_000,
               write_interval: float = 10.0, writer: bool = True, kube: Any = None) -> AuditBackend:
    """Open the store ``spec`` names. Raises :class:`guard.core.records.AuditError` (or ``StoreSpecError``, a ValueError).

    ``on_new`` (:data:`guard.core.records.NewRecordHook`): called with each record new to the store, once per
    identity across every process sharing it. ``writer=False`` (the CLI's readers) starts no background
    writer. ``kube``: a ``guard.kube.reads.Kube`` to share (the guard's own); else one is built from ``kubeconfig``."""
    kind, path = parse_store(spec, default_path)
    if kind == "sqlite":
        from guard.audit.sqlite import AuditStore

        assert path is not None
        return AuditStore(path, max_age_seconds=max_age_seconds, max_records=max_records, on_new=on_new)
    from guard.audit.ghostpods import KubeAuditStore
    from guard.kube.config import KubeConfigError, load_cli_configuration, load_configuration
    from guard.kube.reads import Kube
    from guard.kube.writes import GhostPods

    if kube is None:
        try:
            # a reader (the CLI) starts without importing the kubernetes client where it can (guard/kube/config.py)
            load = load_configuration if writer else load_cli_configuration
            kube = Kube(load(kubeconfig), timeout=5.0, pool_size=8)
        except KubeConfigError as e:
            raise AuditError(str(e)) from e
    return KubeAuditStore(GhostPods(kube), max_age_seconds=max_age_seconds, max_records=max_records, on_new=on_new,
                          write_qps=write_qps, queue_size=queue_size, min_interval=write_interval, start=writer)
