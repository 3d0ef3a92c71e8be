"""The Flask application factory: the worker's guard (guard.engine.wiring) -> routes, JSON errors, access log.

The factory imports the routes (filter.py, binding.py, probes.py), each a blueprint closed over the
worker's Guard and BodyBudget; what they share about a request is guard.http.exchange, and the
request metrics and access-log line guard.http.filter's ``record_request``. No route imports this
module back.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from flask import Flask, Response, g, request
from werkzeug.exceptions import HTTPException

from guard import metrics
from guard.core.extender import ProtocolError
from guard.http import binding, probes
from guard.http import filter as filter_routes
from guard.http.filter import record_request
from guard.http.exchange import BodyBudget, json_error
from guard.core.identity import ROLE_OF_ENDPOINT, ROLE_OF_PATH, RolePolicy, exact_route
from guard.core.names import visible
from guard.core.settings import Settings
from guard.engine.wiring import build_guard
from guard.http.lane import DIRECT_LANE, PEER_CERT, DirectLane

log = logging.getLogger(__name__)


def bound_malloc() -> None:
    """glibc malloc, before the worker's threads start: buffers of 128 KiB and more (request bodies,
    decoded node lists, replies) get mappings of their own, returned to the system when freed, and
    the threads share two arenas instead of one each. Otherwise memory a thread freed stays resident
    in its own arena: 16 concurrent 4 MiB requests peaked at 564 MiB instead of 236 MiB
    (docs/RELIABILITY.md). Elsewhere than glibc this does nothing."""
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
    guard = build_guard(settings, readiness_checks)
    # Bodies over SMALL_BODY_BYTES in flight: at most two of the largest accepted.
    bodies = BodyBudget.for_settings(settings)
    app = Flask("guard", static_folder=None)  # no /static route: every route has a role (check_routes)
    app.extensions["ghost_guard"] = guard  # guard.serving.server's worker_exit hook closes it
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.register_blueprint(filter_routes.blueprint(guard, bodies))
    app.register_blueprint(binding.blueprint(guard, bodies))
    app.register_blueprint(probes.blueprint(guard))
    check_routes(app)

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
            resp.call_on_close(lambda: bodies.release(taken))
        record_request(settings, request.method, request.path, resp.status_code,
                       time.perf_counter() - g.get("start", time.perf_counter()), request.remote_addr,
                       g.get("pod"), g.get("verdict"))
        return resp

    # /filter and /preempt as kube-scheduler sends them skip Flask (guard.http.filter.FastLane), and
    # skip WSGI altogether when the worker can hand them over whole (guard.http.lane.DIRECT_LANE).
    fast = filter_routes.FastLane(app.wsgi_app, guard, bodies)
    app.wsgi_app = fast  # type: ignore[method-assign]
    # Outermost: with mTLS, each endpoint answers only its role's client certificates (every lane).
    roles = None
    if settings.client_ca and not settings.insecure_http:
        roles = RoleCheck(app.wsgi_app, settings)
        app.wsgi_app = roles  # type: ignore[method-assign]
    # Outermost of all, in every setup: a path that is not exactly a route is a 404 before anything
    # else (the role check, the fast lane, Flask's router, which would merge "//filter" into /filter).
    app.wsgi_app = RouteGate(app.wsgi_app, settings)  # type: ignore[method-assign]
    # The direct lane (guard.serving.framing.plain_call) takes only the exact bytes "/filter" and "/preempt".
    direct: DirectLane[filter_routes.Waiting] = filter_routes.DirectLane(
        fast, roles.refusal if roles is not None else None, roles.allowed if roles is not None else None)
    app.extensions[DIRECT_LANE] = direct
    return app


def check_routes(app: Flask) -> None:
    """Start-up check that the role checked is the role of the view that runs: Flask's URL map has
    exactly the routes of guard.core.identity.ROLE_OF_PATH, and each path, spelled exactly, is routed to
    the endpoint guard.core.identity.ROLE_OF_ENDPOINT gives that same role. Raises RuntimeError."""
    rules = {rule.rule: rule for rule in app.url_map.iter_rules()}
    if set(rules) != set(ROLE_OF_PATH):
        raise RuntimeError(f"the app's routes {sorted(rules)} are not guard.core.identity's {sorted(ROLE_OF_PATH)}")
    adapter = app.url_map.bind("guard")
    for path, rule in rules.items():
        for method in sorted(rule.methods or ()):
            endpoint, _ = adapter.match(path, method=method)
            if ROLE_OF_ENDPOINT.get(str(endpoint)) != ROLE_OF_PATH[path]:
                raise RuntimeError(f"{method} {path} runs {endpoint}, whose role is not {ROLE_OF_PATH[path]}")


class RouteGate:
    """WSGI middleware, outermost: a request whose path is not exactly one of the routes is answered
    404 (guard.core.identity.exact_route), before the role check, the fast lane or Flask's router see it.

    Routers normalize: werkzeug merges duplicate slashes, gunicorn decodes percent-escapes, so a
    role check by the spelling would let ``//filter`` or ``/%66ilter`` reach /filter unchecked
    (issue 25). Past this gate the spelling is the route that runs. Counted as endpoint ``other``.
    """

    PAYLOAD = orjson.dumps({"error": "no such endpoint: the path must be exactly one of "
                                     + ", ".join(sorted(ROLE_OF_PATH))
                                     + " (no other spelling: no percent-encoding, duplicate or trailing slash, "
                                       "dot segment, case or parameter)"})

    def __init__(self, app: Callable, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        raw = environ.get("RAW_URI", environ.get("REQUEST_URI"))
        if exact_route(raw, environ.get("SCRIPT_NAME", ""), environ.get("PATH_INFO", "")) is not None:
            return self.app(environ, start_response)
        # The access log shows the target as sent (escaped, cut); the metrics count it as "other".
        record_request(self.settings, visible(environ.get("REQUEST_METHOD", "")[:16]),
                       visible(str(raw if raw is not None else environ.get("PATH_INFO", ""))[:200]), 404, 0.0,
                       environ.get("REMOTE_ADDR"))
        start_response("404 Not Found", [("Content-Type", "application/json"),
                                         ("Content-Length", str(len(self.PAYLOAD)))])
        return [self.PAYLOAD]


class RoleCheck:
    """WSGI middleware: a 403 with the reason when the client certificate is not of the endpoint's role.

    The certificate comes from the worker (``environ["ghost_guard.peer_cert"]``, guard.serving.worker);
    the matching is guard.core.identity's. Installed only with ``--client-ca``.
    """

    def __init__(self, app: Callable, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.policy = RolePolicy.from_settings(settings)

    def __call__(self, environ: dict, start_response: Callable):
        path = environ.get("PATH_INFO", "")
        payload = self.refusal(environ.get("REQUEST_METHOD", ""), path, environ.get(PEER_CERT), environ.get("REMOTE_ADDR"))
        if payload is None:
            return self.app(environ, start_response)
        start_response("403 Forbidden", [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
        return [payload]

    def allowed(self, path: str, peer_cert: dict[str, Any] | None) -> bool:
        """Whether the certificate may call ``path`` (nothing counted or logged)."""
        return self.policy.refuse(path, peer_cert) is None

    def refusal(self, method: str, path: str, peer_cert: dict[str, Any] | None, remote: str | None) -> bytes | None:
        """None when the certificate may call ``path``; else the 403's JSON payload, counted and logged."""
        refused = self.policy.refuse(path, peer_cert)
        if refused is None:
            return None
        role, reason = refused
        metrics.REQUESTS_FORBIDDEN.labels(path if path in ROLE_OF_PATH else "other", role).inc()
        log.warning("refused %s %s from %s: %s", method, path[:200], remote, reason)
        record_request(self.settings, method, path, 403, 0.0, remote)
        return orjson.dumps({"error": reason})
