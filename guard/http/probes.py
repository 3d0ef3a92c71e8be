"""``/healthz`` (the process answers), ``/readyz`` (it can decide verdicts), ``/metrics``.

``/readyz`` is 503 only for what stops verdicts: the apiserver does not answer
``/version``, or the served certificate is invalid (the server's check). What
degrades one feature (the audit store, a replica's watch) is a detail of its body.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flask import Blueprint, Response, current_app

from guard import metrics
from guard.http.app import guard_of, json_response

bp = Blueprint("probes", __name__)

# Readiness results are reused for this long, so probes never load the apiserver.
READY_CACHE_SECONDS = 2.0
_ready_lock = threading.Lock()
_ready_state: dict[str, Any] = {"at": -1e9, "problems": [], "details": {}}


@bp.get("/healthz")
def healthz() -> Response:
    return json_response({"status": "ok"})


def readiness() -> tuple[list[str], dict[str, object]]:
    """(problems, details): problems are what stops verdicts (a 503), details what degrades a
    feature (the audit store, a replica's watch), shown but never a reason for 503."""
    guard = guard_of(current_app)
    with _ready_lock:
        now = time.monotonic()
        if now - float(_ready_state["at"]) < READY_CACHE_SECONDS:
            return list(_ready_state["problems"]), dict(_ready_state["details"])
        problems = []
        problem = guard.kube.ping()
        if problem:
            problems.append(problem)
        for check in guard.readiness_checks:
            problem = check()
            if problem:
                problems.append(problem)
        details = {}
        for name, detail in guard.details.items():
            try:
                details[name] = detail()
            except Exception as e:  # a detail never breaks the probe
                details[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        _ready_state.update(at=now, problems=problems, details=details)
        return problems, details


@bp.get("/readyz")
def readyz() -> Response:
    problems, details = readiness()
    if problems:
        return json_response({"status": "not ready", "problems": problems, "details": details}, 503)
    return json_response({"status": "ready", "details": details})


@bp.get("/metrics")
def prometheus() -> Response:
    return Response(metrics.exposition(), mimetype="text/plain; version=0.0.4; charset=utf-8")
