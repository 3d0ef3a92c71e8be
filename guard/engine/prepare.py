"""Pre-verification: verdicts ready before kube-scheduler asks.

kube-scheduler calls the extender inside its serial scheduling cycle, so a
quorum GET there costs the whole cluster throughput. The guard therefore
watches unscheduled pods (``fieldSelector=spec.nodeName=``) itself, like an
informer, and quorum-verifies each newly seen pod UID in the background
(bounded concurrency, rate limited). The ``alive`` verdict then waits in the
cache for the pod's first ``/filter`` or ``/preempt`` call (guard.engine.cache).

What it costs the control plane is one watch stream for the whole cluster,
whatever the number of apiserver and guard replicas:

- **One watch, only while called.** Only the guard replica being asked
  verifies ahead (``--prepare-idle-after``, 60 s): the Deployment runs two
  guards and the sidecar mode one per control-plane node, but only the one the
  leading scheduler's connection reaches is called. That guard watches *one*
  apiserver replica (the first, by address, whose cache answers; it moves when
  that replica stops answering and another answers). A guard with no
  scheduler call (``/filter``, ``/preempt``, ``/validate/binding``:
  ``Checker.check``) within that time is *idle*: no watch, no quorum GET for
  new pods.
- **Every replica listed.** The per-replica views (the sweep below, and the
  missing-pod and frozen-replica checks of guard.engine.cache_health) come from
  listing each other replica's cache (``resourceVersion=0``, served from its
  watch cache) every few seconds, idle or not (a replica that lost pods'
  creations may be the very one the scheduler reads, which then calls no
  guard), less often as the backlog grows (``LIST_OBJECTS_PER_SECOND``): a
  cost per second, not per pod.
- A ``DELETED`` (or a ``deletionTimestamp``) seen by the watch, or a pod that
  left a replica's listing, drops the prepared verdict at once.
- The first call after idle (a *takeover*, also the first call after start) is
  answered inline, as any call without a prepared verdict, and queues the
  pending pods the idle listings showed (oldest first, the scheduler's own
  order) for background verification; the watch then starts with a listing of
  its replica, which queues whatever is newer. A backlog finds its verdicts
  ready again after the first few calls.
- The views are also the sweeper: every ``--sweep-interval`` they are
  compared; a UID that one replica still shows while another, complete view
  does not is verified again (rate limited). A ghost found that way is
  recorded and attributed before any scheduler is stuck on it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import cachetools

from guard import metrics
from guard.engine.checker import Checker
from guard.kube.client import ReplicaClient, WatchExpired
from guard.engine.replicas import ReplicaPool
from guard.core.rendering import format_time
from guard.core.settings import Replica, Settings
from guard.core.verdict import PodRef, is_pending

log = logging.getLogger("guard.prepare")

# Pods waiting for background verification at most (a re-list of a huge backlog is rate limited).
MAX_QUEUE = 100_000
# Seconds between listings of each replica the guard does not watch (at most half --sweep-interval,
# so two sweeps in a row compare fresh views).
LIST_INTERVAL = 3.0
# A listing of N pending pods waits at least N / this many seconds for the next: a replica serving a
# backlog of 10,000 pods is listed every 20 s, not every 3.
LIST_OBJECTS_PER_SECOND = 500
# Listings in flight at once (one per replica; a replica that does not answer holds one thread).
LISTERS = 4


class RateLimiter:
    """Token bucket: at most ``rate`` acquisitions per second, bursts up to ``rate``."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
                self._at = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                wait = (1 - self._tokens) / self.rate
            time.sleep(wait)


def _pod_of(obj: dict) -> tuple[PodRef | None, bool]:
    """(PodRef, schedulable) of a watched pod object."""
    meta = obj.get("metadata") or {}
    uid, name = meta.get("uid"), meta.get("name")
    if not uid or not name:
        return None, False
    pod = PodRef(meta.get("namespace") or "default", name, uid)
    return pod, is_pending(obj)


_WAKE = None  # in the verify queue: wakes a verifier for a takeover or the end


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

    def status(self) -> dict:
        return {"state": self.state, "mode": "watch" if self.watched or self.fallback else "list",
                "error": self.error, "since": format_time(self.changed_at), "pods": len(self.pods)}


def _created(obj: dict) -> str:
    return str((obj.get("metadata") or {}).get("creationTimestamp") or "")


class Preparer:
    def __init__(self, settings: Settings, pool: ReplicaPool, checker: Checker,
                 sweep_hooks: list[Callable[[], None]] | None = None,
                 timer: Callable[[], float] | None = None) -> None:
        self.settings = settings
        self._timer = timer or checker.timer
        self.sweep_hooks = sweep_hooks or []
        self.pool = pool
        self.checker = checker
        self._limiter = RateLimiter(settings.verify_qps)
        # (pod, from a sweep, the tick at which the guard knew it), or _WAKE. A SimpleQueue: the
        # hand-off from the watch to a waiting verifier is done in C (a Condition's was ~10 us more).
        self._queue: queue.SimpleQueue[tuple[PodRef, bool, int] | None] = queue.SimpleQueue()
        self._seen: cachetools.TTLCache = cachetools.TTLCache(500_000, settings.prepared_max_age)
        self._lock = threading.Lock()
        self._views: dict[str, ReplicaView] = {}
        self._watched: ReplicaView | None = None  # the one view the guard's watch keeps current
        self._suspects: set[PodRef] = set()
        self._fallback: ReplicaView | None = None  # the kubeconfig's server, while no replica can be read
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lister: ThreadPoolExecutor | None = None
        # Idle or active (--prepare-idle-after): when a scheduler call last arrived (None: never),
        # whether a takeover waits for a verification thread, and the pods seen while idle
        # (pod -> the tick at which the guard knew it), in the order they were seen.
        self._last_call: float | None = None
        self._takeover = False
        self._backlog: dict[PodRef, int] = {}
        self._queued: cachetools.TTLCache = cachetools.TTLCache(500_000, settings.prepared_max_age)
        self.takeovers = 0
        checker.call_hooks.append(self.called)
        pool.on_change(self.replicas_changed)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        metrics.PREPARE_ACTIVE.set(1 if self.active() else 0)
        self._lister = ThreadPoolExecutor(max_workers=LISTERS, thread_name_prefix="ghost-list")
        for i in range(self.settings.verify_concurrency):
            self._spawn(self._verify_loop, f"ghost-verify-{i}")
        self.replicas_changed(self.pool.clients(), [])
        self._spawn(self._manage_loop, "ghost-views")

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            views = list(self._views.values())
            if self._fallback is not None:
                views.append(self._fallback)
        for v in views:
            v.stop.set()
        for _ in range(self.settings.verify_concurrency):
            self._queue.put(_WAKE)
        if self._lister is not None:
            self._lister.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, target, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

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

    # -- the views: one watch, every other replica listed --------------------------------------

    def list_interval(self, view: ReplicaView) -> float:
        """Seconds between listings of a replica the guard does not watch: a few seconds (at most half
        ``--sweep-interval``), idle or not (a replica that lost pods' creations may be the one the
        scheduler reads, which then never calls any guard), and never more often than its last
        listing's size allows (``LIST_OBJECTS_PER_SECOND``), so a large backlog is listed rarely."""
        return max(min(LIST_INTERVAL, self.settings.sweep_interval / 2), len(view.pods) / LIST_OBJECTS_PER_SECOND)

    def list_view(self, view: ReplicaView) -> None:
        """List the unscheduled pods of one replica's cache (``resourceVersion=0``) into its view."""
        view.listed_at = time.monotonic()
        as_of = self.checker.cache.tick()
        try:
            rv, items = view.client.pending_pods()
        except Exception as e:
            view.synced = False
            view.mark("retrying", f"{type(e).__name__}: {str(e)[:200]}")
            if not view.watched:
                log.debug("listing unscheduled pods on %s failed: %s", view.client.replica, e)
            raise
        self.apply_listing(view, rv, items, as_of)

    def apply_listing(self, view: ReplicaView, rv: str, items: list[dict], as_of: int) -> None:
        """A replica's unscheduled pods, listed from its cache at tick ``as_of``: the view becomes the
        listing. New pods are seen (queued for verification, oldest first, while active); a pod the
        view held that the listing lacks left the replica's pending set (deleted, bound or terminating
        in etcd's event stream: a cache misses events, it never invents them), so it is gone."""
        pods: dict[str, PodRef] = {}
        for obj in sorted(items, key=_created):
            pod, schedulable = _pod_of(obj)
            if pod and schedulable:
                pods[pod.uid] = pod
        old, view.pods = view.pods, pods
        view.resource_version, view.synced, view.as_of = rv, True, as_of
        view.mark("synced")
        for uid, pod in old.items():
            if uid not in pods:
                self._gone(pod)
        for uid, pod in pods.items():
            if uid not in old:
                known_at = self._seen_pod(pod)
                self.checker.cache.invalidate_name(pod.namespace, pod.name, before=known_at)

    def _watch_loop(self, view: ReplicaView) -> None:
        """The guard's one watch of unscheduled pods, on ``view``'s replica, until told to stop.

        The stop event is this run's own: if the watch comes back to the same replica later, the new
        run gets a new event (``_place_watch``) and this one still ends at its next event."""
        stop = view.stop
        backoff = 0.5
        relist = True
        while not (self._stop.is_set() or stop.is_set()):
            try:
                if relist:
                    self.list_view(view)
                    relist = False
                for event in view.client.watch_pending(view.resource_version, timeout_seconds=240):
                    if self._stop.is_set() or stop.is_set():
                        return
                    self.apply_event(view, event)
                backoff = 0.5
            except WatchExpired:
                metrics.WATCH_RESTARTS.labels("expired").inc()
                relist = True
            except Exception as e:
                metrics.WATCH_RESTARTS.labels("error").inc()
                view.synced = False
                view.mark("retrying", f"{type(e).__name__}: {str(e)[:200]}")
                relist = True
                log.info("watch of unscheduled pods on %s failed (%s: %s); retrying in %.1fs",
                         view.client.replica, type(e).__name__, str(e)[:200], backoff)
                self._wake.set()  # another replica may be watched instead
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _manage_loop(self) -> None:
        """Each second (or when woken): the watch, the listings due, the sweep, discovery."""
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.manage()
                if time.monotonic() - last_sweep >= self.settings.sweep_interval:
                    last_sweep = time.monotonic()
                    self.sweep()
                    for hook in self.sweep_hooks:
                        hook()
            except Exception:
                log.exception("managing the replica views failed")

    def manage(self) -> None:
        """Keep the replica set current (discovery is due-checked), run the watch while active (on a
        replica whose cache answers, else through the kubeconfig's server), list the other replicas
        when due."""
        active = self.active()
        metrics.PREPARE_ACTIVE.set(1 if active else 0)
        metrics.PREPARE_BACKLOG.set(len(self._backlog))
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
        if self._lister is None:
            return
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
        target.thread = self._spawn(self._watch_loop, f"ghost-watch-{target.client.replica.address}", target)

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

    def apply_event(self, view: ReplicaView, event: dict) -> None:
        """One watch event from one replica's view of unscheduled pods."""
        kind = event.get("type")
        obj = event.get("object") or {}
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if rv:
            view.resource_version = str(rv)
        if kind == "BOOKMARK":
            return
        pod, schedulable = _pod_of(obj)
        if pod is None:
            return
        if kind == "DELETED" or not schedulable:
            # Gone from etcd's event stream (a stale cache misses events, it never invents them):
            # no verdict may call this identity alive, and the name's cached reads are dropped.
            view.pods.pop(pod.uid, None)
            self._gone(pod)
            return
        known_at = self._seen_pod(pod)
        if kind == "ADDED":
            # The name has a new pod: a read of it that began before the guard knew this UID may be
            # of the pod before. Later replicas' ADDED for the same UID leave newer reads alone.
            self.checker.cache.invalidate_name(pod.namespace, pod.name, before=known_at)
        view.pods[pod.uid] = pod

    def _gone(self, pod: PodRef) -> None:
        self.checker.cache.gone(pod)
        if self._backlog:
            with self._lock:
                self._backlog.pop(pod, None)

    # -- verification -------------------------------------------------------------------

    def _seen_pod(self, pod: PodRef) -> int:
        """The tick at which any replica first showed this identity. While active, a pod not yet
        queued is queued for verification; while idle it is kept for the next takeover."""
        with self._lock:
            known_at = self._seen.get(pod)
            if known_at is None:
                known_at = self._seen[pod] = self.checker.cache.tick()  # the guard knows it from here on
            if pod in self._queued:
                return known_at
            if not self.active():
                if pod not in self._backlog:
                    if len(self._backlog) >= MAX_QUEUE:  # its first call verifies inline
                        metrics.PREPARE_DROPPED.inc()
                    else:
                        self._backlog[pod] = known_at
                        metrics.PREPARE_DEFERRED.inc()
                return known_at
            self._backlog.pop(pod, None)
            self._queued[pod] = True
        self._enqueue(pod, swept=False, known_at=known_at)
        return known_at

    # -- idle or active (--prepare-idle-after) ----------------------------------------------

    def active(self) -> bool:
        """Whether this guard verifies new pods ahead: a scheduler call arrived within
        ``--prepare-idle-after`` (always, when that is 0)."""
        idle_after = self.settings.prepare_idle_after
        if idle_after <= 0:
            return True
        last = self._last_call
        return last is not None and self._timer() - last < idle_after

    def called(self) -> None:
        """A scheduler call reached this guard (Checker.check, before its verdict). The first one
        after idle is a takeover: a verification thread queues the backlog (:meth:`verify_next`),
        off the call's path; the call itself is answered inline if no verdict is prepared."""
        now = self._timer()
        last, self._last_call = self._last_call, now
        idle_after = self.settings.prepare_idle_after
        if idle_after > 0 and (last is None or now - last >= idle_after):
            self._takeover = True
            self._queue.put(_WAKE)
            metrics.PREPARE_ACTIVE.set(1)

    def _take_backlog(self) -> int:
        """Queue the pods seen while idle, oldest first (kube-scheduler's queue order for equal
        priorities). Pods that are gone were dropped from the backlog by the listings."""
        with self._lock:
            backlog = sorted(self._backlog.items(), key=lambda item: item[1])
            self._backlog.clear()
            for pod, _ in backlog:
                self._queued[pod] = True
            self.takeovers += 1
        metrics.PREPARE_TAKEOVERS.inc()
        for pod, known_at in backlog:
            self._enqueue(pod, swept=False, known_at=known_at)
        log.info("scheduler calls arrived after an idle spell: verifying ahead again, %d pending pod(s) the "
                 "listings hold queued for background verification", len(backlog))
        return len(backlog)

    def idle_status(self) -> dict:
        """For /readyz: whether verifying ahead, since when the last call came, the backlog."""
        last = self._last_call
        return {"active": self.active(), "idle_after": self.settings.prepare_idle_after,
                "last_call_seconds_ago": None if last is None else round(self._timer() - last, 3),
                "backlog": len(self._backlog), "queued": self._queue.qsize(), "takeovers": self.takeovers}

    def _enqueue(self, pod: PodRef, *, swept: bool, known_at: int | None = None) -> None:
        if known_at is None:
            known_at = self.checker.cache.tick()
        if self._queue.qsize() >= MAX_QUEUE:  # the scheduler's call still verifies inline
            metrics.PREPARE_DROPPED.inc()
            return
        self._queue.put((pod, swept, known_at))

    def _claim_takeover(self) -> bool:
        """Whether a takeover is due, claimed for this thread (one thread queues the backlog)."""
        if not self._takeover:
            return False
        with self._lock:
            takeover, self._takeover = self._takeover, False
        return takeover

    def _verify_loop(self) -> None:
        while not self._stop.is_set():
            self.verify_next(wait=1.0)

    def verify_next(self, *, wait: float = 0.0) -> bool:
        """Verify the next queued pod (waiting up to ``wait`` seconds for one), after queueing the
        backlog when a takeover is due. False if there was none."""
        if self._claim_takeover():
            self._take_backlog()
        try:
            item = self._queue.get(timeout=wait) if wait > 0 and not self._stop.is_set() else self._queue.get_nowait()
            if item is _WAKE:  # a takeover to do, or the end
                if self._claim_takeover():
                    self._take_backlog()
                item = self._queue.get_nowait()
        except queue.Empty:
            return False
        if item is _WAKE or self._stop.is_set():
            return False
        pod, swept, known_at = item
        self._limiter.acquire()
        try:
            # A new pod gets a prepared verdict for its first attempt. A ghost found then is
            # usually a pod deleted before its turn came: cached, not announced. One found by
            # the sweep (a replica has kept listing it) is a stale cache: announced.
            decision = self.checker.verify(pod, known_at, prepare=not swept)
            if decision is not None and decision.is_ghost and swept:
                self.checker.announce(pod)
        except Exception:
            log.exception("background verification of %s failed", pod)
        return True

    # -- the sweep --------------------------------------------------------------------------

    def disagreements(self) -> list[PodRef]:
        """Pods some replica shows as unscheduled while another synced replica does not, although the
        guard knew the pod before that replica's view was last complete (its listing began, or it is
        the watched one): a replica merely listed before the pod existed disagrees with no one."""
        with self._lock:
            views = [v for v in self._views.values() if v.synced]
            seen = {pod: self._seen.get(pod) for v in views for pod in v.pods.values()}
        if len(views) < 2:
            return []
        listed: dict[str, PodRef] = {}
        for v in views:
            listed.update(v.pods)

        def lacks(v: ReplicaView, uid: str, pod: PodRef) -> bool:
            if uid in v.pods:
                return False
            known = seen.get(pod)
            return v.watched or (known is not None and known < v.as_of)

        return [pod for uid, pod in listed.items() if any(lacks(v, uid, pod) for v in views)]

    def sweep(self) -> list[PodRef]:
        """Verify the pods on which replicas disagreed in this sweep *and* the previous one.

        Requiring two sweeps in a row keeps mere watch lag (milliseconds) from
        looking like a stale cache.
        """
        current = set(self.disagreements())
        persistent = [pod for pod in current if pod in self._suspects]
        self._suspects = current
        queued = []
        for pod in persistent:
            if self.checker.cache.ghost(pod) is None:
                self._enqueue(pod, swept=True)
                queued.append(pod)
            else:
                self.checker.announce(pod)  # verified as gone before, and a replica still lists it
        return queued

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
            view.thread = self._spawn(self._watch_loop, "ghost-watch-fallback", view)
        elif fallback is not None and (not active or any(v.state == "synced" for v in views)):
            with self._lock:
                self._fallback = None
            fallback.stop.set()  # its thread ends at its next event or the watch's timeout
            fallback.client.close()
            metrics.WATCH_FALLBACK.set(0)
            if active:
                log.warning("apiserver replica %s watched again; stopped pre-verifying through the kubeconfig's "
                            "server", ", ".join(str(v.client.replica) for v in views if v.state == "synced"))

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

    def pending_views(self) -> dict[str, tuple[bool, dict[str, PodRef]]]:
        """Per replica (the kubeconfig-server fallback excluded): whether its view is synced, and a
        copy of the pending pods it shows (uid -> PodRef). Read by guard.engine.cache_health."""
        with self._lock:
            views = dict(self._views)
        return {address: (v.synced, dict(v.pods)) for address, v in views.items()}

    def watch_status(self) -> dict:
        """Per replica, its view's state (watched or listed); and the kubeconfig-server fallback's, while
        it runs (/readyz)."""
        with self._lock:
            views = dict(self._views)
            fallback = self._fallback
        return {"replicas": {address: v.status() for address, v in sorted(views.items())},
                "fallback": None if fallback is None else {"server": self.pool.kube.host, **fallback.status()}}
