"""The gunicorn worker class: the one place that touches gunicorn's internals.

:class:`GuardWorker` subclasses gunicorn 27's ``gthread`` worker (``ThreadWorker``) for its process
model, thread pool, arbiter heartbeat, signals and graceful shutdown, and hands every connection to
:class:`guard.serving.connection.ConnectionLoop` (the state machine, deadlines and limits). The loop
sees gunicorn only through :class:`~guard.serving.connection.Host`, which this class implements on:

- ``self.poller`` (gthread's selector: the loop polls it, the listeners are registered in it by
  ``set_accept_enabled``),
- ``self.method_queue`` (gthread's self-pipe queue of callbacks: how another thread wakes the loop),
- ``self.tpool`` (gthread's thread pool),
- ``self.nr_conns`` (what gthread's ``is_parent_alive``/accept bookkeeping reads),
- ``http.get_parser`` and ``wsgi.create`` (gunicorn's request parser and WSGI environ, for every
  request that is not kube-scheduler's exact call shape) and ``handle_error`` (its 4xx/500 replies).

``method_queue``, ``poller`` and ``tpool`` are gthread 27's attributes (not an API), which is why
pyproject.toml pins ``gunicorn<28``: a newer gunicorn needs only this module checked.
"""

from __future__ import annotations

import selectors
from concurrent.futures import Future
from typing import Any, Callable

from gunicorn import http
from gunicorn.http import wsgi
from gunicorn.workers.gthread import ThreadWorker

from guard.http.lane import CODEC, DIRECT_LANE, PEER_CERT
from guard.serving.connection import Conn, ConnectionLoop


class _Capture:
    """The socket a pool thread's gunicorn Response writes to: the reply is collected, never sent from the thread."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def sendall(self, data) -> None:
        self.parts.append(data if type(data) is bytes else bytes(data))

    def send(self, data) -> int:
        self.sendall(data)
        return len(data)

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


class GuardWorker(ThreadWorker):
    """gthread with an event loop (ConnectionLoop) that owns every connection until its request is complete."""

    def init_process(self) -> None:
        self.settings = self.app.settings
        self.loop: ConnectionLoop | None = None
        _raise_open_files_limit(4 * self.settings.max_connections + 256)
        super().init_process()  # loads the app (load_wsgi), builds poller, method_queue, tpool, then run()

    # --- Host, on gthread's internals ------------------------------------------------------------------

    @property
    def selector(self):
        return self.poller

    @property
    def graceful_timeout(self) -> float:
        return float(self.cfg.graceful_timeout)

    def defer(self, fn: Callable[..., None], *args: Any) -> None:
        self.method_queue.defer(fn, *args)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self.tpool.submit(fn, *args)

    def accepting(self, on: bool) -> None:
        self.set_accept_enabled(on)

    def connections(self, count: int) -> None:
        self.nr_conns = count

    def heartbeat(self) -> None:
        self.notify()

    def parent_alive(self) -> bool:
        return bool(self.is_parent_alive())

    def serve_wsgi(self, conn: Conn, request: bytes, codec: Any) -> tuple[bytes, bool]:
        """In a pool thread: parse the complete request from memory with gunicorn's parser, run the
        WSGI app, collect the reply."""
        out = _Capture()
        req = None
        try:
            parser = http.get_parser(self.cfg, iter([request]), conn.addr)
            req = next(parser)
            resp, environ = wsgi.create(req, out, conn.addr, conn.server, self.cfg)
            environ["wsgi.multithread"] = True
            environ[PEER_CERT] = conn.peer_cert
            if codec is not None:
                environ[CODEC] = codec
            if not self.alive:
                resp.force_close()
            respiter = self.wsgi(environ, resp.start_response)
            try:
                for item in respiter:
                    resp.write(item)
                resp.close()
            finally:
                if hasattr(respiter, "close"):
                    respiter.close()
            return out.getvalue(), not resp.should_close()
        except StopIteration:
            return b"", False
        except Exception as e:  # gunicorn's parser errors get its 4xx; anything else a 500
            if out.parts:  # the reply had started: nothing sane can follow it
                self.log.exception("error after the reply started")
                return out.getvalue(), False
            self.handle_error(req, out, conn.addr, e)
            return out.getvalue(), False

    # --- gthread's entry points --------------------------------------------------------------------------

    def accept(self, listener) -> None:
        """gthread registers this as its listeners' ready callback (set_accept_enabled)."""
        assert self.loop is not None
        self.loop.accept(listener)

    def run(self) -> None:
        lane = getattr(self.wsgi, "extensions", {}).get(DIRECT_LANE)
        self.loop = ConnectionLoop(self, self.settings, getattr(self.app, "tls", None), lane)
        self.poller.register(self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks)
        try:
            self.loop.run()
        finally:
            self.tpool.shutdown(wait=False)
            self.poller.close()
            self.method_queue.close()
            for s in self.sockets:
                s.close()


def _raise_open_files_limit(wanted: int) -> None:
    """Lift the soft open-files limit towards ``wanted`` (never above the hard limit): each connection is a file."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
