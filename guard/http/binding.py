"""``POST /validate/binding``: the admission webhook for schedulers without the extender.

Same verdict engine and caches as ``/filter``. A ghost's binding is denied with
the verdict's reason; anything else is allowed; the guard's own trouble fails
open (the webhook is registered with ``failurePolicy: Ignore`` as well).
"""

from __future__ import annotations

from flask import Blueprint, Response, current_app, g

from guard import admission
from guard.http.app import guard_of
from guard.http.filter import read_json_body

bp = Blueprint("binding", __name__)


@bp.post("/validate/binding")
def validate_binding() -> Response:
    body = read_json_body()
    if isinstance(body, Response):
        return body
    review = admission.parse_review(body)
    if review.pod is None:
        return Response(admission.build_response(review.uid, allowed=True), mimetype="application/json")
    g.pod = review.pod
    guard = guard_of(current_app)
    decision = guard.checker.check(review.pod)
    g.verdict = decision.verdict.value
    blocked = guard.checker.blocks(decision)
    payload = admission.build_response(review.uid, allowed=not blocked, message=decision.reason if blocked else "")
    return Response(payload, mimetype="application/json")
