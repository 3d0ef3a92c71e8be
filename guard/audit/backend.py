"""What the guard and the CLI need of an audit store, and opening one from ``--audit-store``.

Two stores satisfy :class:`AuditBackend`: the embedded SQLite file
(:class:`guard.audit.sqlite.AuditStore`, the default of a bare ``ghost-guard serve``)
and GhostPod objects in the Kubernetes API (:class:`guard.audit.ghostpods.KubeAuditStore`,
what the manifests use). ``guard.engine.incident`` and ``guard.cli`` depend on this
Protocol only, so either store can be plugged in (a lower layer naming what it
needs of a higher one, kopf-style). What a record holds, and the errors both
stores raise, are :mod:`guard.core.records`.

**The identity key is part of the contract.** Both stores key a ghost Pod's record by its identity
(namespace, name, UID) and a ghost Node's by (name, UID) (:data:`guard.core.records.Identity`): a
UID named under two names is two records, so a forged call's record can never hide, merge into or
move the real ghost's. A call that names the identity (``namespace``/``name``) touches that record
only; one that names only a UID touches every record of it.

The guard's own store is a :class:`GuardAudit`: opened from the settings (and opened again by each
``/readyz`` check while it could not be), every write's outcome folded into one health
(:class:`AuditHealth`: a metric, one log line per change, a ``/readyz`` detail). ``guard.engine``
writes through it and never opens a store or judges its health itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from guard.core.records import AuditError, AuditRecord, NewRecordHook, NodeRecord, UnknownGhostError
from guard.core.rendering import format_time
from guard.core.settings import Settings

log = logging.getLogger("guard.incident")

T = TypeVar("T")


class AuditBackend(Protocol):
    def record_block(self, *, uid: str, namespace: str, name: str, verdict: str, evidence: Mapping[str, Any],
                     at: float) -> bool | None:
        """True: a new record; False: a known one counted again; None: dropped (the GhostPod store's queue was
        full: counted, and ``check()`` says so)."""

    def retract(self, *, uid: str, at: float, namespace: str | None = None, name: str | None = None) -> bool: ...

    def record_probe(self, *, uid: str, replica: str, serves: bool | None, cache_resource_version: str | None,
                     error: str | None, at: float, namespace: str | None = None, name: str | None = None) -> None: ...

    def record_heal(self, *, uid: str, action: str, outcome: str, detail: str, at: float,
                    namespace: str | None = None, name: str | None = None) -> None: ...

    def record_node(self, *, name: str, uid: str, serving: Sequence[str], at: float, healed: Sequence[str] = (),
                    evidence: Mapping[str, Any] | None = None) -> bool | None:
        """Ghost Node ``(name, uid)`` served by ``serving`` (one detection when not empty), no longer by ``healed``.
        True: a new record."""

    def record_node_heal(self, *, name: str, uid: str, action: str, outcome: str, detail: str, at: float) -> None: ...

    def node_records(self, *, since: float | None = None, limit: int | None = None) -> list[NodeRecord]: ...

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


# --- the guard's own store: opened from the settings, its health -------------------------------------------


def open_for(settings: Settings, *, on_new: NewRecordHook | None = None) -> tuple[AuditBackend | None, str | None]:
    """The audit store ``--audit-store`` names, or None and why it cannot be opened (the reason without the
    store's name: :class:`AuditHealth` names it)."""
    try:
        return open_store(settings.audit_store, settings.audit_db, kubeconfig=settings.kubeconfig,
                          max_age_seconds=settings.audit_max_age, max_records=settings.audit_max_records,
                          on_new=on_new, write_qps=settings.audit_write_qps,
                          queue_size=settings.audit_queue_size, write_interval=settings.audit_write_interval), None
    except (AuditError, OSError, ValueError) as e:
        named = f"audit store {describe(settings.audit_store, settings.audit_db)}: "
        return None, str(e)[len(named):] if str(e).startswith(named) else str(e)


def _metrics() -> Any:
    """guard.metrics, imported on first use: ``serve``'s master imports this module (``writable_default``) before
    the multiprocess metrics directory is set up, and a metric module imported there would not reach /metrics."""
    from guard import metrics

    return metrics


class AuditHealth:
    """Whether the audit store takes writes, shown three ways and never as a readiness problem
    (verdicts do not need the store): ``ghost_guard_audit_store_healthy``, one log line per
    change of state (not per write), and a detail in ``/readyz``'s body."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.healthy: bool | None = None
        self.error: str | None = None
        self.since = time.time()
        self.failures = 0

    def ok(self) -> None:
        if self.healthy is True:  # the common case, without the lock
            return
        with self._lock:
            was, self.healthy, self.error = self.healthy, True, None
            if was is True:
                return
            self.since = time.time()
        _metrics().AUDIT_STORE_HEALTHY.set(1)
        if was is False:
            log.warning("audit store %s is writable again: ghosts are recorded again", self.path)

    def failed(self, operation: str, error: str) -> None:
        _metrics().AUDIT_WRITE_ERRORS.labels(operation).inc()
        with self._lock:
            self.failures += 1
            changed = self.healthy is not False
            self.healthy, self.error = False, error[:500]
            if changed:
                self.since = time.time()
        if changed:
            _metrics().AUDIT_STORE_HEALTHY.set(0)
            log.error("audit store %s cannot be written (%s): ghosts are still blocked, but not recorded until it "
                      "can; readiness is not affected", self.path, error[:500])

    def detail(self) -> dict[str, Any]:
        with self._lock:
            return {"path": self.path, "writable": self.healthy, "error": self.error, "since": format_time(self.since),
                    "failures": self.failures}


class GuardAudit:
    """The guard's audit store and its health. ``store`` is None while it cannot be opened (``check`` tries
    again); :meth:`write` runs one write on it and folds the outcome into the health."""

    def __init__(self, settings: Settings, store: AuditBackend | None, *, error: str | None = None,
                 on_new: NewRecordHook | None = None) -> None:
        self.settings = settings
        self.store = store
        self._on_new = on_new
        self._lock = threading.Lock()
        self.health = AuditHealth(describe(settings.audit_store, settings.audit_db))
        if store is None:
            self.health.failed("open", error or "not opened")
        else:
            self.health.ok()

    @classmethod
    def open(cls, settings: Settings, *, on_new: NewRecordHook | None = None) -> GuardAudit:
        store, error = open_for(settings, on_new=on_new)
        return cls(settings, store, error=error, on_new=on_new)

    @property
    def writes_in_background(self) -> bool:
        """Whether a write only queues (the GhostPod store): then blocks are recorded on the request path."""
        return bool(getattr(self.store, "writes_in_background", False))

    def check(self) -> dict[str, Any]:
        """Test the store with a write (or open it again if it never opened); its health, for /readyz."""
        with self._lock:
            if self.store is None:
                store, error = open_for(self.settings, on_new=self._on_new)
                if store is None:
                    self.health.failed("open", error or "not opened")
                else:
                    self.store = store
                    self.health.ok()
            else:
                problem = self.store.check()
                if problem:
                    self.health.failed("check", problem)
                else:
                    self.health.ok()
        return self.health.detail()

    def write(self, operation: str, what: str, fn: Callable[[AuditBackend], T], *, health: bool = True) -> T | None:
        """``fn(store)``, one write; None when there is no store or it failed. The store's trouble (AuditError,
        OSError) makes it unhealthy, once (``health=False``: logged only, as a retraction always was); a
        record's own trouble (a field refused: ValueError) is logged; a write that needs a record the store
        lacks (UnknownGhostError: its block was not recorded) is neither."""
        store = self.store
        if store is None:
            return None
        try:
            result = fn(store)
        except UnknownGhostError as e:
            log.debug("audit store: cannot record %s: %s", what, e)
            return None
        except (AuditError, OSError) as e:
            if not health:
                log.error("audit store: cannot record %s: %s", what, e)
                return None
            log.debug("audit store: cannot record %s: %s", what, e)
            self.health.failed(operation, str(e))
            return None
        except ValueError as e:
            log.error("audit store: cannot record %s: %s", what, e)
            return None
        self.written()
        return result

    def written(self) -> None:
        """A record call returned. The SQLite store returns once the write is durable: healthy. The GhostPod
        store only queues it (written in the background): its health is what its writers last saw.

        A store that was unhealthy is called writable again only by its own write probe (``check``): a
        record call that changed nothing (a probe older than the one stored, a probe of a retracted
        record) commits without writing a page, so it returns even on a disk that turned read-only."""
        store = self.store
        if store is None or (self.health.healthy is True and not self.writes_in_background):
            return
        problem = store.check()
        if problem:
            self.health.failed("block" if self.writes_in_background else "check", problem)
        else:
            self.health.ok()
