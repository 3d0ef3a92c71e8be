"""The guard of one worker process: its clients, caches and background workers, wired together.

``build_guard(settings)`` runs in each gunicorn worker after the fork (guard.http.app.create_app)
and returns the one :class:`Guard` value every route closes over. Nothing here speaks HTTP:
guard/http/ decodes a request, asks the Guard, and encodes the answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from guard.core import flood
from guard.engine.autoheal import AutoHealer
from guard.engine.cache_health import CacheHealthMonitor
from guard.engine.checker import Checker, Events
from guard.engine.ghost_nodes import GhostNodes
from guard.audit.backend import GuardAudit
from guard.engine.incident import IncidentRecorder, announce_new_ghost
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.engine.prepare import Preparer
from guard.engine.replica_views import ReplicaViews
from guard.engine.replicas import ReplicaPool
from guard.core.settings import Settings
from guard.core.verdict import PodRef

log = logging.getLogger("guard.wiring")

# Readiness results are reused for this long, so probes never load the apiserver.
READY_CACHE_SECONDS = 2.0


@dataclass
class Guard:
    """What the routes share in one worker process."""

    settings: Settings
    kube: Kube
    checker: Checker
    incidents: IncidentRecorder
    preparer: Preparer | None
    # Ghost Nodes (guard/engine/ghost_nodes.py): None with --no-ghost-nodes.
    nodes: GhostNodes | None = None
    # Extra readiness checks (None when fine, else a reason): only what stops verdicts, e.g. the
    # served certificate. The apiserver is checked by readiness() itself.
    readiness_checks: list[Callable[[], str | None]] = field(default_factory=list)
    # /readyz body details, never a reason for 503: name -> callable returning a JSON-able value.
    details: dict[str, Callable[[], object]] = field(default_factory=dict)
    # Called in order by close() when the worker exits (guard.serving.server's worker_exit hook).
    closers: list[Callable[[], None]] = field(default_factory=list)
    # The last readiness() result and when it was taken (time.monotonic), under _ready_lock.
    _ready: tuple[float, list[str], dict[str, object]] | None = field(default=None, init=False, repr=False)
    _ready_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def close(self) -> None:
        """Stop the background checks before the interpreter exits (a round cut short is not an error)."""
        for close in self.closers:
            try:
                close()
            except Exception as e:  # stopping: say it, never fail the exit
                log.warning("stopping %s: %s", getattr(close, "__qualname__", close), str(e)[:200])

    def readiness(self) -> tuple[list[str], dict[str, object]]:
        """(problems, details): problems are what stops verdicts (a 503), details what degrades a
        feature (the audit store, a replica's watch), shown but never a reason for 503. Reused for
        READY_CACHE_SECONDS; one caller at a time computes it, the others wait for its result."""
        with self._ready_lock:
            now = time.monotonic()
            if self._ready is not None and now - self._ready[0] < READY_CACHE_SECONDS:
                return list(self._ready[1]), dict(self._ready[2])
            problems = []
            problem = self.kube.ping()
            if problem:
                problems.append(problem)
            for check in self.readiness_checks:
                problem = check()
                if problem:
                    problems.append(problem)
            details: dict[str, object] = {}
            for name, detail in self.details.items():
                try:
                    details[name] = detail()
                except Exception as e:  # a detail never breaks the probe
                    details[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            self._ready = (now, problems, details)
            return list(problems), dict(details)


def build_guard(settings: Settings, readiness_checks: Sequence[Callable[[], str | None]] = ()) -> Guard:
    """Clients, caches and background workers of one worker process (after the fork)."""
    # A kept connection for each thread that may GET at once (request threads and background verifiers):
    # a connection closed for want of room is a new TLS handshake (about 2 ms of CPU) later.
    kube = Kube(load_configuration(settings.kubeconfig), timeout=settings.get_timeout,
                pool_size=settings.threads + settings.verify_concurrency)
    # An audit store that cannot be opened or written never changes a verdict nor readiness: its
    # health is a metric, a log line and a /readyz detail (guard/audit/backend.py GuardAudit).
    audit = GuardAudit.open(settings, on_new=announce_new_ghost)
    pool = ReplicaPool(settings, kube)
    healer = AutoHealer(settings, kube, pool, audit.store) if settings.heal else None
    # The checker's events (guard.engine.checker.CheckerEvents), given at its construction: the incident
    # recorder hears its ghosts, the pre-verifier its calls; both are built on the checker they hear.
    built: list[tuple[IncidentRecorder, Preparer | None]] = []

    def events(checker: Checker) -> Events:
        incidents = IncidentRecorder(settings, kube, pool, audit, retract=checker.retract,
                                     heal=healer.submit if healer is not None else None)
        preparer = (Preparer(settings, pool, checker, sweep_hooks=[incidents.reprobe_stale]) if settings.prepare
                    else None)
        built.append((incidents, preparer))
        return incidents.events(called=preparer.called if preparer is not None else Events().called,
                                tier=partial(ghost_tier, incidents=incidents, preparer=preparer))

    checker = Checker(settings, kube.quorum_get, events=events)
    ((incidents, preparer),) = built
    # Every replica's view of its unscheduled pods (guard/engine/replica_views.py), the pre-verifier's when on.
    if preparer is not None:
        views, stop_views = preparer.views, preparer.close
        preparer.start()
    else:
        views = ReplicaViews(settings, pool, checker.cache.tick)
        stop_views = views.close
        views.start()
    # Replica caches that miss pods or froze: metrics, Events, a /readyz detail (guard/engine/cache_health.py).
    cache_health = CacheHealthMonitor(settings, kube, pool, views.pending_views)
    incidents.frozen = cache_health.frozen  # advice for a frozen replica: a restart, never a write
    cache_health.start()
    nodes = None
    if settings.ghost_nodes:
        nodes = GhostNodes(kube, pool, events=settings.events, audit=audit)
        nodes.start()
    return Guard(settings, kube, checker, incidents, preparer, nodes, readiness_checks=list(readiness_checks),
                 details={
                     "ghost_nodes": nodes.status if nodes is not None else lambda: {"enabled": False},
                     "audit_store": incidents.check_audit,
                     "replicas": lambda: replica_details(incidents, preparer),
                     "replica_caches": cache_health.status,
                     "prepare": lambda: prepare_details(preparer)},
                 closers=[cache_health.close, stop_views,
                          *([nodes.close] if nodes is not None else []),
                          *([healer.close] if healer is not None else []),
                          # last: a ghost's follow-up still running records its block, and skips its probe round
                          # quietly (at the interpreter's exit the probe pool is shut under it: an error line)
                          incidents.close])


def ghost_tier(pod: PodRef, incidents: IncidentRecorder, preparer: Preparer | None) -> str:
    """The ghost's tier (guard/core/flood.py): a replica was seen serving it (confirmed), some replica's cache
    listed it (sighted, known only with pre-verification on), or neither (unsighted: budgeted)."""
    if incidents.confirmed(pod):
        return flood.CONFIRMED
    if preparer is not None and preparer.views.knows(pod):
        return flood.SIGHTED
    return flood.UNSIGHTED


def replica_details(incidents: IncidentRecorder, preparer: Preparer | None) -> dict[str, dict[str, object]]:
    """Per apiserver replica, the guard's view of its unscheduled pods (watched or listed; None with
    --no-prepare) and its newest cache
    probe (None before any ghost was probed). Information, never a reason for 503."""
    watches = preparer.views.watch_status()["replicas"] if preparer else {}
    probes = incidents.probe_status()
    return {address: {"watch": watches.get(address), "last_probe": probes.get(address)}
            for address in sorted(set(watches) | set(probes))}


def prepare_details(preparer: Preparer | None) -> dict[str, object]:
    """Whether pods are verified ahead, the watch fallback in use, and the idle state (--prepare-idle-after)."""
    if preparer is None:
        return {"enabled": False, "fallback": None}
    return {"enabled": True, "fallback": preparer.views.watch_status()["fallback"], **preparer.idle_status()}
