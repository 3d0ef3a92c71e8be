"""``/healthz`` (the process answers), ``/readyz`` (it can decide verdicts), ``/metrics``.

``/readyz`` is 503 only for what stops verdicts: the apiserver does not answer
``/version``, or the served certificate is invalid (the server's check). What
degrades one feature (the audit store, a replica's watch) is a detail of its body.
"""

from __future__ import annotations

from flask import Blueprint, Response

from guard import metrics
from guard.http.exchange import json_response
from guard.engine.wiring import Guard


def blueprint(guard: Guard) -> Blueprint:
    """The probes and /metrics, closed over this worker's guard (whose readiness() caches its result)."""
    bp = Blueprint("probes", __name__)

    @bp.get("/healthz")
    def healthz() -> Response:
        return json_response({"status": "ok"})

    @bp.get("/readyz")
    def readyz() -> Response:
        problems, details = guard.readiness()
        if problems:
            return json_response({"status": "not ready", "problems": problems, "details": details}, 503)
        return json_response({"status": "ready", "details": details})

    @bp.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.exposition(), mimetype="text/plain; version=0.0.4; charset=utf-8")

    return bp
