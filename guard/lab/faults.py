"""Per-replica fault injection: request faults, dropped DELETE (or creation) events, a frozen watch.

Used through ``ApiserverReplica.faults`` (Python) or the replica's ``/lab/faults`` admin
endpoint (JSON). Every method is thread-safe.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

ACTIONS = ("latency", "status", "hang", "cut", "late")


class FaultError(ValueError):
    """A fault definition that makes no sense (the admin endpoint answers it with 400)."""


@dataclass
class FaultRule:
    """A request fault: requests whose method, path and raw query string (regexes, full match) match it
    are delayed, failed, hung or cut (``query="resourceVersion=0.*"``; ``query=""`` only requests without one).

    ``latency``: served after ``seconds``, or as soon as the rule is removed or the faults cleared
    (a slow apiserver that recovers). ``hang``: no answer; the connection is closed when ``seconds``
    pass or the rule goes. ``cut``: the answer's status, headers (its whole ``Content-Length``) and the
    first half of its body, then the connection closes (a read broken mid-body). ``late``: served (a write
    happens), its answer held back ``seconds`` or until the rule goes (a client that gives up or is
    interrupted while etcd already has the write)."""

    id: int
    action: str
    method: str | None = None
    path: str | None = None
    status: int | None = None
    seconds: float | None = None
    count: int | None = None  # how many more requests it applies to; None: until removed
    hits: int = 0
    query: str | None = None
    _regex: re.Pattern[str] | None = field(default=None, repr=False, compare=False)
    _query_regex: re.Pattern[str] | None = field(default=None, repr=False, compare=False)

    def matches(self, method: str, path: str, query: str = "") -> bool:
        if self.method and self.method != method:
            return False
        if self._query_regex is not None and self._query_regex.fullmatch(query) is None:
            return False
        return self._regex is None or self._regex.fullmatch(path) is not None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "action": self.action, "method": self.method, "path": self.path, "query": self.query,
                "status": self.status, "seconds": self.seconds, "count": self.count, "hits": self.hits}


@dataclass
class DropRule:
    """Drop watch events of matching objects from this replica's cache; the watch flows on.

    ``events="deletes"`` (the ghost incident): the events that would tell the
    cache an object is going away. Both the update that sets
    ``deletionTimestamp`` and the DELETE are dropped (a cache that missed only
    the DELETE holds a terminating pod, which the scheduler skips; the incident
    needs both missed: deleting a pod writes twice, an update setting
    ``deletionTimestamp`` then the DELETE, as seen on a real v1.36 control
    plane). ``count`` counts DELETEs.

    ``events="creates"`` (a missing pod): the etcd PUT that created the key
    (create_revision == mod_revision, which k8s.io/apiserver storage/etcd3
    turns into an ADDED) and nothing else. A later write to the same key still
    reaches the cache, as in the real watch cache: watch_cache.go processEvent
    finds no previous object for the key (no PrevObject) and stores the new
    one, and cache_watcher.go convertToWatchEvent turns an event whose current
    object passes a watcher's filter and whose PrevObject is nil into an ADDED
    for that watcher. So a pod whose creation was lost stays missing only until
    it is written again (a status update, a touch). ``count`` counts creations.

    Either way the cache's resourceVersion still advances past the dropped events.
    """

    id: int
    resource: str = "pods"
    namespace: str | None = None
    name: str | None = None
    count: int | None = None  # how many more DELETEs (or creations) to drop; None: all
    dropped: int = 0
    events: str = "deletes"  # or "creates"

    def matches(self, resource: str, namespace: str, name: str) -> bool:
        return (resource == self.resource and (self.namespace is None or self.namespace == namespace)
                and (self.name is None or self.name == name))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "resource": self.resource, "namespace": self.namespace, "name": self.name,
                "count": self.count, "dropped": self.dropped}


@dataclass(frozen=True)
class DroppedEvent:
    type: str  # "MODIFIED" (deletionTimestamp set), "DELETED", or "ADDED" (a creation, drop_creates)
    resource: str
    namespace: str
    name: str
    uid: str
    resource_version: int


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._rules: list[FaultRule] = []
        self._drops: list[DropRule] = []
        self._frozen = False
        self._generation = 0  # bumped by clear()/remove(): releases hung requests
        self.dropped: list[DroppedEvent] = []

    # --- request faults -----------------------------------------------------

    def add(self, action: str, *, method: str | None = None, path: str | None = None, status: int | None = None,
            seconds: float | None = None, count: int | None = None, query: str | None = None) -> FaultRule:
        """Add a request fault. ``action``: "latency" (``seconds``; a removal lets delayed requests go at once),
        "status" (``status``, e.g. 429/500), "hang", "cut" (half the body sent, then the connection closed),
        "late" (``seconds``; served, the answer held back that long or until the rule goes)."""
        if action not in ACTIONS:
            raise FaultError(f"action must be one of {', '.join(ACTIONS)}, not {action!r}")
        if action in ("latency", "late") and (seconds is None or seconds < 0):
            raise FaultError(f"{action} needs seconds >= 0")
        if action == "status" and (status is None or not 400 <= int(status) <= 599):
            raise FaultError("status needs a status code between 400 and 599")
        if count is not None and count < 1:
            raise FaultError("count must be >= 1")
        try:
            regex = re.compile(path) if path else None
        except re.error as e:
            raise FaultError(f"path is not a valid regex: {e}") from e
        try:
            query_regex = re.compile(query) if query is not None else None
        except re.error as e:
            raise FaultError(f"query is not a valid regex: {e}") from e
        rule = FaultRule(0, action, method.upper() if method else None, path, int(status) if status else None,
                         seconds, count, query=query, _regex=regex, _query_regex=query_regex)
        with self._lock:
            rule.id = next(self._ids)
            self._rules.append(rule)
        return rule

    def remove(self, rule_id: int) -> bool:
        with self._lock:
            before = len(self._rules) + len(self._drops)
            self._rules = [r for r in self._rules if r.id != rule_id]
            self._drops = [d for d in self._drops if d.id != rule_id]
            self._generation += 1
            self._lock.notify_all()
            return before != len(self._rules) + len(self._drops)

    def match(self, method: str, path: str, query: str = "") -> FaultRule | None:
        """The first rule matching this request (its count consumed), or None."""
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, path, query):
                    rule.hits += 1
                    _spend(self._rules, rule)
                    return rule
        return None

    def hang(self, rule: FaultRule, stopping: threading.Event) -> None:
        """Block until a fault is removed or cleared, ``seconds`` pass, or the replica stops (a hung or delayed request)."""
        deadline = time.monotonic() + rule.seconds if rule.seconds is not None else None
        with self._lock:
            gen = self._generation
            while not stopping.is_set() and self._generation == gen:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._lock.wait(0.1 if left is None else min(left, 0.1))

    # --- watch faults -------------------------------------------------------

    def drop_deletes(self, namespace: str | None = None, name: str | None = None, *, resource: str = "pods",
                     count: int | None = None) -> DropRule:
        """The incident: this replica's cache misses the deletion of matching objects."""
        if count is not None and count < 1:
            raise FaultError("count must be >= 1")
        with self._lock:
            rule = DropRule(next(self._ids), resource, namespace, name, count)
            self._drops.append(rule)
            return rule

    def drop_creates(self, namespace: str | None = None, name: str | None = None, *, resource: str = "pods",
                     count: int | None = None) -> DropRule:
        """A lost creation: this replica's cache misses the creation of matching objects (the next
        write to one of them reaches it, see DropRule)."""
        if count is not None and count < 1:
            raise FaultError("count must be >= 1")
        with self._lock:
            rule = DropRule(next(self._ids), resource, namespace, name, count, events="creates")
            self._drops.append(rule)
            return rule

    def should_drop(self, kind: str, resource: str, namespace: str, name: str, has_deletion_timestamp: bool,
                    had_deletion_timestamp: bool, *, created: bool = False) -> bool:
        """Called by the watch cache for each event; True means the cache skips it. ``created``: the
        event is the etcd PUT that created the key."""
        if created:
            with self._lock:
                for rule in self._drops:
                    if rule.events == "creates" and rule.matches(resource, namespace, name):
                        rule.dropped += 1
                        _spend(self._drops, rule)
                        return True
        deleting = kind == "DELETED" or (kind == "MODIFIED" and has_deletion_timestamp and not had_deletion_timestamp)
        if not deleting:
            return False
        with self._lock:
            for rule in self._drops:
                if rule.events == "deletes" and rule.matches(resource, namespace, name):
                    if kind == "DELETED":
                        rule.dropped += 1
                        _spend(self._drops, rule)
                    return True
        return False

    def record_drop(self, event: DroppedEvent) -> None:
        with self._lock:
            self.dropped.append(event)

    def freeze_watch(self) -> None:
        """Stop the cache applying watch events (its resourceVersion stops too) until unfrozen or cleared."""
        with self._lock:
            self._frozen = True

    def unfreeze_watch(self) -> None:
        with self._lock:
            self._frozen = False
            self._lock.notify_all()

    @property
    def watch_frozen(self) -> bool:
        return self._frozen

    def wait_unfrozen(self, stopping: threading.Event) -> None:
        with self._lock:
            while self._frozen and not stopping.is_set():
                self._lock.wait(0.1)

    def clear(self) -> None:
        """Remove every fault and drop rule, unfreeze the watch, release hung requests."""
        with self._lock:
            self._rules.clear()
            self._drops.clear()
            self._frozen = False
            self._generation += 1
            self._lock.notify_all()

    def rules(self) -> list[FaultRule]:
        with self._lock:
            return list(self._rules)

    def drop_rules(self) -> list[DropRule]:
        with self._lock:
            return list(self._drops)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rules": [r.to_dict() for r in self._rules],
                "dropDeletes": [d.to_dict() for d in self._drops if d.events == "deletes"],
                "dropCreates": [d.to_dict() for d in self._drops if d.events == "creates"],
                "watchFrozen": self._frozen,
                "dropped": [{"type": e.type, "resource": e.resource, "namespace": e.namespace, "name": e.name,
                             "uid": e.uid, "resourceVersion": str(e.resource_version)} for e in self.dropped],
            }

    def apply_json(self, body: Any) -> dict[str, Any]:
        """One admin request: ``{"action": "latency"|"status"|"hang"|"cut"|"late"|"drop-deletes"|"drop-creates"|"freeze-watch"|"unfreeze-watch", ...}``."""
        if not isinstance(body, dict):
            raise FaultError("body must be a JSON object")
        action = body.get("action")
        allowed = {"action", "method", "path", "query", "status", "seconds", "count", "namespace", "name", "resource"}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise FaultError(f"unknown field(s): {', '.join(unknown)}")

        def opt(key: str, typ: type | tuple[type, ...]) -> Any:
            v = body.get(key)
            if v is not None and (not isinstance(v, typ) or isinstance(v, bool)):
                raise FaultError(f"{key} has the wrong type")
            return v

        if action == "drop-deletes":
            return self.drop_deletes(opt("namespace", str), opt("name", str), resource=opt("resource", str) or "pods",
                                     count=opt("count", int)).to_dict()
        if action == "drop-creates":
            return self.drop_creates(opt("namespace", str), opt("name", str), resource=opt("resource", str) or "pods",
                                     count=opt("count", int)).to_dict()
        if action == "freeze-watch":
            self.freeze_watch()
            return {"watchFrozen": True}
        if action == "unfreeze-watch":
            self.unfreeze_watch()
            return {"watchFrozen": False}
        if not isinstance(action, str):
            raise FaultError("action is required")
        secs = opt("seconds", (int, float))
        return self.add(action, method=opt("method", str), path=opt("path", str), status=opt("status", int),
                        seconds=float(secs) if secs is not None else None, count=opt("count", int),
                        query=opt("query", str)).to_dict()


def _spend(rules: list[Any], rule: FaultRule | DropRule) -> None:
    """One use of a counted rule; the last one removes it from ``rules`` (the caller holds the lock and
    returns right after: the list is not iterated further)."""
    if rule.count is not None:
        rule.count -= 1
        if rule.count <= 0:
            rules.remove(rule)
