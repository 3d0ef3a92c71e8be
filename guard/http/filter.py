"""The extender verbs: ``POST /filter`` and ``POST /preempt``.

Each decodes (guard.extender), checks (guard.check), and encodes. A ghost is
rejected on every node as *unresolvable*, and vetoed as a preemptor: without
the preempt verb a ghost that only fits by eviction makes the scheduler evict
real pods (it never reaches /filter, the built-in plugins already failed it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, current_app, g, request

from guard import extender
from guard.http.app import guard_of, json_error
from guard.verdict import Decision

bp = Blueprint("extender", __name__)


def read_json_body() -> bytes | Response:
    """The request body, or an error reply: 415 unless JSON, 413 over ``--max-body-bytes``.

    With a Content-Length, werkzeug refuses an oversized body before reading it. A
    chunked body has none: it is read up to one byte past the limit, so an oversized
    one is refused instead of being cut at the limit and parsed.
    """
    if request.mimetype != "application/json":
        return json_error(415, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}")
    if request.content_length is not None:
        return request.get_data(cache=False)
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    body = request.environ["wsgi.input"].read(limit + 1)
    if len(body) > limit:
        return json_error(413, f"request body larger than the limit ({limit} bytes, --max-body-bytes)")
    return body


def _verb(parse: Callable, block: Callable[[Any, Decision], bytes], allow: Callable[[Any], bytes]) -> Response:
    """Decode, check the pod, encode: the same three steps for both verbs."""
    body = read_json_body()
    if isinstance(body, Response):
        return body
    args = parse(body)
    g.pod = args.pod
    checker = guard_of(current_app).checker
    decision = checker.check(args.pod)
    g.verdict = decision.verdict.value
    payload = block(args, decision) if checker.blocks(decision) else allow(args)
    return Response(payload, mimetype="application/json")


@bp.post("/filter")
def filter_nodes() -> Response:
    """A ghost: every node unresolvable, one reason. Otherwise every node passes, in the request's mode."""
    return _verb(extender.parse_filter, lambda args, d: extender.filter_reject(args, d.reason), extender.filter_pass)


@bp.post("/preempt")
def preempt() -> Response:
    """A ghost: no node may lose a pod for it. Otherwise every candidate, as meta victims."""
    return _verb(extender.parse_preempt, lambda args, d: extender.preempt_veto(), extender.preempt_allow)
