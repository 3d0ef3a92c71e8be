"""The extender verbs: ``POST /filter`` and ``POST /preempt``.

Each decodes (guard.core.extender), checks (guard.engine.checker), and encodes. A ghost is
rejected on every node as *unresolvable*, and vetoed as a preemptor: without
the preempt verb a ghost that only fits by eviction makes the scheduler evict
real pods (it never reaches /filter, the built-in plugins already failed it).

Three lanes, one answer (:func:`answer`):

- :class:`DirectLane`, below WSGI: the worker (guard.serving.framing, ``plain_call``)
  hands it the calls exactly as kube-scheduler makes them (``POST`` over
  HTTP/1.1, ``application/json``, a Content-Length body; in the worker's event
  loop at most the BodyBudget's small size, from a pool thread up to
  ``--max-body-bytes``, its bytes held against ``--max-buffered-bytes``): body
  in, status and payload out. kube-scheduler
  waits for this inside its serial scheduling cycle, and gunicorn's request
  parser, WSGI environ and response object were half of the guard's CPU per
  call (docs/BENCHMARKS.md).
- :class:`FastLane`, a WSGI middleware in front of Flask, takes the other
  well-formed verb calls (HTTP/1.0, other header shapes):
  body in, answer out, no Flask request machinery.
- Everything else (a chunked body, a wrong method or Content-Type, an
  oversized body) falls through to the Flask routes below, which give the
  same answers and the 4xx replies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import orjson
from flask import Blueprint, Response, g, request
from werkzeug.wsgi import ClosingIterator

from guard import metrics
from guard.core import extender
from guard.core.extender import ProtocolError
from guard.http.exchange import BodyBudget, acquire_room, read_json_body
from guard.core.verdict import Decision, PodRef
from guard.engine.checker import Call, Pending
from guard.engine.wiring import Guard
from guard.core.settings import Settings
from guard.http.lane import CODEC, Codec, PeerCert, Reply

log = logging.getLogger(__name__)


access_log = logging.getLogger("guard.access")

VERBS = frozenset({"/filter", "/preempt"})
ENDPOINTS = frozenset({"/filter", "/preempt", "/validate/binding", "/healthz", "/readyz", "/metrics"})


class LocalCodec:
    """A verb call's bytes decoded and encoded in this process (guard.core.extender); the worker may
    hand :func:`answer` another codec of the same shape (guard.http.lane.Codec: guard.serving.offload
    does a large call's in a helper process)."""

    @staticmethod
    def parse(path: str, body: bytes, max_nodes: int | None) -> Any:
        return extender.parse_verb(path, body, max_nodes)

    @staticmethod
    def encode(args: Any, block_reason: str | None, ghosts: Any) -> tuple[bytes, int]:
        return extender.verb_reply(args, block_reason, ghosts)


LOCAL = LocalCodec()


def _parse(guard: Guard, path: str, body: bytes) -> Any:
    return extender.parse_verb(path, body, guard.settings.max_nodes)


def answer(guard: Guard, path: str, body: bytes, arrived: float, codec: Codec = LOCAL) -> tuple[bytes, PodRef, Decision]:
    """Decode, check the pod, encode: the same three steps for both verbs. Raises ProtocolError.

    ``arrived`` (time.monotonic) starts the request budget: the answer is ready within
    ``--request-budget`` of it, whatever the apiserver does. ``codec`` decodes and encodes the bytes
    (the check is always here)."""
    args = codec.parse(path, body, guard.settings.max_nodes)
    decision = guard.checker.answer(guard.checker.call(args.pod, arrived))
    return _encode(guard, path, args, decision, codec), args.pod, decision


def _encode(guard: Guard, path: str, args: Any, decision: Decision | None, codec: Codec = LOCAL) -> bytes:
    """The verb's answer for this decision (None: allowed): blocked (a ghost, or fail-closed: every node
    fails with the verdict, a preemptor is vetoed) or allowed, except ghost Nodes (guard/core/node_verdict.py)."""
    blocked = decision is not None and guard.checker.blocks(decision)
    nodes = guard.nodes
    ghosts = nodes.knowledge.ghosts if nodes is not None and nodes.knowledge.ghosts else {}
    payload, dropped = codec.encode(args, extender.node_reason(decision.verdict) if blocked and decision else None,
                                    ghosts)
    if dropped:
        metrics.labelled(metrics.GHOST_NODE_CANDIDATES, path[1:]).inc(dropped)
    return payload


def _allow(guard: Guard, path: str, args: Any) -> bytes:
    """A live pod's answer: every candidate, except ghost Nodes. With no ghost Node known (the normal
    case) that is one attribute test, no work per node name."""
    return _encode(guard, path, args, None)


def record_request(settings: Settings, method: str, path: str, status: int, elapsed: float, remote: str | None,
                   pod: PodRef | None = None, verdict: str | None = None) -> None:
    """Metrics and the access-log line of one answered request (every lane, every endpoint: app.py
    records the others with it). Here, where the verb calls are answered: no file more on their path."""
    endpoint = path if path in ENDPOINTS else "other"
    metrics.labelled(metrics.REQUESTS, endpoint, str(status)).inc()
    metrics.labelled(metrics.REQUEST_DURATION, endpoint).observe(elapsed)
    if settings.access_log and endpoint not in ("/healthz", "/metrics"):
        entry = {"method": method, "path": path[:200], "status": status, "duration_ms": round(elapsed * 1000, 3),
                 "remote": remote}
        if pod is not None:
            entry["pod"] = f"{pod.namespace}/{pod.name}"  # str(pod), without a call on the verb path
            entry["uid"] = pod.uid
        if verdict is not None:
            entry["verdict"] = verdict
        access_log.info("request", extra={"access": entry})


# --- the fast lane ---------------------------------------------------------------------------------

_JSON = "application/json"
_STATUS_LINES = {code: f"{code} {HTTPStatus(code).phrase}" for code in (200, 400, 413, 500, 503)}


class FastLane:
    """WSGI middleware: answers kube-scheduler's well-formed verb calls itself, passes the rest on."""

    def __init__(self, app: Callable, guard: Guard, bodies: BodyBudget) -> None:
        self.app = app
        self.guard = guard
        self.bodies = bodies
        self.settings = guard.settings
        self.limit = guard.settings.max_body_bytes

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
        taken = 0
        try:
            taken = acquire_room(self.bodies, environ["wsgi.input"], length)
            try:
                body = environ["wsgi.input"].read(length)
            except Exception as e:  # the client went away or stalled mid-body
                raise ProtocolError(f"could not read the request body: {type(e).__name__}") from e
        except ProtocolError as e:
            payload, status = orjson.dumps({"error": str(e)}), e.status
            record_request(self.settings, "POST", path, status, time.perf_counter() - start, environ.get("REMOTE_ADDR"))
        else:
            status, payload = self.reply(path, body, environ.get("REMOTE_ADDR"), start, arrived,
                                         environ.get(CODEC, LOCAL))
        start_response(_STATUS_LINES[status], [("Content-Type", _JSON), ("Content-Length", str(len(payload)))])
        if taken:  # the room is given back once the reply is written (the server closes the iterable)
            return ClosingIterator([payload], lambda: self.bodies.release(taken))
        return [payload]

    def reply(self, path: str, body: bytes, remote: str | None, start: float, arrived: float,
              codec: Codec = LOCAL) -> tuple[int, bytes]:
        """(status, JSON payload) of a verb call whose body is in memory; its metrics and access-log line recorded.

        ``start`` (time.perf_counter) times the request; ``arrived`` (time.monotonic) starts its budget."""
        pod = verdict = None
        try:
            payload, pod, decision = answer(self.guard, path, body, arrived, codec)
            verdict = decision.verdict.value
            status = 200
        except ProtocolError as e:
            payload, status = orjson.dumps({"error": str(e)}), e.status
        except Exception:
            log.exception("unhandled error on POST %s", path)
            payload, status = orjson.dumps({"error": "internal error; see the guard's log"}), 500
        record_request(self.settings, "POST", path, status, time.perf_counter() - start, remote, pod, verdict)
        return status, payload


# The largest body answered in the worker's event loop (answer_now); larger ones go to a pool thread.
NOW_MAX_BODY = 128 * 1024


@dataclass(frozen=True, slots=True)
class Waiting:
    """A verb call the event loop decoded but could not answer (DirectLane.answer_now): ``joined``, it
    waits for its pod's quorum GET in flight (answered when it lands, DirectLane.answer_landed); else a
    pool thread answers it (DirectLane.answer_taken). The decoded call and the checker's Call are handed
    on, never decoded again. ``start`` is time.perf_counter at arrival (the request's duration),
    ``arrived`` time.monotonic at arrival (its budget)."""

    path: str
    args: Any
    call: Call
    remote: str | None
    start: float
    arrived: float
    joined: bool


class DirectLane:
    """The verb calls the worker hands over without WSGI (guard.serving.framing.plain_call; the contract is
    guard.http.lane.DirectLane): the same answers as :class:`FastLane`, and with mTLS the same role check
    as the WSGI lanes (``refuse``, and ``allowed`` to ask without counting or logging).

    ``max_body`` (the BodyBudget's small size) bounds what the worker's event loop hands over
    (:meth:`answer_now`); a pool thread hands over bodies up to ``--max-body-bytes``, which the worker
    holds against ``--max-buffered-bytes`` instead of the BodyBudget."""

    paths = frozenset(VERBS)

    def __init__(self, fast: FastLane, refuse: Callable[[str, str, PeerCert, str | None], bytes | None] | None,
                 allowed: Callable[[str, PeerCert], bool] | None = None) -> None:
        self.fast = fast
        self.refuse = refuse
        self.allowed = allowed
        self.max_body = min(fast.bodies.small, fast.limit)

    def answer_now(self, path: str, body: bytes, remote: str | None, peer_cert: PeerCert,
                   wake: Callable[[], None] | None = None) -> Reply | Waiting | None:
        """The answer when it needs no waiting (no GET, no lock held across I/O): a permitted caller,
        a body that decodes (at most NOW_MAX_BODY bytes) and a pod whose ``alive`` verdict was
        verified ahead (Checker.answer, ``now``).

        With ``wake``, a call whose pod's quorum GET is already in flight joins it and comes back
        :class:`Waiting` (``joined``): ``wake`` is called, on another thread, when the GET lands, and
        the caller then asks :meth:`answer_landed`. A decoded call that needs a thread (a miss, a
        ghost to record) comes back :class:`Waiting`, not joined: a pool thread answers it
        (:meth:`answer_taken`), without decoding it again.

        Else None, with nothing counted (a caller not permitted, a body too large or malformed): the
        worker then hands the request to a pool thread (:meth:`__call__`), which answers everything else."""
        if len(body) > NOW_MAX_BODY or (self.allowed is not None and not self.allowed(path, peer_cert)):
            return None
        start = time.perf_counter()
        arrived = time.monotonic()
        guard = self.fast.guard
        try:
            args = _parse(guard, path, body)
        except ProtocolError:
            return None
        call = guard.checker.call(args.pod, arrived)
        decision = guard.checker.answer(call, now=True, wake=wake)
        if isinstance(decision, Pending):
            return Waiting(path, args, call, remote, start, arrived, decision is Pending.JOINED)
        return self._reply(path, args, decision, remote, start)

    def answer_landed(self, waiting: Waiting) -> Reply | None:
        """The answer of a :class:`Waiting` call once its GET has landed (Checker.answer, ``now``), or
        None, with nothing counted: the worker hands the call to a pool thread (:meth:`answer_taken`),
        which goes through Checker.answer within the same budget (``arrived``)."""
        decision = self.fast.guard.checker.answer(waiting.call, now=True)
        if isinstance(decision, Pending):
            return None
        return self._reply(waiting.path, waiting.args, decision, waiting.remote, waiting.start)

    def answer_taken(self, waiting: Waiting) -> Reply:
        """From a pool thread: the answer of a call the event loop decoded and handed on (a
        :class:`Waiting`, joined or not), within the budget that began at its arrival. Its caller was
        permitted already (``allowed``, the same check as ``refuse``)."""
        try:
            decision = self.fast.guard.checker.answer(waiting.call)
            return self._reply(waiting.path, waiting.args, decision, waiting.remote, waiting.start)
        except ProtocolError as e:  # found encoding a refusal (a candidate name that is not one): FastLane.reply's 4xx
            payload, status = orjson.dumps({"error": str(e)}), e.status
        except Exception:
            log.exception("unhandled error on POST %s", waiting.path)
            payload, status = orjson.dumps({"error": "internal error; see the guard's log"}), 500
        record_request(self.fast.settings, "POST", waiting.path, status, time.perf_counter() - waiting.start,
                       waiting.remote)
        return status, payload

    def _reply(self, path: str, args: Any, decision: Decision, remote: str | None, start: float) -> Reply:
        payload = _encode(self.fast.guard, path, args, decision)
        record_request(self.fast.settings, "POST", path, 200, time.perf_counter() - start, remote, args.pod,
                       decision.verdict.value)
        return 200, payload

    def __call__(self, path: str, body: bytes, remote: str | None, peer_cert: PeerCert,
                 arrived: float | None = None, codec: Codec = LOCAL) -> Reply:
        """The answer, from a pool thread. ``arrived`` (time.monotonic) is when the call's budget
        began, if it waited before this (a :class:`Waiting` call handed over); default now. The
        request's recorded duration counts from then too. ``codec``: who decodes the body and encodes
        the answer (the worker's helper process for a large call, guard.serving.offload)."""
        start = time.perf_counter()
        if arrived is None:
            arrived = time.monotonic()
        else:
            start -= time.monotonic() - arrived
        if self.refuse is not None:
            refused = self.refuse("POST", path, peer_cert, remote)
            if refused is not None:
                return 403, refused
        return self.fast.reply(path, body, remote, start, arrived, codec)


# --- the Flask lane: everything the fast lane passes on ----------------------------------------------


def blueprint(guard: Guard, bodies: BodyBudget) -> Blueprint:
    """The Flask routes of the verbs, closed over this worker's guard and body budget."""
    bp = Blueprint("extender", __name__)

    def verb() -> Response:
        body = read_json_body(bodies, guard.settings.max_body_bytes)
        if isinstance(body, Response):
            return body
        payload, g.pod, decision = answer(guard, request.path, body, g.arrived, request.environ.get(CODEC, LOCAL))
        g.verdict = decision.verdict.value
        return Response(payload, mimetype="application/json")

    @bp.post("/filter")
    def filter_nodes() -> Response:
        """A ghost: every node unresolvable, one reason. Otherwise every node passes, in the request's mode."""
        return verb()

    @bp.post("/preempt")
    def preempt() -> Response:
        """A ghost: no node may lose a pod for it. Otherwise every candidate, as meta victims."""
        return verb()

    return bp
