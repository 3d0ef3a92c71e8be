"""``/healthz`` (the process answers), ``/readyz`` (it can do its job), ``/metrics``."""

from __future__ import annotations

import threading
import time

from flask import Blueprint, Response, current_app

from guard import metrics
from guard.http.app import guard_of, json_response

bp = Blueprint("probes", __name__)

# Readiness results are reused for this long, so probes never load the apiserver.
READY_CACHE_SECONDS = 2.0
_ready_lock = threading.Lock()
_ready_state: dict[str, object] = {"at": -1e9, "problems": []}


@bp.get("/healthz")
def healthz() -> Response:
    return json_response({"status": "ok"})


def readiness_problems() -> list[str]:
    guard = guard_of(current_app)
    with _ready_lock:
        now = time.monotonic()
        if now - float(_ready_state["at"]) < READY_CACHE_SECONDS:
            return list(_ready_state["problems"])  # type: ignore[arg-type]
        problems = []
        problem = guard.kube.ping()
        if problem:
            problems.append(problem)
        for check in guard.readiness_checks:
            problem = check()
            if problem:
                problems.append(problem)
        _ready_state.update(at=now, problems=problems)
        return problems


@bp.get("/readyz")
def readyz() -> Response:
    problems = readiness_problems()
    if problems:
        return json_response({"status": "not ready", "problems": problems}, 503)
    return json_response({"status": "ready"})


@bp.get("/metrics")
def prometheus() -> Response:
    return Response(metrics.exposition(), mimetype="text/plain; version=0.0.4; charset=utf-8")
