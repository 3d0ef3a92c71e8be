"""The per-replica views: what each apiserver replica's watch cache shows as unscheduled.

Every replica's cache is listed (``resourceVersion=0``, served from its watch cache) every few
seconds, whatever else the guard does (a replica that lost pods' creations may be the very one the
scheduler reads, which then calls no guard), less often as the backlog grows
(``LIST_OBJECTS_PER_SECOND``): a cost per second, not per pod. While the pre-verifier is *active*
(guard.engine.prepare, ``--prepare-idle-after``) one replica is watched instead (the first, by
address, whose cache answers; it moves when that replica stops answering and another answers), and
while no discovered replica answers, the kubeconfig's own server is.

Two readers, neither owning them:

- guard.engine.cache_health compares them for pods a replica's cache lost and frozen replicas
  (:meth:`ReplicaViews.pending_views`), with ``--prepare`` or without;
- guard.engine.prepare, when on, hears each pod a view shows and each one that left it
  (:class:`ViewListener`) to verify new pods ahead and drop verdicts of gone ones, says whether the
  watch runs (:meth:`ViewListener.active`) and sweeps the views for replicas that disagree
  (:meth:`ReplicaViews.disagreements`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import cachetools

from guard import metrics
from guard.core.cache_health import ViewState, lacking_replicas
from guard.core.rendering import format_time
from guard.core.settings import Replica, Settings
from guard.core.verdict import PodRef, is_pending
from guard.engine.background import Background
from guard.engine.replicas import ReplicaPool
from guard.kube.watch import ReplicaClient, WatchExpired

log = logging.getLogger("guard.prepare")

# Seconds between listings of each replica the guard does not watch (at most half --sweep-interval,
# so two sweeps in a row compare fresh views).
LIST_INTERVAL = 3.0
# A listing of N pending pods waits at least N / this many seconds for the next: a replica serving a
# backlog of 10,000 pods is listed every 20 s, not every 3.
LIST_OBJECTS_PER_SECOND = 500
# Listings in flight at once (one per replica; a replica that does not answer holds one thread).
LISTERS = 4
# First sightings remembered at most (for --prepared-max-age).
MAX_SEEN = 500_000


class ViewListener(Protocol):
    """What the views tell the pre-verifier (guard.engine.prepare.Preparer)."""

    def active(self) -> bool:
        """Whether one replica is watched now (else every replica is listed)."""

    def seen(self, pod: PodRef, known_at: int, *, added: bool) -> None:
        """A view shows ``pod`` pending (first shown to the guard at tick ``known_at``); ``added``: new to
        that view (a watch ``ADDED``, or new in a listing)."""

    def gone(self, pod: PodRef) -> None:
        """``pod`` left a view's pending set (deleted, bound or terminating in etcd's event stream)."""

    def round(self) -> None:
        """After each round of the views (every second, or when woken)."""


@dataclass(frozen=True)
class PendingViews:
    """What every replica's view shows, at one moment: per replica its state (guard.core.cache_health.ViewState)
    and its pending pods (uid -> PodRef); per UID shown, the tick at which the guard first saw it
    (``known``) and at which a view showed it leave the pending set (``left``)."""

    views: dict[str, ViewState]
    pods: dict[str, dict[str, PodRef]]
    known: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)


def pod_of(obj: dict) -> tuple[PodRef | None, bool]:
    """(PodRef, schedulable) of a listed or watched pod object."""
    meta = obj.get("metadata") or {}
    uid, name = meta.get("uid"), meta.get("name")
    if not uid or not name:
        return None, False
    pod = PodRef(meta.get("namespace") or "default", name, uid)
    return pod, is_pending(obj)


def pending_pods(items: list[dict]) -> dict[str, PodRef]:
    """uid -> PodRef of the pending pods among listed pod objects, oldest first."""
    pods: dict[str, PodRef] = {}
    for obj in sorted(items, key=_created):
        pod, schedulable = pod_of(obj)
        if pod and schedulable:
            pods[pod.uid] = pod
    return pods


def _created(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("creationTimestamp") or "")


class ReplicaView:
    """What one replica's watch cache says is unscheduled: uid -> PodRef, and its revision.

    Kept current by the guard's one watch (the *watched* replica) or by listing the replica's cache
    every few seconds (every other replica)."""

    def __init__(self, client: ReplicaClient, *, fallback: bool = False) -> None:
        self.client = client
        self.pods: dict[str, PodRef] = {}
        self.resource_version = ""
        self.synced = False
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        # The view's state, for /readyz and ghost_guard_replica_watch_up: starting, synced, retrying.
        self.fallback = fallback  # the kubeconfig's own server, watched while no replica can be read
        self.state = "starting"
        self.error: str | None = None
        self.changed_at = time.time()
        self.watched = False  # the guard's watch runs on this replica now
        self.listing = False  # a listing of it is in flight
        self.listed_at = -1e18  # monotonic time at which its last listing began
        self.as_of = 0  # the tick at which its last listing began (its pods are complete as of then)

    def mark(self, state: str, error: str | None = None) -> None:
        if state != self.state:
            self.state, self.changed_at = state, time.time()
        self.error = error
        if not self.fallback:
            metrics.REPLICA_WATCH_UP.labels(self.client.replica.address).set(1 if state == "synced" else 0)

    def failed(self, e: Exception) -> None:
        self.synced = False
        self.mark("retrying", f"{type(e).__name__}: {str(e)[:200]}")

    def status(self) -> dict:
        return {"state": self.state, "mode": "watch" if self.watched or self.fallback else "list",
                "error": self.error, "since": format_time(self.changed_at), "pods": len(self.pods)}


class ReplicaViews:
    """Every replica's view of unscheduled pods (one per replica of the pool, made and dropped as the
    pool changes), kept by listing or by the one watch, and the tick at which any of them first
    showed each pod. ``tick`` is the verdict cache's clock (guard.engine.checker: a view listed at tick
    T is complete as of T); ``listener`` the pre-verifier, None with ``--no-prepare`` (then nothing
    is watched: every replica is listed)."""

    def __init__(self, settings: Settings, pool: ReplicaPool, tick: Callable[[], int],
                 listener: ViewListener | None = None) -> None:
        self.settings = settings
        self.pool = pool
        self._tick = tick
        self._listener = listener
        self._lock = threading.Lock()
        self._views: dict[str, ReplicaView] = {}
        self._watched: ReplicaView | None = None  # the one view the guard's watch keeps current
        self._fallback: ReplicaView | None = None  # the kubeconfig's server, while no replica can be read
        self._seen: cachetools.TTLCache = cachetools.TTLCache(MAX_SEEN, settings.prepared_max_age)
        # The tick at which a view first showed each identity leave the pending set (etcd has it pending no
        # longer from then on), for comparing views listed at different times (guard.core.cache_health.shown_later).
        self._left: cachetools.TTLCache = cachetools.TTLCache(MAX_SEEN, settings.prepared_max_age)
        self._bg = Background(log)
        self._started = False  # the first round made the views of the replicas known then
        self._wake = threading.Event()
        self._lister = self._bg.pool("ghost-list", LISTERS)
        pool.on_change(self.replicas_changed)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """The views' thread: its first round (at once) makes a view per replica not made yet (discovery
        may take a while: with ``--no-prepare`` never on the worker's start), then one round a second."""
        self._wake.set()
        self._bg.loop("ghost-views", self._round, 1.0, what="managing the replica views", wake=self._wake)

    def close(self) -> None:
        with self._lock:
            views = list(self._views.values())
            if self._fallback is not None:
                views.append(self._fallback)
        for v in views:
            v.stop.set()
        self._bg.close()

    @property
    def stopping(self) -> bool:
        return self._bg.stopping

    def replicas_changed(self, added: list[ReplicaClient], removed: list[ReplicaClient]) -> list[ReplicaView]:
        """The pool's listener (and ``start``): drop the views of removed replicas, make one for each
        added replica. Returns the views made, in the order of ``added``."""
        made = []
        with self._lock:
            for c in removed:
                view = self._views.pop(c.replica.address, None)
                if view:
                    view.stop.set()
                    if view is self._watched:
                        self._watched = None
            for c in added:
                if c.replica.address not in self._views:
                    self._views[c.replica.address] = ReplicaView(c)
                    made.append(self._views[c.replica.address])
        self._wake.set()
        return made

    def _round(self) -> None:
        if not self._started:
            self._started = True
            self.replicas_changed(self.pool.clients(), [])
        self.manage()
        if self._listener is not None:
            self._listener.round()

    def active(self) -> bool:
        return self._listener is not None and self._listener.active()

    # -- one watch, every other replica listed --------------------------------------------------

    def list_interval(self, view: ReplicaView) -> float:
        """Seconds between listings of a replica the guard does not watch: a few seconds (at most half
        ``--sweep-interval``), idle or not (a replica that lost pods' creations may be the one the
        scheduler reads, which then never calls any guard), and never more often than its last
        listing's size allows (``LIST_OBJECTS_PER_SECOND``), so a large backlog is listed rarely."""
        return max(min(LIST_INTERVAL, self.settings.sweep_interval / 2), len(view.pods) / LIST_OBJECTS_PER_SECOND)

    def list_view(self, view: ReplicaView) -> None:
        """List the unscheduled pods of one replica's cache (``resourceVersion=0``) into its view."""
        view.listed_at = time.monotonic()
        as_of = self._tick()
        try:
            rv, items = view.client.pending_pods()
        except Exception as e:
            view.failed(e)
            if not view.watched:
                log.debug("listing unscheduled pods on %s failed: %s", view.client.replica, e)
            raise
        self.apply_listing(view, rv, items, as_of)

    def apply_listing(self, view: ReplicaView, rv: str, items: list[dict], as_of: int) -> None:
        """A replica's unscheduled pods, listed from its cache at tick ``as_of``: the view becomes the
        listing. New pods are seen; a pod the view held that the listing lacks left the replica's
        pending set (deleted, bound or terminating in etcd's event stream: a cache misses events, it
        never invents them), so it is gone."""
        pods = pending_pods(items)
        old, view.pods = view.pods, pods
        view.resource_version, view.synced, view.as_of = rv, True, as_of
        view.mark("synced")
        for uid, pod in old.items():
            if uid not in pods:
                self._gone(pod)
        for uid, pod in pods.items():
            if uid not in old:
                self._shown(pod, added=True)

    def apply_event(self, view: ReplicaView, event: dict) -> None:
        """One watch event from one replica's view of unscheduled pods."""
        kind = event.get("type")
        obj = event.get("object") or {}
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            view.resource_version = str(rv)
        if kind == "BOOKMARK":
            return
        pod, schedulable = pod_of(obj)
        if pod is None:
            return
        if kind == "DELETED" or not schedulable:
            # Gone from etcd's event stream (a stale cache misses events, it never invents them).
            view.pods.pop(pod.uid, None)
            self._gone(pod)
            return
        # ADDED: the name has a new pod (a read of it that began before the guard knew this UID may
        # be of the pod before).
        self._shown(pod, added=kind == "ADDED")
        view.pods[pod.uid] = pod

    def _shown(self, pod: PodRef, *, added: bool) -> None:
        known_at = self.first_seen(pod)
        if self._listener is not None:
            self._listener.seen(pod, known_at, added=added)

    def _gone(self, pod: PodRef) -> None:
        with self._lock:
            if pod not in self._left:
                self._left[pod] = self._tick()
        if self._listener is not None:
            self._listener.gone(pod)

    def first_seen(self, pod: PodRef) -> int:
        """The tick at which any replica first showed this identity (now, if none did before)."""
        with self._lock:
            known_at = self._seen.get(pod)
            if known_at is None:
                known_at = self._seen[pod] = self._tick()  # the guard knows it from here on
            return known_at

    def _watch_loop(self, view: ReplicaView) -> None:
        """The guard's one watch of unscheduled pods, on ``view``'s replica, until told to stop.

        The stop event is this run's own: if the watch comes back to the same replica later, the new
        run gets a new event (``_place_watch``) and this one still ends at its next event."""
        stop = view.stop
        backoff = 0.5
        relist = True
        while not (self._bg.stopping or stop.is_set()):
            try:
                if relist:
                    self.list_view(view)
                    relist = False
                for event in view.client.watch_pending(view.resource_version, timeout_seconds=240):
                    if self._bg.stopping or stop.is_set():
                        return
                    self.apply_event(view, event)
                backoff = 0.5
            except WatchExpired:
                metrics.WATCH_RESTARTS.labels("expired").inc()
                relist = True
            except Exception as e:
                if self._bg.stopping or stop.is_set():
                    return
                metrics.WATCH_RESTARTS.labels("error").inc()
                view.failed(e)
                relist = True
                log.info("watch of unscheduled pods on %s failed (%s: %s); retrying in %.1fs",
                         view.client.replica, type(e).__name__, str(e)[:200], backoff)
                self._wake.set()  # another replica may be watched instead
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def manage(self) -> None:
        """Keep the replica set current (discovery is due-checked), run the watch while active (on a
        replica whose cache answers, else through the kubeconfig's server), list the other replicas
        when due."""
        active = self.active()
        self.pool.clients()
        with self._lock:
            views = dict(sorted(self._views.items()))
            watched = self._watched
        if active:
            self._place_watch(views, watched)
        else:
            self._stop_watch()
        self._fallback_check(active)
        now = time.monotonic()
        for view in views.values():
            if view is not self._watched and not view.listing and now - view.listed_at >= self.list_interval(view):
                self._submit_listing(view)

    def _submit_listing(self, view: ReplicaView) -> None:
        view.listing = True

        def run() -> None:
            try:
                self.list_view(view)
            except Exception:
                pass  # the view says retrying, with the error
            finally:
                view.listing = False

        try:
            self._lister.submit(run)
        except RuntimeError:  # shutting down
            view.listing = False

    def _place_watch(self, views: dict[str, ReplicaView], watched: ReplicaView | None) -> None:
        """The watch runs on the first replica (by address) whose cache answers; it moves when its
        replica stops answering while another one does."""
        if watched is not None and (watched.state != "retrying" or not any(
                v.state == "synced" for v in views.values() if v is not watched)):
            return
        target = next((v for v in views.values() if v.state == "synced"), None)
        if target is None and watched is None:
            target = next(iter(views.values()), None)  # nothing listed yet: try the first
        if target is None or target is watched:
            return
        if watched is not None:
            log.info("watch of unscheduled pods moves from %s (%s) to %s", watched.client.replica,
                     watched.error, target.client.replica)
            self._end_watch(watched)
        target.stop = threading.Event()
        target.watched = True
        with self._lock:
            self._watched = target
        target.thread = self._bg.thread(f"ghost-watch-{target.client.replica.address}", self._watch_loop, target)

    def _end_watch(self, view: ReplicaView) -> None:
        view.stop.set()  # its thread ends at its next event or the watch's timeout
        view.watched = False
        view.listed_at = -1e18  # listed again at once: the watch no longer keeps it current

    def _stop_watch(self) -> None:
        """Idle: no watch (every replica's view is listed)."""
        with self._lock:
            watched, self._watched = self._watched, None
        if watched is not None:
            self._end_watch(watched)
            log.info("no scheduler call for %gs: stopped watching unscheduled pods on %s; only listing every "
                     "replica", self.settings.prepare_idle_after, watched.client.replica)

    # -- when no replica can be watched: the kubeconfig's own server ---------------------------

    def _fallback_check(self, active: bool) -> None:
        """While active, watch through the kubeconfig's server while no discovered replica's cache
        answers, so pre-verification never silently stops; say so once when it starts and once when
        it ends."""
        with self._lock:
            views = list(self._views.values())
            fallback = self._fallback
        if fallback is None and active and all(v.state == "retrying" for v in views):
            kube = self.pool.kube
            host = kube.host or ""
            client = ReplicaClient(kube.configuration, Replica(urlsplit(host).netloc or host, host),
                                   server_name=getattr(kube.configuration, "tls_server_name", None),
                                   timeout=self.settings.probe_timeout)
            view = ReplicaView(client, fallback=True)
            with self._lock:
                self._fallback = view
            metrics.WATCH_FALLBACK.set(1)
            log.warning("no apiserver replica can be watched (%s); pre-verifying through the kubeconfig's server %s "
                        "until one can", "; ".join(f"{v.client.replica}: {v.error}" for v in views)[:500]
                        or "none discovered", host)
            view.thread = self._bg.thread("ghost-watch-fallback", self._watch_loop, view)
        elif fallback is not None and (not active or any(v.state == "synced" for v in views)):
            with self._lock:
                self._fallback = None
            fallback.stop.set()  # its thread ends at its next event or the watch's timeout
            fallback.client.close()
            metrics.WATCH_FALLBACK.set(0)
            if active:
                log.warning("apiserver replica %s watched again; stopped pre-verifying through the kubeconfig's "
                            "server", ", ".join(str(v.client.replica) for v in views if v.state == "synced"))

    # -- what the views say ---------------------------------------------------------------------

    def disagreements(self) -> list[PodRef]:
        """Pods some synced replica shows as unscheduled later than another synced replica is known to
        lack them (guard.core.cache_health.shown_later): a replica merely listed before the pod existed
        disagrees with no one, and neither does one listed before the pod was bound or deleted."""
        snapshot = self.pending_views()
        views = {a: v for a, v in snapshot.views.items() if v.synced}
        if len(views) < 2:
            return []
        listed: dict[str, PodRef] = {}
        for a in views:
            listed.update(snapshot.pods[a])
        return [pod for uid, pod in listed.items()
                if lacking_replicas(views, uid, known=snapshot.known.get(uid), left=snapshot.left.get(uid))]

    def knows(self, pod: PodRef) -> bool:
        """Whether some replica's cache showed this identity pending to this guard (its watch or a
        listing, within --prepared-max-age, or the view still lists it): a pod that really existed."""
        with self._lock:
            if pod in self._seen:
                return True
            views = list(self._views.values())
            if self._fallback is not None:
                views.append(self._fallback)
        return any(v.pods.get(pod.uid) == pod for v in views)

    def pending_views(self) -> PendingViews:
        """Per replica (the kubeconfig-server fallback excluded) its view's state and a copy of the pending
        pods it shows, with the ticks at which the guard first saw each of those pods and at which one
        left a view. Read by guard.engine.cache_health and :meth:`disagreements`."""
        with self._lock:
            views = dict(self._views)
            states = {a: ViewState(frozenset(v.pods), synced=v.synced, current=v.watched, as_of=v.as_of)
                      for a, v in views.items()}
            pods = {a: dict(v.pods) for a, v in views.items()}
            # The ticks only of the pods that some synced view lacks (nearly always none: a lookup each
            # would cost a backlog of 10,000 pods some 30 ms a second).
            synced = [states[a].uids for a in states if states[a].synced]
            doubtful = set().union(*synced).difference(set(synced[0]).intersection(*synced[1:])) if len(synced) > 1 else set()
            known: dict[str, int] = {}
            left: dict[str, int] = {}
            for shown in pods.values():
                for uid in doubtful.intersection(shown):
                    pod = shown[uid]
                    if (tick := self._seen.get(pod)) is not None:
                        known[uid] = tick
                    if (tick := self._left.get(pod)) is not None:
                        left[uid] = tick
        return PendingViews(states, pods, known, left)

    def watch_status(self) -> dict:
        """Per replica, its view's state (watched or listed); and the kubeconfig-server fallback's, while
        it runs (/readyz)."""
        with self._lock:
            views = dict(self._views)
            fallback = self._fallback
        return {"replicas": {address: v.status() for address, v in sorted(views.items())},
                "fallback": None if fallback is None else {"server": self.pool.kube.host, **fallback.status()}}
