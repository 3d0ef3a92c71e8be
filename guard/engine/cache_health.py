"""Replica caches that miss pods or stopped: the checks, their metrics, Events and /readyz detail.

One background thread per guard worker, never on the scheduling path. Every
second it compares the per-replica views (guard/engine/replica_views.py: the
pending pods each replica's cache shows, listed every few seconds, one replica
watched while the guard is called; kept with ``--no-prepare`` too); a
pod other replicas have shown for ``--missing-after`` seconds but one synced
replica has not is confirmed before anyone is named: a quorum GET (still
pending, same UID?), a consistent read on that replica (a flowing cache
catches up with etcd), then that replica's cache read directly
(``resourceVersion=0``): lacking the pod at a revision past the pod's own,
the cache lost it (``ghost_guard_replica_pods_missing``, a
``PodMissingFromReplica`` Event on the pod, once per replica). Every
``--frozen-after``/3 seconds it reads every replica's cache revision the same
way (a consistent read, then ``resourceVersion=0``, of one pod name that
normally does not exist): a revision that stands still behind etcd's for
``--frozen-after`` seconds names the replica frozen
(``ghost_guard_replica_frozen``). The rules are :mod:`guard.core.cache_health`'s.

Cost per replica: two small LISTs every ``--frozen-after``/3 seconds (12 a
minute by default), plus three reads per suspect pod (rare).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from guard import metrics
from guard.core import cache_health
from guard.kube.reads import Kube
from guard.kube.watch import ReplicaClient
from guard.kube.writes import emit_event
from guard.core.cache_health import CacheTrack, RevisionSample, ViewState
from guard.engine.background import Background
from guard.engine.replica_views import PendingViews
from guard.engine.replicas import ReplicaPool
from guard.core.settings import Settings
from guard.core.verdict import PodRef, QuorumRead, is_pending, pending_in_etcd

log = logging.getLogger("guard.cache_health")

# The name read to learn a replica's cache revision: normally no such pod, so the answers are tiny.
REVISION_PROBE_NAMESPACE = "default"
REVISION_PROBE_NAME = "ghost-guard-revision-probe"
# Most confirmations per tick (each: one quorum GET and two reads of one replica).
MAX_CONFIRMATIONS_PER_TICK = 20
# Pods listed per replica in /readyz at most.
READYZ_PODS = 10

Views = Callable[[], PendingViews]


class CacheHealthMonitor:
    """Missing pods and frozen watches, per replica. ``views`` is the replica views' ``pending_views``
    (guard.engine.replica_views; None: only frozen watches are looked for)."""

    def __init__(self, settings: Settings, kube: Kube, pool: ReplicaPool, views: Views | None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.kube = kube
        self.pool = pool
        self._views = views
        self._clock = clock
        self._lock = threading.Lock()
        self._first_seen: dict[str, float] = {}  # uid -> when any replica first showed it pending
        self._next_check: dict[tuple[str, str], float] = {}  # (replica, uid) -> earliest next confirmation
        self._missing: dict[str, dict[str, PodRef]] = {}  # replica -> uid -> pod confirmed missing there
        self._tracks: dict[str, CacheTrack] = {}
        self._errors: dict[str, str | None] = {}  # replica -> why its last revision read got no answer
        self._last_round = -1e18
        self._bg = Background(log)
        self._reads = self._bg.pool("ghost-cache-health", 8)

    def start(self) -> None:
        self._bg.loop("ghost-cache-health", self.tick, 1.0, what="replica cache health check", join=True)

    def close(self, timeout: float = 3.0) -> None:
        """Stop: no new round, the one running (if any) given ``timeout`` seconds to end, then its
        read pool shut. Called on the worker's exit (guard.serving.server), before the interpreter's own exit
        shuts every pool under a running round."""
        self._bg.close(timeout)

    def tick(self) -> None:
        now = self._clock()
        clients = {c.replica.address: c for c in self.pool.clients()}
        if self._views is not None:
            self.check_missing(clients, now)
        if now - self._last_round >= self.settings.revision_interval:
            self._last_round = now
            self.revision_round(clients, now)
        self._export(clients, now)

    # -- missing pods -----------------------------------------------------------------------

    def check_missing(self, clients: dict[str, ReplicaClient], now: float) -> None:
        if self._views is None:
            return
        snapshot = self._views()
        views = {a: v for a, v in snapshot.views.items() if a in clients}
        shown = {a: v.uids for a, v in views.items()}
        pods: dict[str, PodRef] = {}
        for a in views:
            pods.update(snapshot.pods.get(a, {}))
        with self._lock:
            for gone in [r for r in self._missing if r not in clients]:  # no longer a replica
                del self._missing[gone]
            for uid in pods:
                self._first_seen.setdefault(uid, now)
            for uid in [u for u in self._first_seen if u not in pods]:  # pending nowhere any more
                del self._first_seen[uid]
            self._next_check = {k: t for k, t in self._next_check.items() if k[1] in pods}
            for replica, missing in self._missing.items():
                for uid in [u for u in missing if u not in pods or u in shown.get(replica, ())]:
                    pod = missing.pop(uid)
                    log.info("apiserver replica %s shows pod %s uid %s now (or it is no longer pending): no longer "
                             "missing", replica, pod, uid)
            # A replica whose cache was last seen behind etcd lags or froze: what it does not show yet
            # is not missing (the frozen rule speaks for it); checking each pod would cost a GET apiece.
            behind = {r for r, t in self._tracks.items() if t.behind_since is not None}
            suspects = [(r, u) for r, u in cache_health.missing_suspects(
                views, self._first_seen, now=now, missing_after=self.settings.missing_after,
                known=snapshot.known, left=snapshot.left)
                if r not in behind and u not in self._missing.get(r, {}) and self._next_check.get((r, u), -1e18) <= now]
        for replica, uid in suspects[:MAX_CONFIRMATIONS_PER_TICK]:
            self._confirm(clients[replica], pods[uid], now)

    def _confirm(self, client: ReplicaClient, pod: PodRef, now: float) -> str:
        outcome, read, cache_rv = confirm_pod(self.kube, client, pod)
        replica = client.replica.address
        with self._lock:
            if outcome != cache_health.MISSING:
                self._next_check[(replica, pod.uid)] = now + self.settings.revision_interval
                return outcome
            new = pod.uid not in self._missing.setdefault(replica, {})
            self._missing[replica][pod.uid] = pod
        if new:
            metrics.REPLICA_PODS_MISSING_DETECTIONS.labels(replica).inc()
            message = (f"apiserver replica {client.replica} does not show pod {pod} uid {pod.uid}, pending in etcd "
                       f"(resourceVersion {read.resource_version}), although its watch cache is past that revision "
                       f"(resourceVersion {cache_rv}): its watch lost the pod's creation. Schedulers and "
                       f"controllers reading that replica do not see the pod; `ghost-guard heal {pod}` writes to "
                       f"the pod so that every cache whose watch flows shows it")
            log.warning("%s", message)
            if self.settings.events:
                try:
                    emit_event(self.kube, namespace=pod.namespace, pod_name=pod.name, pod_uid=pod.uid,
                               reason="PodMissingFromReplica", message=message, key=replica)
                except Exception as e:  # Events are best effort
                    log.warning("cannot emit PodMissingFromReplica Event for %s: %s", pod, str(e)[:200])
        return outcome

    # -- frozen watches ---------------------------------------------------------------------

    def revision_round(self, clients: dict[str, ReplicaClient], now: float) -> dict[str, CacheTrack]:
        """Every replica's consistent read, then every replica's cache revision; assessed together."""
        order = sorted(clients)
        etcd, samples, errors = read_revisions(self._reads, clients, now)
        with self._lock:
            self._errors = errors
            before = self._tracks
            self._tracks = after = cache_health.assess(
                {a: t for a, t in before.items() if a in clients}, samples, frozen_after=self.settings.frozen_after)
        for a in order:
            was, now_frozen = before.get(a, CacheTrack()).frozen, after.get(a, CacheTrack()).frozen
            if now_frozen and not was:
                t = after[a]
                log.warning("apiserver replica %s: its watch cache revision has stood at %s for %.0fs while etcd "
                            "moved on (now at least %s): its watch is frozen; writes cannot heal it, restart that "
                            "apiserver replica", clients[a].replica, t.cache_rv, t.seconds_behind(now), etcd[a])
            elif was and not now_frozen:
                log.info("apiserver replica %s: its watch cache revision moves again", clients[a].replica)  # a recovery
        return after

    # -- what it shows --------------------------------------------------------------------------

    def _export(self, clients: dict[str, ReplicaClient], now: float) -> None:
        with self._lock:
            for a in clients:
                metrics.replica_known(a)
                t = self._tracks.get(a, CacheTrack())
                metrics.REPLICA_PODS_MISSING.labels(a).set(len(self._missing.get(a, {})))
                metrics.REPLICA_SECONDS_BEHIND.labels(a).set(round(t.seconds_behind(now), 1))
                metrics.REPLICA_FROZEN.labels(a).set(1 if t.frozen else 0)

    def frozen(self, replica: str) -> bool:
        """Whether ``replica``'s watch is named frozen now (the advice for it is a restart, never a write)."""
        with self._lock:
            track = self._tracks.get(replica)
            return track is not None and track.frozen

    def status(self) -> dict[str, dict]:
        """Per replica: cache revision, seconds behind etcd, frozen, pods missing (the first few), for /readyz."""
        now = self._clock()
        with self._lock:
            out = {}
            for a in sorted(set(self._tracks) | set(self._missing) | set(self._errors)):
                t = self._tracks.get(a, CacheTrack())
                missing = sorted(self._missing.get(a, {}).values(), key=str)
                out[a] = {"cache_revision": t.cache_rv, "seconds_behind": round(t.seconds_behind(now), 1),
                          "frozen": t.frozen, "read_error": self._errors.get(a), "pods_missing": len(missing),
                          "missing": [f"{p} ({p.uid})" for p in missing[:READYZ_PODS]]}
            return out


def confirm_pod(kube: Kube, client: ReplicaClient, pod: PodRef) -> tuple[str, QuorumRead, int | None]:
    """Is ``pod`` missing from ``client``'s replica? (cache_health outcome, the quorum read, the cache
    revision). A quorum GET first; only for a pod etcd has pending, a consistent read on the replica
    (a flowing cache catches up with etcd) and then its cache read directly (resourceVersion=0)."""
    read = kube.quorum_get(pod.namespace, pod.name)
    shows, cache_rv = None, None
    if pending_in_etcd(read, pod.uid):  # else nothing is missing (or etcd cannot say): no cache read
        client.consistent_revision(pod.namespace, pod.name)
        items, rv, error = client.read_cache(pod.namespace, pod.name)
        if error is None:
            shows = any((i.get("metadata") or {}).get("uid") == pod.uid for i in items)
            cache_rv = _int(rv)
    return cache_health.confirm_missing(read, pod.uid, cache_shows=shows, cache_rv=cache_rv), read, cache_rv


def read_revisions(pool: ThreadPoolExecutor, clients: dict[str, ReplicaClient], at: float
                   ) -> tuple[dict[str, int | None], list[RevisionSample], dict[str, str | None]]:
    """Every replica's consistent read (in parallel), then every replica's cache revision: the etcd
    revision each sample is compared with, the samples, and per replica why its cache read got no
    answer (None when it answered)."""
    order = sorted(clients)
    consistent = list(pool.map(
        lambda a: clients[a].consistent_revision(REVISION_PROBE_NAMESPACE, REVISION_PROBE_NAME), order))
    caches = list(pool.map(lambda a: clients[a].read_cache(REVISION_PROBE_NAMESPACE, REVISION_PROBE_NAME), order))
    etcd = cache_health.round_etcd_revision({a: rv for a, (rv, _) in zip(order, consistent)})
    samples = [RevisionSample(a, at, etcd[a], None if error else _int(rv)) for a, (_, rv, error) in zip(order, caches)]
    return etcd, samples, {a: error for a, (_, _, error) in zip(order, caches)}


# One look for `ghost-guard report --live`: the frozen rule over this window (two revision reads).
LIVE_WINDOW_SECONDS = 5.0


def check_now(kube: Kube, clients: list[ReplicaClient], *, window: float = LIVE_WINDOW_SECONDS,
              sleep: Callable[[float], None] = time.sleep,
              progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Every replica's cache checked once, for ``report --live``: its revision read twice ``window``
    seconds apart (frozen: behind etcd both times, unmoved, while another replica was caught up), and
    the pending pods other replicas' caches list but it does not, each confirmed as the guard does
    (no --missing-after: a cache past the pod's revision that lacks it misses it, however young)."""
    by_address = {c.replica.address: c for c in clients}
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="ghost-cache-check") as pool:
        progress(f"reading the cache revision of {len(by_address)} replica(s) and etcd's")
        etcd, samples, _ = read_revisions(pool, by_address, 0.0)
        tracks = cache_health.assess({}, samples, frozen_after=window)
        progress(f"waiting {window:g}s to read them again (a frozen cache does not move)")
        sleep(window)
        etcd, samples, _ = read_revisions(pool, by_address, window)
        tracks = cache_health.assess(tracks, samples, frozen_after=window)
        progress("listing every replica's pending pods (a cache that misses one is named)")
        listed = dict(zip(sorted(by_address), pool.map(_pending_or_none, [by_address[a] for a in sorted(by_address)])))
    errors = {s.replica: None for s in samples if s.cache_rv is not None}
    # Listed at once and compared as such (no ticks): every pod one lacks and another shows is checked.
    views = {a: ViewState(frozenset(p), current=True) for a, p in listed.items() if p is not None}
    pods = {uid: pod for p in listed.values() if p for uid, pod in p.items()}
    missing: dict[str, list[dict]] = {a: [] for a in by_address}
    for replica, uid in cache_health.missing_suspects(views, {u: 0.0 for u in pods}, now=0.0, missing_after=0.0):
        if tracks.get(replica, CacheTrack()).behind_since is not None:
            continue  # behind etcd: it lags or froze, it does not show new pods yet
        outcome, read, cache_rv = confirm_pod(kube, by_address[replica], pods[uid])
        if outcome == cache_health.MISSING:
            pod = pods[uid]
            missing[replica].append({"namespace": pod.namespace, "name": pod.name, "uid": uid,
                                     "resource_version": read.resource_version, "cache_resource_version": cache_rv})
    out = []
    for a in sorted(by_address):
        t = tracks.get(a, CacheTrack())
        out.append({"replica": a, "cache_revision": t.cache_rv, "etcd_revision": etcd.get(a),
                    "seconds_behind": round(t.seconds_behind(window), 1), "frozen": t.frozen,
                    "answered": a in errors, "pending_listed": a in views, "missing": missing[a]})
    return out


def _pending_or_none(client: ReplicaClient) -> dict[str, PodRef] | None:
    """The pending pods one replica's cache lists (uid -> PodRef), None when it did not answer."""
    try:
        _, items = client.pending_pods()
    except Exception as e:  # one replica's trouble: no claim about it
        log.info("cannot list pending pods on %s: %s", client.replica, str(e)[:200])
        return None
    out = {}
    for obj in items:
        meta = obj.get("metadata") or {}
        if meta.get("uid") and meta.get("name") and is_pending(obj):
            out[meta["uid"]] = PodRef(meta.get("namespace") or "default", meta["name"], meta["uid"])
    return out


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None
