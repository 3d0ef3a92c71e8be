"""Large verb calls decoded and encoded in helper processes (issue 25, hole 6).

Decoding a 4 MiB ``/filter`` body is one ``orjson.loads`` call that holds the GIL for 12-50 ms
(more on a loaded machine), and encoding its answer another few: while it runs, the worker's event
loop and kube-scheduler's small calls wait (a kept-alive ``/filter`` went to p99 148 ms under four
forged 3.7 MiB bodies at once). A body over :data:`OFFLOAD_BYTES` in kube-scheduler's call shape
therefore goes through a :class:`HelperCodec` (the lane's Codec, guard.http.lane): the body is
written to one of :data:`HELPERS` helper processes (``python -m guard.serving.offload``, started
with the worker at a lower CPU priority, each holding one call at a time), which parses it (guard.core.extender.parse_verb)
and sends back only the pod; the worker checks the pod as for any call (the decision is always the
worker's), then sends the helper the outcome (blocked with a reason, or allowed without the ghost
Nodes it knows) and gets back the answer's bytes (guard.core.extender.verb_reply): the same bytes the
worker would have built.

Bounds: the worker's event loop lets at most :data:`HELPERS` such calls into its pool at once (the
others wait without a thread, guard.serving.connection), so a pool thread never waits for a helper
and a small call never waits for any of it. Every exchange with a helper has the call's deadline (90 %
of ``--request-budget``). A helper that dies or answers out of turn is killed (a fresh one starts at
once) and that call is decoded and encoded in the worker after all: its answer never depends on a
helper (the guard's own error, logged); so is a call that finds its helper still starting (its imports,
in a worker's first seconds), as every call was before helpers. A helper that misses the deadline is killed and replaced too,
but that call gets a 503 with the reason: the machine is overloaded, and decoding in the worker would
put the GIL time back on every other call. A
helper's memory is one decoded body at most (bounded per byte by guard.core.extender.decode).

Wire format, both ways: a 5-byte header (operation, payload length: ``!BI``) and the payload.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from guard.core import extender
from guard.core.extender import ProtocolError
from guard.core.verdict import PodRef

log = logging.getLogger(__name__)

# A verb call whose body is larger than this is decoded and encoded by a helper process.
OFFLOAD_BYTES = 256 * 1024
# Helper processes per worker: at most this many large calls run at once (the machine's cores, at most 2).
HELPERS = max(1, min(2, os.cpu_count() or 1))
# A helper runs at this lower CPU priority (nice): when the CPU is short, the worker's threads (small calls,
# the event loop) go first; a large call's helper gets what is left, within its deadline.
HELPER_NICE = 10
# A helper's exchanges end within this share of the request budget (a helper takes tens of milliseconds for a
# 4 MiB body; the rest of the budget is for writing the answer).
BUDGET_SHARE = 0.9

PARSE, ENCODE, OK, ERROR = 1, 2, 3, 4
# operation, payload length, a count (the candidates an answer dropped as ghost Nodes)
_HEADER = struct.Struct("!BII")


class HelperFailed(Exception):
    """The helper died or answered out of turn: it is replaced, the worker answers the call itself."""


class HelperLate(HelperFailed):
    """The helper missed the call's deadline (the machine is overloaded): it is replaced and the call gets a
    503 with the reason, rather than more work for the worker's GIL."""


class Overloaded(ProtocolError):
    """A large call's helper missed its deadline: 503 with the reason (the caller retries)."""

    status = 503


@dataclass(frozen=True, slots=True)
class HelperArgs:
    """A call's arguments as the worker sees them when a helper holds the decoded body: the pod."""

    pod: PodRef


class Helper:
    """One helper process and its two pipes; one exchange at a time (its owner serialises them)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "guard.serving.offload"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, close_fds=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.out, self.inp = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.out, False)
        os.set_blocking(self.inp, False)
        self.ready = False  # its imports done (it says so once, first thing)

    def is_ready(self) -> bool:
        """Whether the helper has started (read without waiting). Raises HelperFailed if it exited."""
        if not self.ready:
            poll = select.poll()
            poll.register(self.inp, select.POLLIN)
            if not poll.poll(0):
                return False
            kind, _, _ = _HEADER.unpack(self._recv(_HEADER.size, time.monotonic() + 1.0))
            if kind != OK:
                raise HelperFailed(f"started with {kind}")
            self.ready = True
        return True

    def exchange(self, op: int, parts: tuple[bytes, ...], deadline: float) -> tuple[int, bytearray, int]:
        """Send one message (its payload in ``parts``, never joined: a body is megabytes) and read the reply
        (kind, payload, count) before ``deadline`` (time.monotonic). Raises HelperFailed, HelperLate."""
        self._send(_HEADER.pack(op, sum(len(p) for p in parts), 0), deadline)
        for part in parts:
            self._send(part, deadline)
        kind, size, count = _HEADER.unpack(self._recv(_HEADER.size, deadline))
        return kind, self._recv(size, deadline), count

    def _wait(self, fd: int, write: bool, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HelperLate("deadline")
        poll = select.poll()  # (not select: a worker's descriptors go past FD_SETSIZE)
        poll.register(fd, select.POLLOUT if write else select.POLLIN)
        if not poll.poll(left * 1000):
            raise HelperLate("deadline")

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.out, view):]
            except BlockingIOError:
                self._wait(self.out, True, deadline)
            except OSError as e:
                raise HelperFailed(f"write: {e}") from e

    def _recv(self, size: int, deadline: float) -> bytearray:
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            try:
                n = os.readv(self.inp, [view[got:]])
            except BlockingIOError:
                self._wait(self.inp, False, deadline)
                continue
            except OSError as e:
                raise HelperFailed(f"read: {e}") from e
            if not n:
                raise HelperFailed(f"exited ({self.proc.poll()})")
            got += n
        return data

    def close(self) -> None:
        """Stop the helper now (it holds no state worth keeping)."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.proc.wait(timeout=1)
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


class HelperCodec:
    """guard.http.lane.Codec for one large call, on one helper: ``parse`` leaves the decoded body in the
    helper, ``encode`` builds the answer there. On a helper failure the call falls back to the worker's
    own decoding (guard.core.extender, the same bytes)."""

    def __init__(self, helper: Helper | None, deadline: float) -> None:
        self.helper, self.deadline = helper, deadline
        self.body = b""
        self.max_nodes: int | None = None
        self.path = ""

    def parse(self, path: str, body: bytes, max_nodes: int | None) -> Any:
        self.path, self.body, self.max_nodes = path, body, max_nodes
        if self.helper is not None:
            head = orjson.dumps({"path": path, "max_nodes": max_nodes}) + b"\n"
            try:
                kind, reply, _ = self.helper.exchange(PARSE, (head, body), self.deadline)
                if kind == OK:
                    pod = orjson.loads(reply)
                    return HelperArgs(PodRef(namespace=pod["namespace"], name=pod["name"], uid=pod["uid"]))
                if kind == ERROR:
                    raise _protocol_error(reply)
                raise HelperFailed(f"answered {kind} to a parse")
            except HelperFailed as e:
                self._failed(e)
        return extender.parse_verb(path, body, max_nodes)

    def encode(self, args: Any, block_reason: str | None, ghosts: Mapping[str, object]) -> tuple[bytes, int]:
        if isinstance(args, HelperArgs):
            if self.helper is not None:
                plan = orjson.dumps({"reason": block_reason, "ghosts": list(ghosts)})
                try:
                    kind, reply, dropped = self.helper.exchange(ENCODE, (plan,), self.deadline)
                    if kind == OK:
                        return bytes(reply), dropped  # (bytes: a WSGI server takes nothing else)
                    if kind == ERROR:
                        raise _protocol_error(reply)
                    raise HelperFailed(f"answered {kind} to an encode")
                except HelperFailed as e:
                    self._failed(e)
            args = extender.parse_verb(self.path, self.body, self.max_nodes)  # decoded here after all
        return extender.verb_reply(args, block_reason, ghosts)

    def _failed(self, e: HelperFailed) -> None:
        if self.helper is not None:
            self.helper.close()
            self.helper = None
        if isinstance(e, HelperLate):
            _count_failure("late")
            log.warning("the helper process for a large %s call missed its deadline (90%% of --request-budget); "
                        "it is replaced, the call gets a 503", self.path)
            raise Overloaded("the helper process decoding this large call did not finish within --request-budget "
                             "(the guard's machine is overloaded); retry")
        _count_failure("failed")
        log.warning("the helper process for a large %s call failed (%s); the worker answers it itself", self.path, e)


def _count_failure(reason: str) -> None:
    """ghost_guard_offload_helper_failures_total (imported here: the helper process itself never loads the
    metrics, whose multiprocess files belong to the worker)."""
    from guard import metrics

    metrics.labelled(metrics.OFFLOAD_FAILURES, reason).inc()


def _protocol_error(reply: bytes | bytearray) -> ProtocolError:
    doc = orjson.loads(reply)
    error = ProtocolError(doc["error"])
    error.status = int(doc["status"])
    return error


class Offload:
    """The worker's helpers: :meth:`codec` lends one to a large call. Started with the worker's loop,
    stopped with it (:meth:`close`); a failed helper is replaced when it is next lent."""

    def __init__(self, count: int = HELPERS) -> None:
        self.count = count
        self._free: list[Helper | None] = [self._start() for _ in range(count)]
        self._cond = threading.Condition()
        self._closed = False

    @staticmethod
    def _start() -> Helper | None:
        try:
            return Helper()
        except OSError as e:
            _count_failure("start-failed")
            log.warning("could not start a helper process for large calls (%s); the worker decodes them itself", e)
            return None

    @contextlib.contextmanager
    def codec(self, deadline: float) -> Iterator[HelperCodec]:
        """A codec on a free helper until the block ends (the worker's own decoding if none is free by
        ``deadline``: the event loop lets no more large calls in than there are helpers, so that is an
        error of the guard's)."""
        with self._cond:
            while not self._free and not self._closed and deadline > time.monotonic():
                self._cond.wait(deadline - time.monotonic())
            took = bool(self._free) and not self._closed
            helper = self._free.pop() if took else None
        if took and helper is None:  # none could be started last time: try again
            helper = self._start()
        use = helper
        if helper is not None:
            try:
                if not helper.is_ready():  # still starting (a worker's first seconds): this call is decoded here
                    use = None
            except HelperFailed as e:
                _count_failure("failed")
                log.warning("a helper process for large calls exited (%s); replaced", e)
                helper.close()
                helper = use = None
        codec = HelperCodec(use, deadline)
        try:
            yield codec
        finally:
            if took:
                back = codec.helper if use is not None else helper
                with self._cond:
                    if not self._closed:  # a failed helper is replaced at once (it starts while unused)
                        self._free.append(back if back is not None else self._start())
                        self._cond.notify()
                    elif back is not None:
                        back.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            helpers, self._free = self._free, []
            self._cond.notify_all()
        for helper in helpers:
            if helper is not None:
                helper.close()


# --- the helper process ------------------------------------------------------------------------------


def _read_exactly(fd: int, size: int) -> bytes | None:
    parts, got = [], 0
    while got < size:
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def serve_helper(inp: int = 0, out: int = 1) -> None:
    """The helper's loop: one call's parse, then its encode, on stdin/stdout, until stdin closes (the worker
    stopped or died). It imports only guard.core and orjson."""
    with contextlib.suppress(OSError):
        os.nice(HELPER_NICE)
    _write_all(out, _HEADER.pack(OK, 0, 0))  # started: imports done
    args: Any = None
    while True:
        header = _read_exactly(inp, _HEADER.size)
        if header is None:
            return
        op, size, _ = _HEADER.unpack(header)
        count = 0
        payload = _read_exactly(inp, size)
        if payload is None:
            return
        try:
            if op == PARSE:
                args = None
                head, _, body = payload.partition(b"\n")
                meta = orjson.loads(head)
                del payload
                args = extender.parse_verb(meta["path"], body, meta["max_nodes"])
                reply = orjson.dumps({"namespace": args.pod.namespace, "name": args.pod.name, "uid": args.pod.uid})
            elif op == ENCODE and args is not None:
                plan = orjson.loads(payload)
                reply, count = extender.verb_reply(args, plan["reason"], dict.fromkeys(plan["ghosts"]))
                args = None
            else:
                raise ProtocolError(f"operation {op} out of turn")
            kind = OK
        except ProtocolError as e:
            args = None
            kind, reply = ERROR, orjson.dumps({"status": e.status, "error": str(e)})
        _write_all(out, _HEADER.pack(kind, len(reply), count))
        _write_all(out, reply)


if __name__ == "__main__":
    serve_helper()
