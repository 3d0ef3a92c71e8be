"""The extender verbs: ``POST /filter`` and ``POST /preempt``.

Each decodes (guard.extender), checks (guard.check), and encodes. A ghost is
rejected on every node as *unresolvable*, and vetoed as a preemptor: without
the preempt verb a ghost that only fits by eviction makes the scheduler evict
real pods (it never reaches /filter, the built-in plugins already failed it).
"""

from __future__ import annotations

from flask import Blueprint, Response, current_app, g, request

from guard import extender
from guard.http.app import guard_of, json_error

bp = Blueprint("extender", __name__)


def read_json_body() -> bytes | Response:
    if request.mimetype != "application/json":
        return json_error(415, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}")
    return request.get_data(cache=False)


@bp.post("/filter")
def filter_nodes() -> Response:
    body = read_json_body()
    if isinstance(body, Response):
        return body
    args = extender.parse_filter(body)
    g.pod = args.pod
    guard = guard_of(current_app)
    decision = guard.checker.check(args.pod)
    g.verdict = decision.verdict.value
    if guard.checker.blocks(decision):
        payload = extender.filter_reject(args, decision.reason)
    else:
        payload = extender.filter_pass(args)
    return Response(payload, mimetype="application/json")


@bp.post("/preempt")
def preempt() -> Response:
    body = read_json_body()
    if isinstance(body, Response):
        return body
    args = extender.parse_preempt(body)
    g.pod = args.pod
    guard = guard_of(current_app)
    decision = guard.checker.check(args.pod)
    g.verdict = decision.verdict.value
    if guard.checker.blocks(decision):
        payload = extender.preempt_veto()
    else:
        payload = extender.preempt_allow(args)
    return Response(payload, mimetype="application/json")
