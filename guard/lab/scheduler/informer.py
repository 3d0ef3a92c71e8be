"""An informer: client-go's reflector and store for one resource (tools/cache/reflector.go)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kubernetes.client.exceptions import ApiException

from guard.lab.scheduler.config import Obj, Timings
from guard.lab.scheduler.fit import object_key

log = logging.getLogger(__name__)


class _Gone(Exception):
    """The WATCH answered 410: relist."""


class Informer:
    """A reflector + store for one resource: LIST rv=0, WATCH from its rv, relist on 410."""

    def __init__(
        self,
        kind: str,
        list_fn: Callable[..., Any],
        timings: Timings,
        stop: threading.Event,
        on_replace: Callable[[dict[str, Obj]], None],
        on_event: Callable[[str, Obj], None],
    ) -> None:
        self.kind = kind
        self._list_fn = list_fn
        self._timings = timings
        self._stop = stop
        self._on_replace = on_replace
        self._on_event = on_event
        self.synced = threading.Event()
        self.lists = 0
        self.watches = 0
        self._resp: Any = None
        self._resp_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"informer-{kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def interrupt(self) -> None:
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # noqa: BLE001 - best effort on a dying socket
                pass

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        list_rv = "0"
        while not self._stop.is_set():
            try:
                rv = self._list(list_rv)
            except Exception as e:  # noqa: BLE001 - any failure: retry like the reflector
                log.info("%s informer: LIST failed: %s", self.kind, e)
                self._stop.wait(self._timings.retry_period)
                continue
            self.synced.set()
            list_rv = "0"
            while not self._stop.is_set():
                try:
                    rv = self._watch(rv)
                except _Gone:
                    log.info("%s informer: watch 410 Gone at %s, relisting", self.kind, rv)
                    list_rv = ""  # reflector: relist with a consistent read after 410
                    break
                except Exception as e:  # noqa: BLE001
                    if self._stop.is_set():
                        return
                    log.info("%s informer: WATCH failed: %s", self.kind, e)
                    self._stop.wait(self._timings.retry_period)

    def _list(self, resource_version: str) -> str:
        kwargs: dict[str, Any] = {"_preload_content": False, "_request_timeout": self._timings.request_timeout}
        if resource_version:
            kwargs["resource_version"] = resource_version
        resp = self._list_fn(**kwargs)
        body = json.loads(resp.data)
        self.lists += 1
        items = {}
        for item in body.get("items") or []:
            items[object_key(item)] = item
        self._on_replace(items)
        return str((body.get("metadata") or {}).get("resourceVersion", "0"))

    def _watch(self, rv: str) -> str:
        try:
            resp = self._list_fn(
                watch=True,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=int(self._timings.watch_timeout),
                _preload_content=False,
                _request_timeout=(self._timings.request_timeout, self._timings.watch_timeout + 10),
            )
        except ApiException as e:
            if e.status == 410:
                raise _Gone() from e
            raise
        self.watches += 1
        with self._resp_lock:
            self._resp = resp
        try:
            if self._stop.is_set():
                return rv
            for line in self._lines(resp):
                event = json.loads(line)
                etype = event.get("type")
                obj = event.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if new_rv:
                    rv = str(new_rv)
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(etype, obj)
        finally:
            with self._resp_lock:
                self._resp = None
            resp.close()  # never hand a half-read stream back to the pool
        return rv

    @staticmethod
    def _lines(resp: Any) -> Iterator[bytes]:
        buffer = b""
        if resp.chunked:
            chunks: Iterable[bytes] = resp.stream(amt=None, decode_content=True)
        else:
            chunks = iter(lambda: resp.read1(65536), b"")
        for chunk in chunks:
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    yield line
        if buffer.strip():
            yield buffer
