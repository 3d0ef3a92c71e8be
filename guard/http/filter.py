"""The extender verbs: ``POST /filter`` and ``POST /preempt``.

Each decodes (guard.extender), checks (guard.check), and encodes. A ghost is
rejected on every node as *unresolvable*, and vetoed as a preemptor: without
the preempt verb a ghost that only fits by eviction makes the scheduler evict
real pods (it never reaches /filter, the built-in plugins already failed it).

Two lanes, one answer (:func:`answer`):

- :class:`FastLane`, a WSGI middleware in front of Flask, takes the calls as
  kube-scheduler makes them (POST, ``application/json``, a Content-Length
  within ``--max-body-bytes``): body in, answer out, no Flask request
  machinery. kube-scheduler waits for this inside its serial scheduling
  cycle, and Flask's per-request work (about 0.1 ms) was most of the guard's
  cost on a prepared verdict.
- Everything else (a chunked body, a wrong method or Content-Type, an
  oversized body) falls through to the Flask routes below, which give the
  same answers and the 4xx replies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import orjson
from flask import Blueprint, Response, current_app, g, request
from werkzeug.wsgi import ClosingIterator

from guard import extender
from guard.extender import ProtocolError
from guard.http.app import Overloaded, guard_of, json_error, record_request
from guard.verdict import Decision, PodRef

if TYPE_CHECKING:
    from guard.http.app import Guard
    from guard.settings import Settings

log = logging.getLogger(__name__)
bp = Blueprint("extender", __name__)


def _filter_reject(args: extender.FilterArgs, decision: Decision) -> bytes:
    return extender.filter_reject(args, decision.reason)


def _preempt_veto(args: extender.PreemptArgs, decision: Decision) -> bytes:
    return extender.preempt_veto()


# path -> (parse, block, allow)
VERBS: dict[str, tuple[Callable[..., Any], Callable[[Any, Decision], bytes], Callable[[Any], bytes]]] = {
    "/filter": (extender.parse_filter, _filter_reject, extender.filter_pass),
    "/preempt": (extender.parse_preempt, _preempt_veto, extender.preempt_allow),
}


def answer(guard: Guard, path: str, body: bytes, arrived: float) -> tuple[bytes, PodRef, Decision]:
    """Decode, check the pod, encode: the same three steps for both verbs. Raises ProtocolError.

    ``arrived`` (time.monotonic) starts the request budget: the answer is ready within
    ``--request-budget`` of it, whatever the apiserver does."""
    parse, block, allow = VERBS[path]
    args = parse(body, guard.settings.max_nodes) if path == "/filter" else parse(body)
    decision = guard.checker.check(args.pod, deadline=guard.checker.deadline(arrived))
    payload = block(args, decision) if guard.checker.blocks(decision) else allow(args)
    return payload, args.pod, decision


def acquire_room(guard: Guard, stream: Any, length: int) -> int:
    """Room in the worker's BodyBudget for a body of ``length`` bytes (before it is read).

    Without room, the body (``stream``, unless None) is read and dropped in 64 KiB pieces, so the
    client reads the 503 and its reason instead of a reset connection; raises Overloaded.
    """
    try:
        return guard.bodies.acquire(length)
    except Overloaded:
        if stream is not None:
            drain(stream, length)
        raise


def drain(stream: Any, length: int) -> None:
    """Read and drop up to ``length`` bytes of a body that will not be used, 64 KiB at a time.

    A reply sent while the client still sends its body would otherwise be lost: closing a
    socket with unread data resets the connection, and the client drops the reply with it.
    And gunicorn closes a connection after the reply when more than 64 KiB of the body is left
    unread, which a client reusing the connection sees as a reset.
    """
    try:
        while length > 0 and (chunk := stream.read(min(length, 65536))):
            length -= len(chunk)
    except Exception:  # the client went away: it gets no answer either way
        pass


# --- the fast lane ---------------------------------------------------------------------------------

_JSON = "application/json"
_STATUS_LINES = {code: f"{code} {HTTPStatus(code).phrase}" for code in (200, 400, 413, 500, 503)}


class FastLane:
    """WSGI middleware: answers kube-scheduler's well-formed verb calls itself, passes the rest on."""

    def __init__(self, app: Callable, guard: Guard, settings: Settings) -> None:
        self.app = app
        self.guard = guard
        self.settings = settings
        self.limit = settings.max_body_bytes

    def _length(self, environ: dict) -> int | None:
        """The body length when this call is for the fast lane, else None."""
        if environ.get("REQUEST_METHOD") != "POST" or environ.get("PATH_INFO") not in VERBS:
            return None
        ctype = environ.get("CONTENT_TYPE", "")
        if ctype != _JSON and ctype.split(";", 1)[0].strip().lower() != _JSON:
            return None
        length = environ.get("CONTENT_LENGTH", "")
        if not (length.isascii() and length.isdigit()) or int(length) > self.limit:
            return None
        return int(length)

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        length = self._length(environ)
        if length is None:
            return self.app(environ, start_response)
        start = time.perf_counter()
        arrived = time.monotonic()
        path = environ["PATH_INFO"]
        pod = verdict = None
        taken = 0
        try:
            taken = acquire_room(self.guard, environ["wsgi.input"], length)
            try:
                body = environ["wsgi.input"].read(length)
            except Exception as e:  # the client went away or stalled mid-body
                raise ProtocolError(f"could not read the request body: {type(e).__name__}") from e
            payload, pod, decision = answer(self.guard, path, body, arrived)
            verdict = decision.verdict.value
            status = 200
        except ProtocolError as e:
            payload, status = orjson.dumps({"error": str(e)}), e.status
        except Exception:
            log.exception("unhandled error on POST %s", path)
            payload, status = orjson.dumps({"error": "internal error; see the guard's log"}), 500
        start_response(_STATUS_LINES[status], [("Content-Type", _JSON), ("Content-Length", str(len(payload)))])
        record_request(self.settings, "POST", path, status, time.perf_counter() - start,
                       environ.get("REMOTE_ADDR"), pod, verdict)
        if taken:  # the room is given back once the reply is written (the server closes the iterable)
            return ClosingIterator([payload], lambda: self.guard.bodies.release(taken))
        return [payload]


# --- the Flask lane: everything the fast lane passes on ----------------------------------------------


def read_json_body() -> bytes | Response:
    """The request body, or an error reply: 415 unless JSON, 413 over ``--max-body-bytes``.

    With a Content-Length, an oversized body is refused before it is read (and read past,
    unkept, up to twice the limit, so that the client gets the reply). A chunked body has
    none: it is read up to one byte past the limit, so an oversized one is refused instead
    of being cut at the limit and parsed.
    """
    if request.mimetype != "application/json":
        return json_error(415, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}")
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    stream = request.environ["wsgi.input"]
    if request.content_length is not None and request.content_length > limit:
        if request.content_length <= 2 * limit:  # read past, unkept, so that the client gets the reason
            drain(stream, request.content_length)
        return json_error(413, f"request body of {request.content_length} bytes is larger than the limit "
                               f"({limit} bytes, --max-body-bytes)")
    # Room in the worker's BodyBudget before reading (a chunked body may be as large as the limit);
    # given back when the reply is written (guard.http.app, after_request).
    g.body_room = acquire_room(guard_of(current_app), stream if request.content_length is not None else None,
                               request.content_length if request.content_length is not None else limit)
    if request.content_length is not None:
        return request.get_data(cache=False)
    body = stream.read(limit + 1)
    if len(body) > limit:
        del body
        drain(stream, 2 * limit)  # so that the connection stays usable (gunicorn drops it past 64 KiB unread)
        return json_error(413, f"request body larger than the limit ({limit} bytes, --max-body-bytes)")
    return body


def _verb() -> Response:
    body = read_json_body()
    if isinstance(body, Response):
        return body
    payload, g.pod, decision = answer(guard_of(current_app), request.path, body, g.arrived)
    g.verdict = decision.verdict.value
    return Response(payload, mimetype="application/json")


@bp.post("/filter")
def filter_nodes() -> Response:
    """A ghost: every node unresolvable, one reason. Otherwise every node passes, in the request's mode."""
    return _verb()


@bp.post("/preempt")
def preempt() -> Response:
    """A ghost: no node may lose a pod for it. Otherwise every candidate, as meta victims."""
    return _verb()
