"""The Flask application factory: settings -> clients -> routes, JSON errors, access log."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from guard import metrics
from guard.audit import AuditError, AuditStore
from guard.check import Checker
from guard.extender import ProtocolError
from guard.incident import IncidentRecorder
from guard.kube import Kube, load_configuration
from guard.prepare import Preverifier
from guard.replicas import ReplicaPool
from guard.settings import Settings
from guard.verdict import PodRef

log = logging.getLogger(__name__)
access_log = logging.getLogger("guard.access")

ENDPOINTS = frozenset({"/filter", "/preempt", "/validate/binding", "/healthz", "/readyz", "/metrics"})


@dataclass
class Guard:
    """What the routes share in one worker process."""

    settings: Settings
    kube: Kube
    checker: Checker
    incidents: IncidentRecorder
    preverifier: Preverifier | None
    # Extra readiness checks (None when fine, else a reason), e.g. the audit store.
    readiness_checks: list = field(default_factory=list)


def json_response(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status=status, mimetype="application/json")


def json_error(status: int, reason: str) -> Response:
    return json_response({"error": reason}, status)


def record_request(settings: Settings, method: str, path: str, status: int, elapsed: float, remote: str | None,
                   pod: PodRef | None = None, verdict: str | None = None) -> None:
    """Metrics and the access-log line of one answered request (both lanes)."""
    endpoint = path if path in ENDPOINTS else "other"
    metrics.REQUESTS.labels(endpoint, str(status)).inc()
    metrics.REQUEST_DURATION.labels(endpoint).observe(elapsed)
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


def open_audit(settings: Settings) -> tuple[AuditStore | None, Callable[[], str | None]]:
    """The audit store, or None and a readiness problem: an audit failure never changes a verdict."""
    try:
        store = AuditStore(settings.audit_db, max_age_seconds=settings.audit_max_age,
                           max_records=settings.audit_max_records, echo=sys.stdout)
    except (AuditError, OSError, ValueError) as e:
        reason = f"audit store {settings.audit_db} unusable: {e}"
        log.error("%s; ghosts are still blocked but not recorded", reason)
        return None, lambda: reason
    return store, store.check


def build_guard(settings: Settings, readiness_checks: list[Callable[[], str | None]] = ()) -> Guard:
    """Clients, caches and background workers of one worker process (after the fork)."""
    kube = Kube(load_configuration(settings.kubeconfig), timeout=settings.get_timeout, pool_size=settings.threads)
    checker = Checker(settings, kube.quorum_get)
    audit, audit_check = open_audit(settings)
    pool = ReplicaPool(settings, kube)
    incidents = IncidentRecorder(settings, kube, pool, audit, retract=checker.retract)
    checker.listeners.append(incidents.new_ghost)
    checker.sighting_listeners.append(incidents.sighting)
    preverifier = None
    if settings.prepare:
        preverifier = Preverifier(settings, pool, checker, sweep_hooks=[incidents.reprobe_stale])
        preverifier.start()
    return Guard(settings, kube, checker, incidents, preverifier, readiness_checks=[audit_check, *readiness_checks])


def create_app(settings: Settings | None = None, readiness_checks: list[Callable[[], str | None]] = ()) -> Flask:
    """Build the app. Under gunicorn this runs in each worker *after* the fork.

    ``readiness_checks`` (each None when fine, else a reason) join the apiserver and
    audit checks of ``/readyz``; the server passes the TLS holder's.
    """
    settings = settings or Settings()
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
        return json_error(400, str(e))

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
