"""One replica's watch cache, built like the apiserver's cacher.

Mirrors k8s.io/apiserver/pkg/storage/cacher (cacher.go, watch_cache.go): an
initial LIST from etcd, then an etcd WATCH from the next revision; the cache's
resourceVersion advances with every event and with etcd progress
notifications; a bounded event history serves watches that resume from a
resourceVersion, older ones get 410 Expired. The lab keeps one cache over all of
``/registry/`` (the real apiserver has one per resource) so one resourceVersion
covers everything a replica serves.
"""

from __future__ import annotations

import collections
import copy
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from guard.lab.api import Obj, Resource, gone, resource_for_key, split_key
from guard.lab.faults import DroppedEvent, Faults
from guard.lab.store import Compacted, EtcdClient, EtcdUnavailable, EtcdWatch

log = logging.getLogger(__name__)

PREFIX = "/registry/"

# (type, object) pairs; named out here because inside WatchCache `list` is its LIST method.
EventList = list[tuple[str, Obj]]


@dataclass(frozen=True)
class CacheEvent:
    type: str  # ADDED, MODIFIED, DELETED
    key: str
    obj: Obj  # for DELETED: the last state, resourceVersion = the deletion's revision
    prev: Obj | None
    rv: int


def decode(value: bytes, rv: int) -> Obj:
    obj = orjson.loads(value)
    obj.setdefault("metadata", {})["resourceVersion"] = str(rv)
    return obj


class CacheWatcher:
    """A watch on the cache: events for keys under ``prefix`` that the ``matches`` predicate selects."""

    def __init__(self, prefix: str, matches: Callable[[Obj], bool]) -> None:
        self.prefix = prefix
        self.matches = matches
        self._q: collections.deque[tuple[str, Obj]] = collections.deque()
        self._cond = threading.Condition()
        self.closed = False

    def offer(self, ev: CacheEvent) -> None:
        """Translate a cache event for this watcher, as cacheWatcher.convertToWatchEvent does
        (k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go).

        The event's type from etcd does not decide what the watcher sees; the filter does, applied to
        the new object (never for a delete) and to the object the cache held before (``prev``):
        both pass -> MODIFIED; only the new one -> ADDED; only the old one -> DELETED carrying the
        *old* object at the event's resourceVersion. So a pod created under the name of a ghost
        the cache still holds reaches a watcher that selected the ghost as MODIFIED, and its
        delete as DELETED; with the unscheduled-pods selector (``spec.nodeName=``) a pending pod
        replacing a bound copy is ADDED and a bound pod replacing a pending copy is DELETED.
        """
        if not ev.key.startswith(self.prefix):
            return
        cur_passes = ev.type != "DELETED" and self.matches(ev.obj)
        old_passes = ev.prev is not None and self.matches(ev.prev)
        if cur_passes and old_passes:
            self._put("MODIFIED", ev.obj)
        elif cur_passes:
            self._put("ADDED", ev.obj)
        elif old_passes:
            assert ev.prev is not None  # old_passes: there was a previous object
            old = copy.deepcopy(ev.prev)
            old.setdefault("metadata", {})["resourceVersion"] = str(ev.rv)
            self._put("DELETED", old)

    def _put(self, typ: str, obj: Obj) -> None:
        with self._cond:
            self._q.append((typ, obj))
            self._cond.notify_all()

    def get(self, timeout: float) -> tuple[str, Obj] | None:
        with self._cond:
            if not self._q and not self.closed:
                self._cond.wait(timeout)
            return self._q.popleft() if self._q else None

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class WatchCache:
    def __init__(self, client: EtcdClient, faults: Faults, history_size: int = 10000, name: str = "") -> None:
        self._client = client
        self._faults = faults
        self._name = name
        self._cond = threading.Condition()
        self._objects: dict[str, Obj] = {}
        self._history: collections.deque[CacheEvent] = collections.deque(maxlen=history_size)
        self._history_start = 0  # watches from any rv >= this are served from history
        self._watchers: set[CacheWatcher] = set()
        self.rv = 0
        self.ready = threading.Event()
        self._stopping = threading.Event()
        self._etcd_watch: EtcdWatch | None = None
        self._thread: threading.Thread | None = None
        self.relists = 0

    # --- lifecycle ----------------------------------------------------------

    def start(self, wait: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name=f"watch-cache-{self._name}", daemon=True)
        self._thread.start()
        self.ready.wait(wait)

    def stop(self) -> None:
        self._stopping.set()
        w = self._etcd_watch
        if w is not None:
            w.cancel()
        with self._cond:
            for watcher in self._watchers:
                watcher.close()
            self._watchers.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5)

    def _relist(self) -> None:
        kvs, rev = self._client.range_prefix(PREFIX)
        with self._cond:
            self._objects = {kv.key: decode(kv.value, kv.mod_revision) for kv in kvs if resource_for_key(kv.key)}
            self._history.clear()
            self._history_start = rev
            self.rv = rev
            for watcher in self._watchers:  # watchers can't follow a replaced cache: they must re-watch
                watcher.close()
            self._watchers.clear()
            self._cond.notify_all()
        self.relists += 1
        self.ready.set()

    def _run(self) -> None:
        need_list = True
        backoff = 0.05
        while not self._stopping.is_set():
            try:
                if need_list:
                    self._relist()
                    need_list = False
                self._etcd_watch = self._client.watch(PREFIX, self.rv + 1)
                if self._stopping.is_set():
                    break
                backoff = 0.05
                while not self._stopping.is_set():
                    events, rev = self._etcd_watch.next_batch()
                    self._faults.wait_unfrozen(self._stopping)
                    if self._stopping.is_set():
                        break
                    self._apply(events, rev)
            except Compacted:
                log.info("watch cache %s: compacted, re-listing", self._name)
                need_list = True
            except (EtcdUnavailable, OSError, ValueError) as e:
                if self._stopping.is_set():
                    break
                log.debug("watch cache %s: %s; retrying", self._name, e)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                if self._etcd_watch is not None:
                    self._etcd_watch.cancel()
                    self._etcd_watch = None

    # --- applying events ----------------------------------------------------

    def _apply(self, events: list, header_rev: int) -> None:
        """Apply etcd watch events as watchCache.processEvent does (cacher/watch_cache.go).

        The store is keyed by the object's key: an event for a key the cache already holds
        *replaces* what it holds, whatever the UID (the previous element becomes the event's
        PrevObject), and a DELETE removes the key. So a new pod written under a ghost's name
        (another UID) drops the ghost from a cache whose watch still flows, and the delete of
        that pod empties the key; only a cache that receives no events (a frozen watch) keeps it.
        """
        with self._cond:
            for e in events:
                if e.mod_revision < self.rv:
                    continue
                r = resource_for_key(e.key)
                if r is None:
                    self.rv = e.mod_revision
                    continue
                prev = self._objects.get(e.key)
                if e.type == "DELETE":
                    if prev is None:
                        self.rv = e.mod_revision
                        continue
                    obj = copy.deepcopy(prev)
                    obj["metadata"]["resourceVersion"] = str(e.mod_revision)
                    typ = "DELETED"
                else:
                    try:
                        obj = decode(e.value, e.mod_revision)
                    except ValueError:
                        self.rv = e.mod_revision
                        continue
                    typ = "MODIFIED" if prev is not None else "ADDED"
                if self._dropped(typ, r, e.key, obj, prev, created=e.type != "DELETE" and e.create_revision == e.mod_revision):
                    self.rv = e.mod_revision
                    continue
                if typ == "DELETED":
                    del self._objects[e.key]
                else:
                    self._objects[e.key] = obj
                ev = CacheEvent(typ, e.key, obj, prev, e.mod_revision)
                if len(self._history) == self._history.maxlen:
                    self._history_start = self._history[0].rv
                self._history.append(ev)
                for watcher in list(self._watchers):
                    watcher.offer(ev)
                self.rv = e.mod_revision
            if not events and header_rev > self.rv:
                self.rv = header_rev  # progress notification
            self._cond.notify_all()

    def _dropped(self, typ: str, r: Resource, key: str, obj: Obj, prev: Obj | None, *, created: bool = False) -> bool:
        ns, name = split_key(r, key)
        has = bool(obj.get("metadata", {}).get("deletionTimestamp"))
        had = bool(prev and prev.get("metadata", {}).get("deletionTimestamp"))
        if not self._faults.should_drop(typ, r.plural, ns, name, has, had, created=created):
            return False
        self._faults.record_drop(DroppedEvent("ADDED" if created else typ, r.plural, ns, name,
                                              str(obj.get("metadata", {}).get("uid", "")),
                                              int(obj["metadata"]["resourceVersion"])))
        return True

    # --- reads --------------------------------------------------------------

    def wait_for(self, rev: int, timeout: float) -> bool:
        """Wait until the cache's resourceVersion reaches ``rev`` (waitUntilFreshAndBlock)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.rv < rev:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping.is_set():
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def get(self, key: str) -> tuple[Obj | None, int]:
        with self._cond:
            obj = self._objects.get(key)
            return (copy.deepcopy(obj) if obj is not None else None), self.rv

    def list(self, prefix: str, matches: Callable[[Obj], bool]) -> tuple[list[Obj], int]:
        with self._cond:
            items = [copy.deepcopy(o) for k, o in sorted(self._objects.items()) if k.startswith(prefix) and matches(o)]
            return items, self.rv

    def watch(self, prefix: str, matches: Callable[[Obj], bool], rv: int | None) -> tuple[CacheWatcher, EventList]:
        """Register a watcher; returns it with the events it must send first.

        ``rv`` None (or 0): synthetic ADDED events for the current state, then live
        events. Else: events after ``rv`` from history; 410 Expired if history
        doesn't reach back that far.
        """
        w = CacheWatcher(prefix, matches)
        with self._cond:
            if rv is None:
                initial = [("ADDED", copy.deepcopy(o)) for k, o in sorted(self._objects.items())
                           if k.startswith(prefix) and matches(o)]
            else:
                if rv < self._history_start:
                    raise gone(f"too old resource version: {rv} ({self._history_start})")
                tmp = CacheWatcher(prefix, matches)
                for ev in self._history:
                    if ev.rv > rv:
                        tmp.offer(ev)
                initial = list(tmp._q)
            self._watchers.add(w)
        return w, initial

    def forget(self, w: CacheWatcher) -> None:
        with self._cond:
            self._watchers.discard(w)
        w.close()

    @property
    def watchers(self) -> int:
        """Watchers registered now (a watch request that has started streaming)."""
        with self._cond:
            return len(self._watchers)

    @property
    def history_start(self) -> int:
        """The oldest resourceVersion a watch can resume from (older: 410 Expired)."""
        with self._cond:
            return self._history_start

    @property
    def size(self) -> int:
        with self._cond:
            return len(self._objects)
