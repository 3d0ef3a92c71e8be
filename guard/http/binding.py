"""``POST /validate/binding``: the admission webhook for schedulers without the extender.

Same verdict engine and caches as ``/filter``. A ghost's binding is denied with
the verdict's reason; anything else is allowed; the guard's own trouble fails
open (the webhook is registered with ``failurePolicy: Ignore`` as well). A dry-run review
(``request.dryRun``) is answered the same way but records nothing.
"""

from __future__ import annotations

from flask import Blueprint, Response, g

from guard.core import admission
from guard.http.exchange import BodyBudget, read_json_body
from guard.engine.wiring import Guard


def blueprint(guard: Guard, bodies: BodyBudget) -> Blueprint:
    """The admission route, closed over this worker's guard and body budget."""
    bp = Blueprint("binding", __name__)

    @bp.post("/validate/binding")
    def validate_binding() -> Response:
        body = read_json_body(bodies, guard.settings.max_body_bytes)
        if isinstance(body, Response):
            return body
        review = admission.parse_review(body)
        if review.pod is None:
            return Response(admission.build_response(review.uid, allowed=True), mimetype="application/json")
        g.pod = review.pod
        # A dry run has no side effects (the webhook declares sideEffects: NoneOnDryRun): no audit
        # record, no Event, no incident; the verdict caches are the guard's own state.
        decision = guard.checker.answer(guard.checker.call(review.pod, g.arrived, record=not review.dry_run))
        g.verdict = decision.verdict.value
        blocked = guard.checker.blocks(decision)
        payload = admission.build_response(review.uid, allowed=not blocked,
                                           message=decision.reason if blocked else "")
        return Response(payload, mimetype="application/json")

    return bp
