"""What every endpoint shares about one request and its reply, in both lanes (FastLane and Flask):
the body's room in the worker's BodyBudget, reading a JSON body within ``--max-body-bytes``,
JSON replies and errors. The request metrics and access-log line are guard.http.filter's
(``record_request``), where the verb calls are answered: one file fewer on their path.

The routes (filter.py, binding.py, probes.py) and the factory (app.py) import this module;
it imports none of them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson
from flask import Response, g, request

from guard.core.extender import ProtocolError
from guard.core.settings import Settings

# Bodies up to this size are answered without taking room in the worker's BodyBudget.
SMALL_BODY_BYTES = 256 * 1024


class Overloaded(ProtocolError):
    """Too many large bodies are being answered at once: 503 with the reason (the caller retries)."""

    status = 503


class BodyBudget:
    """Memory per worker: requests with a body over ``small`` bytes are answered only while the
    bytes of all such bodies in flight stay within ``limit``; one waits at most ``wait`` seconds
    for room, else 503 before its body is read.

    Room is taken before the body is read and given back once the reply is written, so the raw
    body, its decoded document (bounded per byte by guard.core.extender.decode) and the reply are all
    covered: about ``threads x small + limit`` bytes of request at once (docs/RELIABILITY.md).
    kube-scheduler's names-mode bodies up to ``small`` never wait.
    """

    def __init__(self, limit: int, *, small: int, wait: float) -> None:
        self.limit, self.small, self.wait = limit, small, wait
        self._used = 0
        self._cond = threading.Condition()

    @classmethod
    def for_settings(cls, settings: Settings) -> BodyBudget:
        """At most two of the largest accepted bodies (--max-body-bytes) in flight, waiting at most
        1 s (half the request budget when that is shorter)."""
        return cls(2 * settings.max_body_bytes, small=min(SMALL_BODY_BYTES, settings.max_body_bytes),
                   wait=min(1.0, settings.request_budget / 2))

    def acquire(self, size: int) -> int:
        """Room for a body of ``size`` bytes: the bytes taken (0 for a small body). Raises Overloaded."""
        if size <= self.small:
            return 0
        size = min(size, self.limit)
        deadline = time.monotonic() + self.wait
        with self._cond:
            while self._used + size > self.limit:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Overloaded(f"too many large requests at once ({self._used} bytes of bodies over "
                                     f"{self.small} bytes in flight, at most {self.limit}); retry")
                self._cond.wait(remaining)
            self._used += size
        return size

    def release(self, taken: int) -> None:
        if taken:
            with self._cond:
                self._used -= taken
                self._cond.notify_all()


def acquire_room(bodies: BodyBudget, stream: Any, length: int) -> int:
    """Room in the worker's BodyBudget for a body of ``length`` bytes (before it is read).

    Without room, the body (``stream``, unless None) is read and dropped in 64 KiB pieces, so the
    client reads the 503 and its reason instead of a reset connection; raises Overloaded.
    """
    try:
        return bodies.acquire(length)
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


def read_json_body(bodies: BodyBudget, limit: int) -> bytes | Response:
    """The Flask request's body, or an error reply: 415 unless JSON, 413 over ``limit`` (--max-body-bytes).

    With a Content-Length, an oversized body is refused before it is read (and read past,
    unkept, up to twice the limit, so that the client gets the reply). A chunked body has
    none: it is read up to one byte past the limit, so an oversized one is refused instead
    of being cut at the limit and parsed.
    """
    if request.mimetype != "application/json":
        return json_error(415, f"Content-Type must be application/json, got {request.mimetype or 'none'!r}")
    stream = request.environ["wsgi.input"]
    if request.content_length is not None and request.content_length > limit:
        if request.content_length <= 2 * limit:  # read past, unkept, so that the client gets the reason
            drain(stream, request.content_length)
        return json_error(413, f"request body of {request.content_length} bytes is larger than the limit "
                               f"({limit} bytes, --max-body-bytes)")
    # Room in the worker's BodyBudget before reading (a chunked body may be as large as the limit);
    # given back when the reply is written (guard.http.app, after_request).
    g.body_room = acquire_room(bodies, stream if request.content_length is not None else None,
                               request.content_length if request.content_length is not None else limit)
    if request.content_length is not None:
        return request.get_data(cache=False)
    body = stream.read(limit + 1)
    if len(body) > limit:
        del body
        drain(stream, 2 * limit)  # so that the connection stays usable (gunicorn drops it past 64 KiB unread)
        return json_error(413, f"request body larger than the limit ({limit} bytes, --max-body-bytes)")
    return body


def json_response(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status=status, mimetype="application/json")


def json_error(status: int, reason: str) -> Response:
    return json_response({"error": reason}, status)
