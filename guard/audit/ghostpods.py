"""The audit store in the Kubernetes API: one GhostPod object per blocked ghost pod.

``--audit-store kubernetes``. The objects (kube-ghost-guard.io/v1alpha1, manifests/crd)
live in the blocked pod's namespace, so they outlive the guard's pods, every guard
replica writes the same ones, and anyone with ``view`` on a namespace reads them with
``kubectl get ghostpods``.

**Identity.** The object's name is derived from the pod's identity (namespace, name,
UID): :func:`object_name`. Two guard replicas converge on one object; a forged call
that names a live pod's UID under another name gets an object of its own and can never
hide the real pod's record.

**Writes never hold a verdict.** ``record_block``/``record_probe``/``retract``/
``record_heal`` only append an operation to the identity's pending entry in memory and
return. Background writers apply the pending operations to the object:

    create (spec; the status subresource ignores a status sent with it)
      -> 409 AlreadyExists: another replica created it: GET it
    apply the operations to its status -> merge-patch ghostpods/status with the
      object's resourceVersion -> 409 Conflict: GET it again and re-apply (bounded)

so concurrent replicas never lose each other's counts. Writes are coalesced per
identity: one identity is written at most every ``MIN_WRITE_INTERVAL`` seconds
(a ghost the scheduler retries in a loop costs one write per interval, not one per
attempt) and all writes together at most ``write_qps`` per second. While the apiserver
does not answer (or answers 429/5xx, or the CRD is not installed yet, or RBAC refuses),
the operations stay pending and are retried with backoff; at most ``queue_size``
identities wait at once, beyond which a new identity is dropped *and counted*
(``ghost_guard_audit_records_dropped_total``) and the store's health says so.
``close()`` (at exit) writes what is pending, within a deadline.

A write that reached the apiserver but whose answer was lost (a timeout) is applied
again: ``timesBlocked`` may then count those blocks twice. Nothing else is counted.

**Retention.** ``prune`` deletes objects last seen before ``now - max_age_seconds``
(and the least recently seen beyond ``max_records``, unconfirmed records before those naming a replica
seen serving the ghost) with uid and resourceVersion
preconditions: deletes are safe to repeat and every replica may run them (a record
written since is kept, a record already deleted is a 404, both ignored). The writer
runs it every ``PRUNE_INTERVAL`` seconds.
"""

from __future__ import annotations

import atexit
import collections
import heapq
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from guard import metrics
from guard.core import flood
from guard.core.token_bucket import TokenBucket
from guard.core.ghostpod_mapping import (
    API_VERSION, KIND, LABEL_MANAGED_BY, NODE_KIND, NODE_NAMESPACE, Key, Pending, apply_ops, from_time,
    node_object_name, node_record_status, node_spec, node_to_record, object_name, record_status, status_patch,
    to_record, widen, widen_node,
)
from guard.core.records import (
    MAX_NAMESPACE, MAX_REPLICA, MAX_UID, VERDICTS, AuditError, AuditRecord, NewRecordHook, NodeRecord, check_text,
    check_time, evidence_json, identity, node_identity,
)
from guard.kube.writes import GhostPodError, GhostPods

log = logging.getLogger("guard.ghostpods")

MIN_WRITE_INTERVAL: Final = 10.0  # seconds between two writes of one identity by one guard process
MAX_CONFLICT_RETRIES: Final = 8
MAX_BACKOFF: Final = 30.0
PRUNE_INTERVAL: Final = 600.0
# At exit, pending records are written for at most this long: within gunicorn's graceful_timeout (25 s,
# guard/serving/server.py GRACEFUL_TIMEOUT), after the calls in flight. 8 s once lost 22 of 591 records in a
# rollout mid-flood on a loaded 2-core machine (about 70 writes/s to the lab's apiserver).
CLOSE_DEADLINE: Final = 20.0
FLUSH_WRITERS: Final = 8

# --- the store ----------------------------------------------------------------------------


class KubeAuditStore:
    """The audit store on GhostPod objects (see the module docstring). Satisfies
    :class:`guard.audit.backend.AuditBackend`."""

    writes_in_background = True  # a record call returns before the write: check() says how writes go

    def __init__(self, api: GhostPods, *, node_api: GhostPods | None = None, max_age_seconds: float = 30 * 86400, max_records: int = 100_000,
                 on_new: NewRecordHook | None = None, write_qps: float = 20.0, queue_size: int = 50_000, writers: int = 2,
                 min_interval: float = MIN_WRITE_INTERVAL, prune_interval: float = PRUNE_INTERVAL,
                 start: bool = True, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_age_seconds, bool) or not isinstance(max_age_seconds, (int, float)) or not math.isfinite(max_age_seconds) or max_age_seconds <= 0:
            raise ValueError(f"max_age_seconds must be a positive number, not {max_age_seconds!r}")
        if not write_qps > 0 or queue_size < 1:
            raise ValueError("write_qps must be positive and queue_size at least 1")
        self.api = api
        self.node_api = node_api if node_api is not None else GhostPods(api.kube, timeout=api.timeout,
                                                                        list_timeout=api.list_timeout, nodes=True)
        self.path = "kubernetes"  # how AuditHealth names a store
        self.max_age_seconds = float(max_age_seconds)
        self.max_records = max_records
        self.queue_size = queue_size
        self.min_interval = min_interval
        self.prune_interval = prune_interval
        self._on_new = on_new
        self._clock = clock
        self._mono = monotonic
        self._rate = TokenBucket(write_qps, max(1, int(write_qps)), monotonic)
        self._cond = threading.Condition()
        self._pending: dict[Key, Pending] = {}
        self._heap: list[tuple[float, int, Key]] = []  # (due, seq, key): when each pending identity may be written
        self._seq = 0
        self._in_flight: set[Key] = set()
        self._last_write: collections.OrderedDict[Key, float] = collections.OrderedDict()  # key -> monotonic time
        self._known: collections.OrderedDict[Key, dict] = collections.OrderedDict()  # key -> the object last written
        self._seen: collections.OrderedDict[Key, None] = collections.OrderedDict()  # identities this process recorded
        self._problem: str | None = None
        self._dropped = 0
        self._closed = False
        self._flushing = False
        self._threads: list[threading.Thread] = []
        self._next_prune = monotonic() + min(60.0, prune_interval)
        if start:
            for i in range(max(1, writers)):
                t = threading.Thread(target=self._run, name=f"ghostpod-writer-{i}", daemon=True)
                t.start()
                self._threads.append(t)
            ref = weakref.ref(self)
            def close_at_exit() -> None:
                store = ref()
                if store is not None:
                    store.close()

            atexit.register(close_at_exit)

    # -- writes: into memory, never waiting for the apiserver ------------------------------

    def record_block(self, *, uid: str, namespace: str, name: str, verdict: str, evidence: Mapping[str, Any],
                     at: float) -> bool | None:
        """Queue one block of ``(namespace, name, uid)``. True the first time this process records it; None when
        it was dropped (the queue is full: counted, and ``check()`` says so)."""
        identity(namespace, name, uid)
        if verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; not {verdict!r}")
        evidence_text = evidence_json(evidence, strict=False)
        at = check_time("at", at)
        key = (namespace, name, uid)
        spec = {"podName": name, "podUID": uid, "verdict": verdict,
                "evidence": dict(evidence) if evidence_text is not None else {"truncated": True}}
        new = self._queue(key, {"op": "block", "count": 1, "first": at, "last": at}, spec=spec)
        return new  # None: dropped (the queue is full; counted)

    def retract(self, *, uid: str, at: float, namespace: str | None = None, name: str | None = None) -> bool:
        """Queue the withdrawal of the identity's verdict. The identity is needed (the object is named by it):
        without ``namespace``/``name``, every identity with this UID this process recorded is retracted."""
        check_text("uid", uid, MAX_UID)
        at = check_time("at", at)
        if namespace is not None and name is not None:
            keys = [(namespace, name, uid)]
        else:
            with self._cond:
                keys = [k for k in self._seen if k[2] == uid]
        found = False
        for key in keys:
            found = self._queue(key, {"op": "retract", "at": at}, known_only=True) is not None or found
        return found

    def record_probe(self, *, uid: str, replica: str, serves: bool | None, cache_resource_version: str | None,
                     error: str | None, at: float, namespace: str | None = None, name: str | None = None) -> None:
        check_text("uid", uid, MAX_UID)
        check_text("replica", replica, MAX_REPLICA)
        if serves is not None and not isinstance(serves, bool):
            raise ValueError(f"serves must be true, false or null, not {serves!r}")
        op = {"op": "probe", "replica": replica, "serves": serves,
              "rv": None if cache_resource_version is None else str(cache_resource_version)[:64],
              "error": None if error is None else str(error)[:512], "at": check_time("at", at)}
        keys = [(namespace, name, uid)] if namespace is not None and name is not None else self._keys_of(uid)
        for key in keys:
            self._queue(key, dict(op), known_only=True)

    def record_heal(self, *, uid: str, action: str, outcome: str, detail: str, at: float,
                    namespace: str | None = None, name: str | None = None) -> None:
        check_text("uid", uid, MAX_UID)
        op = {"op": "heal", "action": str(action), "outcome": str(outcome), "detail": str(detail),
              "at": check_time("at", at)}
        keys = [identity(namespace, name, uid)] if namespace is not None and name is not None else self._keys_of(uid)
        for key in keys:
            self._queue(key, dict(op), known_only=True)

    # -- ghost Nodes: GhostNode objects (cluster-scoped), the same writers ------------------------

    def record_node(self, *, name: str, uid: str, serving: Sequence[str], at: float, healed: Sequence[str] = (),
                    evidence: Mapping[str, Any] | None = None) -> bool | None:
        """Queue ghost Node ``(name, uid)`` as served by ``serving`` (one detection) and no longer served by
        ``healed``. True the first time this process records it; None when dropped (queue full) or when
        ``uid`` is unknown ("": the GhostNode is named by the identity)."""
        key = node_identity(name, uid)
        at = check_time("at", at)
        if not uid:
            return None
        evidence = dict(evidence or {})
        spec = node_spec(name, uid, evidence if evidence_json(evidence, strict=False) is not None else {"truncated": True})
        ops: list[dict] = [{"op": "block", "counter": "timesDetected", "count": 1, "first": at, "last": at}] if serving else []
        ops += [{"op": "probe", "replica": r, "serves": True, "rv": None, "error": None, "at": at} for r in serving]
        ops += [{"op": "probe", "replica": r, "serves": False, "rv": None, "error": None, "at": at} for r in healed]
        for r in [*serving, *healed]:
            check_text("replica", r, MAX_REPLICA)
        new: bool | None = None
        for i, op in enumerate(ops):
            got = self._queue(key, op, spec=spec) if i == 0 and serving else self._queue(key, op, known_only=True)
            new = got if i == 0 else new
        return new

    def record_node_heal(self, *, name: str, uid: str, action: str, outcome: str, detail: str, at: float) -> None:
        """Queue one heal attempt on the GhostNode of ``(name, uid)`` (written if the object exists)."""
        key = node_identity(name, uid)
        if not uid:
            return
        self._queue(key, {"op": "heal", "action": str(action), "outcome": str(outcome), "detail": str(detail),
                          "at": check_time("at", at)})

    def node_records(self, *, since: float | None = None, limit: int | None = None) -> list[NodeRecord]:
        """Every GhostNode as a record, most recently seen first (the filters of the SQLite store's)."""
        if since is not None:
            since = check_time("since", since)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be a non-negative integer, not {limit!r}")
        out = [r for r in (node_to_record(o) for o in self.objects(nodes=True))
               if r is not None and (since is None or r.last_seen >= since)]
        out.sort(key=lambda r: (-r.last_seen, r.name, r.uid))
        return out if limit is None else out[:limit]

    def _api_for(self, namespace: str) -> GhostPods:
        """The GhostNode calls for a ghost Node's key (no namespace), else the GhostPod calls."""
        return self.node_api if namespace == "" else self.api

    def _keys_of(self, uid: str) -> list[Key]:
        with self._cond:
            return [k for k in self._seen if k[2] == uid]

    def _queue(self, key: Key, op: dict, *, spec: dict | None = None, known_only: bool = False) -> bool | None:
        """Add ``op`` to the identity's pending entry. Returns whether the identity is new to this process
        (None: dropped, because ``known_only`` and unknown, or the queue is full)."""
        now = self._mono()
        with self._cond:
            if self._closed and not self._flushing:
                raise AuditError("audit store is closed")
            new = key not in self._seen
            if known_only and new:
                return None
            entry = self._pending.get(key)
            if entry is None:
                if len(self._pending) >= self.queue_size:
                    self._dropped += 1
                    self._problem = (f"{len(self._pending)} records waiting to be written (the queue is full): "
                                     f"{self._dropped} dropped")
                    metrics.AUDIT_RECORDS_DROPPED.labels("queue-full").inc()
                    if self._dropped == 1 or self._dropped % 1000 == 0:
                        log.error("audit store: %s", self._problem)
                    return None
                entry = self._pending[key] = Pending(key, since=now)
                if key not in self._in_flight:
                    self._schedule(key, now)
            if spec is not None and entry.spec is None:
                entry.spec = spec
            entry.add(op)
            if new:
                self._seen[key] = None
                if len(self._seen) > 200_000:
                    self._seen.popitem(last=False)
            metrics.AUDIT_PENDING.set(len(self._pending))
            return new

    def _schedule(self, key: Key, now: float, delay: float = 0.0) -> None:
        last = self._last_write.get(key)
        due = max(now + delay, (last + self.min_interval) if last is not None and not self._flushing else now)
        self._seq += 1
        heapq.heappush(self._heap, (due, self._seq, key))
        self._cond.notify()

    # -- the background writers ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed and not self._flushing:
                        return
                    now = self._mono()
                    if not self._flushing and now >= self._next_prune:  # one writer prunes; the others write
                        self._next_prune = now + self.prune_interval
                        entry = None
                        break
                    if self._heap and self._heap[0][0] <= now:
                        _, _, key = heapq.heappop(self._heap)
                        entry = self._pending.pop(key, None)
                        if entry is None or key in self._in_flight:
                            if entry is not None:  # another writer has it: back, after it
                                self._pending[key] = entry
                            continue
                        self._in_flight.add(key)
                        break
                    wait = (self._heap[0][0] - now) if self._heap else 1.0
                    self._cond.wait(min(max(wait, 0.001), 1.0))
            if entry is None:
                self._prune_safely()
                continue
            delay = 0.0 if self._flushing else self._rate.take()  # at exit: everything, at once
            while delay > 0:
                time.sleep(delay)
                delay = 0.0 if self._flushing else self._rate.take()
            self._write_one(entry)

    def _write_one(self, entry: Pending) -> None:
        key = entry.key
        try:
            self._write(entry)
        except GhostPodError as e:
            self._failed(entry, e)
            return
        except Exception as e:  # a bug of ours must not kill the writer; the operations go back
            log.exception("audit store: writing the record of %s/%s uid %s failed", *key)
            self._failed(entry, GhostPodError(0, "InternalError", str(e)[:200]))
            return
        with self._cond:
            self._in_flight.discard(key)
            self._last_write[key] = self._mono()
            self._last_write.move_to_end(key)
            if len(self._last_write) > 100_000:
                self._last_write.popitem(last=False)
            if key in self._pending:  # operations that arrived meanwhile
                self._schedule(key, self._mono())
            self._problem = None
            metrics.AUDIT_PENDING.set(len(self._pending))
        metrics.AUDIT_WRITES.labels("ok").inc()

    def _failed(self, entry: Pending, e: GhostPodError) -> None:
        key = entry.key
        metrics.AUDIT_WRITES.labels("retry" if e.transient else "rejected").inc()
        with self._cond:
            self._in_flight.discard(key)
            if not e.transient:
                # The apiserver refuses this record (422 Invalid, 400): retrying cannot help. Counted, logged.
                self._dropped += 1
                metrics.AUDIT_RECORDS_DROPPED.labels("rejected").inc()
                log.error("audit store: the record of %s/%s uid %s was refused and is dropped: %s", *key, e)
                if key in self._pending:
                    self._schedule(key, self._mono())
                return
            newer = self._pending.get(key)
            entry.attempts += 1
            if newer is not None:
                entry.absorb(newer)
            self._pending[key] = entry
            first = self._problem is None
            waiting = len(self._pending) + len(self._in_flight)
            self._problem = f"GhostPod writes failing ({waiting} records waiting): {e}"
            backoff = min(MAX_BACKOFF, 0.5 * 2 ** min(entry.attempts, 10))
            self._schedule(key, self._mono(), delay=0.05 if self._flushing else backoff)
        if first:  # once per change of state, not per record
            log.warning("audit store: %s; records are kept and retried", e)

    def _create_or_get(self, namespace: str, obj_name: str, spec: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create the object, or read it if another replica (or an earlier export) already did: (object, created)."""
        api = self._api_for(namespace)
        try:
            return api.create(namespace, self._new_object(namespace, obj_name, spec)), True
        except GhostPodError as e:
            if e.reason != "AlreadyExists":
                raise
            return api.get(namespace, obj_name), False

    def _write(self, entry: Pending) -> None:
        namespace, name, uid = entry.key
        obj_name = object_name(namespace, name, uid)  # a ghost Node's (namespace ""): node_object_name
        api = self._api_for(namespace)
        with self._cond:
            obj = self._known.get(entry.key)
        created = False
        if obj is None:
            if entry.spec is None:
                obj = self._get_or_none(namespace, obj_name)
                if obj is None:  # nothing to attach probes to (the record was pruned): not an error
                    return
            else:
                obj, created = self._create_or_get(namespace, obj_name, entry.spec)
        for _ in range(MAX_CONFLICT_RETRIES):
            old = obj.get("status") if isinstance(obj.get("status"), dict) else {}
            new = apply_ops(old, entry.ops)
            rv = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            try:
                obj = api.patch_status(namespace, obj_name, status_patch(old, new, rv))
                break
            except GhostPodError as e:
                if e.reason == "Conflict":  # another replica wrote it: read it again, apply again
                    obj = api.get(namespace, obj_name)
                    continue
                if e.missing:  # deleted meanwhile (retention): create it again if we can
                    with self._cond:
                        self._known.pop(entry.key, None)
                    if entry.spec is None:
                        return
                    obj = api.create(namespace, self._new_object(namespace, obj_name, entry.spec))
                    created = True
                    continue
                raise
        else:
            raise GhostPodError(409, "Conflict", f"ghostpod {namespace}/{obj_name}: still conflicting after "
                                                 f"{MAX_CONFLICT_RETRIES} attempts")
        with self._cond:
            self._known[entry.key] = obj
            self._known.move_to_end(entry.key)
            if len(self._known) > 10_000:
                self._known.popitem(last=False)
        if created:
            self._announce(obj)

    def _get_or_none(self, namespace: str, name: str) -> dict | None:
        try:
            return self._api_for(namespace).get(namespace, name)
        except GhostPodError as e:
            if e.missing:
                return None
            raise

    @staticmethod
    def _new_object(namespace: str, name: str, spec: dict) -> dict:
        if namespace == "":  # a ghost Node: cluster-scoped
            return {"apiVersion": API_VERSION, "kind": NODE_KIND,
                    "metadata": {"name": name, "labels": {LABEL_MANAGED_BY: "kube-ghost-guard"}}, "spec": spec}
        return {"apiVersion": API_VERSION, "kind": KIND,
                "metadata": {"name": name, "namespace": namespace,
                             "labels": {LABEL_MANAGED_BY: "kube-ghost-guard"}},
                "spec": spec}

    def _announce(self, obj: Mapping[str, Any]) -> None:
        """``on_new`` with the object this process created (no other replica created it): once per identity
        across the guard's replicas. A failing hook never fails the write."""
        if self._on_new is None:
            return
        record = to_record(obj)
        if record is None:
            return
        try:
            self._on_new(record)
        except Exception:
            log.exception("new-record hook failed for %s/%s uid %s", record.namespace, record.name, record.uid)

    def flush(self, timeout: float) -> bool:
        """Write everything pending now, ignoring the per-record interval and the rate limit, with
        ``FLUSH_WRITERS`` extra threads, for at most ``timeout`` seconds (at exit: a rollout must lose
        nothing). True when nothing is left."""
        deadline = self._mono() + timeout
        with self._cond:
            self._flushing = True
            self._heap = [(0.0, s, k) for _, s, k in self._heap]
            heapq.heapify(self._heap)
            self._cond.notify_all()
        try:
            helpers = [threading.Thread(target=self._flush_worker, args=(deadline,), daemon=True,
                                        name=f"ghostpod-flush-{i}") for i in range(FLUSH_WRITERS)]
            for t in helpers:
                t.start()
            for t in helpers:
                t.join(max(0.0, deadline - self._mono()) + 1.0)
            with self._cond:
                while (self._pending or self._in_flight) and self._mono() < deadline:
                    self._cond.wait(0.05)
                return not self._pending and not self._in_flight
        finally:
            with self._cond:
                self._flushing = False
                self._cond.notify_all()

    def _flush_worker(self, deadline: float) -> None:
        while self._mono() < deadline:
            with self._cond:
                key = next((k for k in self._pending if k not in self._in_flight), None)
                if key is None:
                    if not self._in_flight:
                        return
                    self._cond.wait(0.05)
                    continue
                entry = self._pending.pop(key)
                self._in_flight.add(key)
                attempts = entry.attempts
            self._write_one(entry)
            if entry.attempts > attempts:  # failed: the apiserver is not answering; do not spin
                time.sleep(0.1)

    # -- reads --------------------------------------------------------------------------------

    def objects(self, namespace: str | None = None, *, nodes: bool = False) -> list[dict]:
        """Every GhostPod (of ``namespace``), or with ``nodes`` every GhostNode, page by page. Raises AuditError."""
        out: list[dict] = []
        cont = None
        api = self.node_api if nodes else self.api
        try:
            while True:
                items, cont = api.list(namespace, cont=cont)
                out += items
                if not cont:
                    return out
        except GhostPodError as e:
            raise AuditError(f"cannot read {'GhostNodes' if nodes else 'GhostPods'}: {e}") from e

    def records(self, *, namespace: str | None = None, verdict: str | None = None, replica: str | None = None,
                since: float | None = None, limit: int | None = None, retracted: bool = False) -> list[AuditRecord]:
        """The same filters and order as :meth:`guard.audit.sqlite.AuditStore.records` (most recently seen first)."""
        if namespace is not None:
            check_text("namespace", namespace, MAX_NAMESPACE)
        if verdict is not None and verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}; not {verdict!r}")
        if replica is not None:
            check_text("replica", replica, MAX_REPLICA)
        if since is not None:
            since = check_time("since", since)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be a non-negative integer, not {limit!r}")
        out = []
        for obj in self.objects(namespace):
            rec = to_record(obj)
            if rec is None:
                continue
            if (not retracted and rec.retracted_at is not None) or (verdict is not None and rec.verdict != verdict):
                continue
            if replica is not None and not any(r.replica == replica and r.first_seen_serving is not None
                                               for r in rec.replicas):
                continue
            if since is not None and rec.last_seen < since:
                continue
            out.append(rec)
        out.sort(key=lambda r: (-r.last_seen, r.uid))
        return out if limit is None else out[:limit]

    def record(self, uid: str) -> AuditRecord | None:
        """The most recently seen record of a pod with this UID (any name), or None."""
        check_text("uid", uid, MAX_UID)
        found = [r for r in self.records(retracted=True) if r.uid == uid]
        return found[0] if found else None

    def put(self, record: AuditRecord) -> bool:
        """Write ``record`` as it is (``audit export``), synchronously: create, or bring an existing object up
        to it (``timesBlocked`` and the times widened, never counted twice: exporting again changes nothing).
        True if the object was created. Raises AuditError."""
        spec = {"podName": record.name, "podUID": record.uid, "verdict": record.verdict,
                "evidence": dict(record.evidence) if evidence_json(record.evidence, strict=False) else {}}
        return self._put(record.namespace, object_name(record.namespace, record.name, record.uid), spec,
                         record_status(record), widen, f"{record.namespace}/{record.name}")

    def put_node(self, record: NodeRecord) -> bool:
        """:meth:`put` for a ghost Node's record: its GhostNode (``timesDetected`` widened, never counted twice)."""
        spec = node_spec(record.name, record.uid,
                         dict(record.evidence) if evidence_json(record.evidence, strict=False) else {})
        return self._put(NODE_NAMESPACE, node_object_name(record.name, record.uid), spec, node_record_status(record),
                         widen_node, f"node/{record.name}")

    def _put(self, namespace: str, obj_name: str, spec: dict[str, Any], want: dict[str, Any],
             widen_status: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]], what: str) -> bool:
        api = self._api_for(namespace)
        try:
            obj, created = self._create_or_get(namespace, obj_name, spec)
            for _ in range(MAX_CONFLICT_RETRIES):
                raw_status = obj.get("status")
                old: dict[str, Any] = raw_status if isinstance(raw_status, dict) else {}
                new = widen_status(old, want)
                if new == old:
                    return created
                try:
                    api.patch_status(namespace, obj_name, status_patch(old, new, str(obj["metadata"]["resourceVersion"])))
                    return created
                except GhostPodError as e:
                    if e.reason != "Conflict":
                        raise
                    obj = api.get(namespace, obj_name)
            raise GhostPodError(409, "Conflict", f"{obj_name}: still conflicting")
        except GhostPodError as e:
            raise AuditError(f"cannot write the record of {what}: {e}") from e

    # -- retention ----------------------------------------------------------------------------

    def prune(self, *, now: float) -> int:
        """Delete records last seen before ``now - max_age_seconds``, then the least recently seen beyond
        ``max_records``; each delete names the uid and resourceVersion it saw (a record written since
        stays; one already gone is fine). Returns how many this call deleted. Raises AuditError."""
        now = check_time("now", now)
        objs = self.objects()
        keyed = []
        for obj in objs:
            rec = to_record(obj)
            last = rec.last_seen if rec is not None else (from_time((obj.get("metadata") or {}).get("creationTimestamp")) or 0.0)
            keyed.append((last, flood.prune_key(rec) if rec is not None else (True, -last), obj))
        # Confirmed records (a probe saw a replica serve the ghost) before unconfirmed ones, then the most
        # recently seen (guard.core.flood.prune_key): a flood of forged names never pushes out a stale replica's record.
        keyed.sort(key=lambda t: t[1])
        doomed = [obj for i, (last, _, obj) in enumerate(keyed) if last < now - self.max_age_seconds or i >= self.max_records]
        deleted = 0
        for obj in doomed:
            meta = obj.get("metadata") or {}
            try:
                self.api.delete(str(meta.get("namespace", "")), str(meta.get("name", "")), uid=str(meta.get("uid", "")),
                                resource_version=str(meta.get("resourceVersion", "")))
                deleted += 1
            except GhostPodError as e:
                if e.missing or e.reason == "Conflict":
                    continue  # another replica deleted it, or it was written since: keep it
                raise AuditError(f"cannot prune GhostPods: {e}") from e
        deleted += self._prune_nodes(now)
        if deleted:
            metrics.AUDIT_PRUNED.inc(deleted)
        return deleted

    def _prune_nodes(self, now: float) -> int:
        """GhostNodes last seen before ``now - max_age_seconds`` (ghost Nodes are few: by age only), with the same
        preconditions. A cluster without the GhostNode CRD (manifests/crd before ghost Nodes) has none to prune."""
        try:
            objs = self.objects(nodes=True)
        except AuditError as e:
            log.debug("GhostNodes not pruned: %s", e)
            return 0
        deleted = 0
        for obj in objs:
            rec = node_to_record(obj)
            meta = obj.get("metadata") or {}
            last = rec.last_seen if rec is not None else (from_time(meta.get("creationTimestamp")) or 0.0)
            if last >= now - self.max_age_seconds:
                continue
            try:
                self.node_api.delete("", str(meta.get("name", "")), uid=str(meta.get("uid", "")),
                                     resource_version=str(meta.get("resourceVersion", "")))
                deleted += 1
            except GhostPodError as e:
                if not (e.missing or e.reason == "Conflict"):
                    raise AuditError(f"cannot prune GhostNodes: {e}") from e
        return deleted

    def _prune_safely(self) -> None:
        try:
            dropped = self.prune(now=self._clock())
        except AuditError as e:
            log.warning("audit prune failed: %s", e)
            return
        if dropped:
            log.info("audit prune deleted %d GhostPods", dropped)

    # -- health and lifecycle -----------------------------------------------------------------

    def check(self) -> str | None:
        """None while writes succeed (or nothing was written yet), else one line saying why not. No API call:
        the writers' own outcomes are the test."""
        with self._cond:
            if self._closed:
                return "audit store is closed"
            return self._problem

    def pending(self) -> int:
        """Identities waiting to be written (or being written)."""
        with self._cond:
            return len(self._pending) + len(self._in_flight)

    def close(self) -> None:
        """Write what is pending (at most ``CLOSE_DEADLINE`` seconds), then stop the writers."""
        with self._cond:
            if self._closed:
                return
        if self._threads:
            left = self.flush(CLOSE_DEADLINE)
            if not left:
                log.error("audit store: %d records still waiting at exit could not be written", self.pending())
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __enter__(self) -> KubeAuditStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

