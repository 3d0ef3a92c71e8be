"""The Flask application factory: settings -> clients -> routes, JSON errors, access log."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from guard import metrics
from guard.cache_health import CacheHealthMonitor
from guard.check import Checker
from guard.extender import ProtocolError
from guard.incident import IncidentRecorder, open_audit_store
from guard.kube import Kube, load_configuration
from guard.prepare import Preverifier
from guard.replicas import ReplicaPool
from guard.settings import Settings
from guard.verdict import PodRef

log = logging.getLogger(__name__)
access_log = logging.getLogger("guard.access")

# Bodies up to this size are answered without taking room in the worker's BodyBudget.
SMALL_BODY_BYTES = 256 * 1024

ENDPOINTS = frozenset({"/filter", "/preempt", "/validate/binding", "/healthz", "/readyz", "/metrics"})


class Overloaded(ProtocolError):
    """Too many large bodies are being answered at once: 503 with the reason (the caller retries)."""

    status = 503


class BodyBudget:
    """Memory per worker: requests with a body over ``small`` bytes are answered only while the
    bytes of all such bodies in flight stay within ``limit``; one waits at most ``wait`` seconds
    for room, else 503 before its body is read.

    Room is taken before the body is read and given back once the reply is written, so the raw
    body, its decoded document (bounded per byte by guard.extender.decode) and the reply are all
    covered: about ``threads x small + limit`` bytes of request at once (docs/RELIABILITY.md).
    kube-scheduler's names-mode bodies up to ``small`` never wait.
    """

    def __init__(self, limit: int, *, small: int, wait: float) -> None:
        self.limit, self.small, self.wait = limit, small, wait
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, size: int) -> int:
        """Room for a body of ``size`` bytes: the bytes taken (0 for a small body). Raises Overloaded."""
        if size <= self.small:
            return 0
        size = min(size, self.limit)
        deadline = time.monotonic() + self.wait
        with self._cond:
            while self._used + size > self.limit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Overloaded(f"too many large requests at once ({self._used} bytes of bodies over "
                                     f"{self.small} bytes in flight, at most {self.limit}); retry")
                self._cond.wait(remaining)
            self._used += size
        return size

    def release(self, taken: int) -> None:
        if taken:
            with self._cond:
                self._used -= taken
                self._cond.notify_all()


@dataclass
class Guard:
    """What the routes share in one worker process."""

    settings: Settings
    kube: Kube
    checker: Checker
    incidents: IncidentRecorder
    preverifier: Preverifier | None
    # Bodies over SMALL_BODY_BYTES in flight: at most two of the largest accepted (build_guard).
    bodies: BodyBudget
    # Extra readiness checks (None when fine, else a reason): only what stops verdicts, e.g. the
    # served certificate. The apiserver is checked by the probe itself.
    readiness_checks: list[Callable[[], str | None]] = field(default_factory=list)
    # /readyz body details, never a reason for 503: name -> callable returning a JSON-able value.
    details: dict = field(default_factory=dict)


def json_response(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status=status, mimetype="application/json")


def json_error(status: int, reason: str) -> Response:
    return json_response({"error": reason}, status)


def record_request(settings: Settings, method: str, path: str, status: int, elapsed: float, remote: str | None,
                   pod: PodRef | None = None, verdict: str | None = None) -> None:
    """Metrics and the access-log line of one answered request (both lanes)."""
    endpoint = path if path in ENDPOINTS else "other"
    metrics.labelled(metrics.REQUESTS, endpoint, str(status)).inc()
    metrics.labelled(metrics.REQUEST_DURATION, endpoint).observe(elapsed)
    if settings.access_log and endpoint not in ("/healthz", "/metrics"):
        entry = {"method": method, "path": path[:200], "status": status, "duration_ms": round(elapsed * 1000, 3),
                 "remote": remote}
        if pod is not None:
            entry["pod"] = str(pod)
            entry["uid"] = pod.uid
        if verdict is not None:
            entry["verdict"] = verdict
        access_log.info("request", extra={"access": entry})


def guard_of(app: Flask) -> Guard:
    return app.extensions["ghost_guard"]


def build_guard(settings: Settings, readiness_checks: Sequence[Callable[[], str | None]] = ()) -> Guard:
    """Clients, caches and background workers of one worker process (after the fork)."""
    kube = Kube(load_configuration(settings.kubeconfig), timeout=settings.get_timeout, pool_size=settings.threads)
    checker = Checker(settings, kube.quorum_get)
    # An audit store that cannot be opened or written never changes a verdict nor readiness: its
    # health is a metric, a log line and a /readyz detail (IncidentRecorder.check_audit).
    audit, audit_error = open_audit_store(settings)
    pool = ReplicaPool(settings, kube)
    healer = None
    if settings.heal:
        from guard.autoheal import AutoHealer

        healer = AutoHealer(settings, kube, pool, audit)
    incidents = IncidentRecorder(settings, kube, pool, audit, retract=checker.retract, audit_error=audit_error,
                                 heal=healer.submit if healer is not None else None)
    if healer is not None:
        healer.done = incidents.after_heal
    checker.listeners.append(incidents.new_ghost)
    checker.sighting_listeners.append(incidents.sighting)
    checker.block_recorders.append(incidents.record_block_now)
    preverifier = None
    if settings.prepare:
        preverifier = Preverifier(settings, pool, checker, sweep_hooks=[incidents.reprobe_stale])
        preverifier.start()
    # Replica caches that miss pods or froze: metrics, Events, a /readyz detail (guard/cache_health.py).
    cache_health = CacheHealthMonitor(settings, kube, pool, preverifier.pending_views if preverifier else None)
    cache_health.start()
    bodies = BodyBudget(2 * settings.max_body_bytes, small=min(SMALL_BODY_BYTES, settings.max_body_bytes),
                        wait=min(1.0, settings.request_budget / 2))
    return Guard(settings, kube, checker, incidents, preverifier, bodies, readiness_checks=list(readiness_checks),
                 details={
                     "audit_store": incidents.check_audit,
                     "replicas": lambda: replica_details(incidents, preverifier),
                     "replica_caches": cache_health.status,
                     "preverification": lambda: {"enabled": preverifier is not None,
                                                 "fallback": preverifier.watch_status()["fallback"] if preverifier
                                                 else None,
                                                 **(preverifier.idle_status() if preverifier else {})}})


def replica_details(incidents: IncidentRecorder, preverifier: Preverifier | None) -> dict:
    """Per apiserver replica, its unscheduled-pod watch (None with --no-prepare) and its newest cache
    probe (None before any ghost was probed). Information, never a reason for 503."""
    watches = preverifier.watch_status()["replicas"] if preverifier else {}
    probes = incidents.probe_status()
    return {address: {"watch": watches.get(address), "last_probe": probes.get(address)}
            for address in sorted(set(watches) | set(probes))}


def bound_malloc() -> None:
    """glibc malloc, before the worker's threads start: buffers of 128 KiB and more (request bodies,
    decoded node lists, replies) get mappings of their own, returned to the system when freed, and
    the threads share two arenas instead of one each. Otherwise memory a thread freed stays resident
    in its own arena: 16 concurrent 4 MiB requests peaked at 564 MiB instead of 236 MiB
    (docs/RELIABILITY.md). Elsewhere than glibc this does nothing."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_mmap_threshold, m_arena_max = -3, -8  # <malloc.h>
    mallopt(m_mmap_threshold, 128 * 1024)
    mallopt(m_arena_max, 2)


def create_app(settings: Settings | None = None, readiness_checks: Sequence[Callable[[], str | None]] = ()) -> Flask:
    """Build the app. Under gunicorn this runs in each worker *after* the fork.

    ``readiness_checks`` (each None when fine, else a reason) join the apiserver check
    of ``/readyz``; the server passes the TLS holder's.
    """
    settings = settings or Settings()
    bound_malloc()
    app = Flask("guard")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["ghost_guard"] = build_guard(settings, readiness_checks)

    from guard.http import binding, probes
    from guard.http import filter as filter_routes

    app.register_blueprint(filter_routes.bp)
    app.register_blueprint(binding.bp)
    app.register_blueprint(probes.bp)

    @app.errorhandler(ProtocolError)
    def protocol_error(e: ProtocolError) -> Response:
        return json_error(e.status, str(e))

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException) -> Response:
        resp = json_error(e.code or 500, e.description or e.name)
        for key, value in e.get_headers():  # keeps Allow on a 405
            if key.lower() != "content-type":
                resp.headers[key] = value
        return resp

    @app.errorhandler(Exception)
    def internal_error(e: Exception) -> Response:
        app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal error; see the guard's log")

    @app.before_request
    def start_timer() -> None:
        g.start = time.perf_counter()
        g.arrived = time.monotonic()  # starts the request budget (Checker.deadline)

    @app.after_request
    def record(resp: Response) -> Response:
        taken = g.pop("body_room", 0)  # BodyBudget room of this request's body: given back once written
        if taken:
            resp.call_on_close(lambda: app.extensions["ghost_guard"].bodies.release(taken))
        record_request(settings, request.method, request.path, resp.status_code,
                       time.perf_counter() - g.get("start", time.perf_counter()), request.remote_addr,
                       g.get("pod"), g.get("verdict"))
        return resp

    # /filter and /preempt as kube-scheduler sends them skip Flask (guard.http.filter.FastLane).
    from guard.http.filter import FastLane

    app.wsgi_app = FastLane(app.wsgi_app, app.extensions["ghost_guard"], settings)  # type: ignore[method-assign]
    # Outermost: with mTLS, each endpoint answers only its role's client certificates (both lanes).
    if settings.client_ca and not settings.insecure_http:
        app.wsgi_app = RoleCheck(app.wsgi_app, settings)  # type: ignore[method-assign]
    return app


class RoleCheck:
    """WSGI middleware: a 403 with the reason when the client certificate is not of the endpoint's role.

    The certificate comes from the worker (``environ["ghost_guard.peer_cert"]``, guard.worker);
    the matching is guard.identity's. Installed only with ``--client-ca``.
    """

    def __init__(self, app: Callable, settings: Settings) -> None:
        from guard.identity import RolePolicy

        self.app = app
        self.settings = settings
        self.policy = RolePolicy.from_settings(settings)

    def __call__(self, environ: dict, start_response: Callable):
        path = environ.get("PATH_INFO", "")
        refused = self.policy.refuse(path, environ.get("ghost_guard.peer_cert"))
        if refused is None:
            return self.app(environ, start_response)
        role, reason = refused
        payload = orjson.dumps({"error": reason})
        start_response("403 Forbidden", [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
        metrics.REQUESTS_FORBIDDEN.labels(path, role).inc()
        log.warning("refused %s %s from %s: %s", environ.get("REQUEST_METHOD"), path[:200],
                    environ.get("REMOTE_ADDR"), reason)
        record_request(self.settings, environ.get("REQUEST_METHOD", ""), path, 403, 0.0, environ.get("REMOTE_ADDR"))
        return [payload]
