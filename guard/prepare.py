"""Pre-verification: verdicts ready before kube-scheduler asks.

kube-scheduler calls the extender inside its serial scheduling cycle, so a
quorum GET there costs the whole cluster throughput. The guard therefore
watches unscheduled pods (``fieldSelector=spec.nodeName=``) on **every**
apiserver replica itself, like an informer per replica, and quorum-verifies
each newly seen pod UID in the background (bounded concurrency, rate
limited). The ``alive`` verdict then waits in the cache for the pod's first
``/filter`` or ``/preempt`` call (guard.cache).

- A ``DELETED`` (or a ``deletionTimestamp``) seen on *any* replica drops the
  prepared verdict at once.
- Only the guard replica being asked verifies ahead (``--prepare-idle-after``,
  60 s): the Deployment runs two guards and the sidecar mode one per
  control-plane node, but only the one the leading scheduler's connection
  reaches is called. A guard with no scheduler call (``/filter``,
  ``/preempt``, ``/validate/binding``: ``Checker.check``) within that time is
  *idle*: its watches keep running (gone marks, invalidation, the per-replica
  views of guard.cache_health) and it remembers the new pending pods, but
  makes no quorum GET for them. The first call after idle (a *takeover*, also
  the first call after start) is answered inline, as any call without a
  prepared verdict, and queues the pending pods the watch holds (oldest
  first, the scheduler's own order) for background verification, so a
  backlog finds its verdicts ready again after the first few calls.
- The watch is also the sweeper: every ``--sweep-interval`` the per-replica
  views are compared; a UID that one replica still lists while another,
  caught-up replica does not is verified again (rate limited). A ghost found
  that way is recorded and attributed before any scheduler is stuck on it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import cachetools

from guard import metrics
from guard.verdict import is_pending
from guard.check import Checker
from guard.kube import ReplicaClient, WatchExpired
from guard.replicas import ReplicaPool
from guard.report import format_time
from guard.settings import Replica, Settings
from guard.verdict import PodRef

log = logging.getLogger(__name__)

# Pods waiting for background verification at most (a re-list of a huge backlog is rate limited).
MAX_QUEUE = 100_000


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


class ReplicaView:
    """What one replica's watch cache says is unscheduled: uid -> PodRef, and its revision."""

    def __init__(self, client: ReplicaClient, *, fallback: bool = False) -> None:
        self.client = client
        self.pods: dict[str, PodRef] = {}
        self.resource_version = ""
        self.synced = False
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        # The watch's state, for /readyz and ghost_guard_replica_watch_up: starting, synced, retrying.
        self.fallback = fallback  # the kubeconfig's own server, watched while no replica can be
        self.state = "starting"
        self.error: str | None = None
        self.changed_at = time.time()

    def mark(self, state: str, error: str | None = None) -> None:
        if state != self.state:
            self.state, self.changed_at = state, time.time()
        self.error = error
        if not self.fallback:
            metrics.REPLICA_WATCH_UP.labels(self.client.replica.address).set(1 if state == "synced" else 0)

    def status(self) -> dict:
        return {"state": self.state, "error": self.error, "since": format_time(self.changed_at), "pods": len(self.pods)}


class Preverifier:
    def __init__(self, settings: Settings, pool: ReplicaPool, checker: Checker,
                 sweep_hooks: list[Callable[[], None]] | None = None,
                 timer: Callable[[], float] | None = None) -> None:
        self.settings = settings
        self._timer = timer or checker.timer
        self.sweep_hooks = sweep_hooks or []
        self.pool = pool
        self.checker = checker
        self._limiter = RateLimiter(settings.verify_qps)
        # (pod, from a sweep, the tick at which the guard knew it)
        self._queue: collections.deque[tuple[PodRef, bool, int]] = collections.deque()
        self._queue_cond = threading.Condition()
        self._seen: cachetools.TTLCache = cachetools.TTLCache(500_000, settings.prepared_max_age)
        self._lock = threading.Lock()
        self._views: dict[str, ReplicaView] = {}
        self._suspects: set[PodRef] = set()
        self._fallback: ReplicaView | None = None  # the kubeconfig's server, while no replica can be watched
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # Idle or active (--prepare-idle-after): when a scheduler call last arrived (None: never),
        # whether a takeover waits for a verification thread, and the pods seen while idle
        # (pod -> the tick at which the guard knew it), in the order they were seen.
        self._last_call: float | None = None
        self._takeover = False
        self._backlog: dict[PodRef, int] = {}
        self._queued: cachetools.TTLCache = cachetools.TTLCache(500_000, settings.prepared_max_age)
        self.takeovers = 0
        checker.call_hooks.append(self.called)
        pool.on_change(self._replicas_changed)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        metrics.PREVERIFY_ACTIVE.set(1 if self.active() else 0)
        for i in range(self.settings.verify_concurrency):
            self._spawn(self._verify_loop, f"ghost-verify-{i}")
        self._spawn(self._sweep_loop, "ghost-sweep")
        self._replicas_changed(self.pool.clients(), [])

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            views = list(self._views.values())
        for v in views:
            v.stop.set()
        with self._queue_cond:
            self._queue_cond.notify_all()

    def _spawn(self, target, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _replicas_changed(self, added: list[ReplicaClient], removed: list[ReplicaClient]) -> None:
        with self._lock:
            for c in removed:
                view = self._views.pop(c.replica.address, None)
                if view:
                    view.stop.set()
            for c in added:
                if c.replica.address in self._views:
                    continue
                view = ReplicaView(c)
                self._views[c.replica.address] = view
                view.thread = self._spawn(self._watch_loop, f"ghost-watch-{c.replica.address}", view)

    # -- the watch (one per replica) --------------------------------------------------

    def _watch_loop(self, view: ReplicaView) -> None:
        backoff = 0.5
        relist = True
        while not (self._stop.is_set() or view.stop.is_set()):
            try:
                if relist:
                    rv, items = view.client.pending_pods()
                    pods = {}
                    for obj in items:
                        pod, schedulable = _pod_of(obj)
                        if pod and schedulable:
                            pods[pod.uid] = pod
                            self._seen_pod(pod)
                    view.pods, view.resource_version, view.synced, relist = pods, rv, True, False
                    view.mark("synced")
                for event in view.client.watch_pending(view.resource_version, timeout_seconds=240):
                    if self._stop.is_set() or view.stop.is_set():
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
                view.stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

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
            self.checker.cache.gone(pod)
            if self._backlog:
                with self._lock:
                    self._backlog.pop(pod, None)
            return
        known_at = self._seen_pod(pod)
        if kind == "ADDED":
            # The name has a new pod: a read of it that began before the guard knew this UID may be
            # of the pod before. Later replicas' ADDED for the same UID leave newer reads alone.
            self.checker.cache.invalidate_name(pod.namespace, pod.name, before=known_at)
        view.pods[pod.uid] = pod

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
                        metrics.PREVERIFY_DROPPED.inc()
                    else:
                        self._backlog[pod] = known_at
                        metrics.PREVERIFY_DEFERRED.inc()
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
            with self._queue_cond:
                self._takeover = True
                self._queue_cond.notify()
            metrics.PREVERIFY_ACTIVE.set(1)

    def _take_backlog(self) -> int:
        """Queue the pods seen while idle, oldest first (kube-scheduler's queue order for equal
        priorities). Pods that are gone were dropped from the backlog by the watch."""
        with self._lock:
            backlog = sorted(self._backlog.items(), key=lambda item: item[1])
            self._backlog.clear()
            for pod, _ in backlog:
                self._queued[pod] = True
            self.takeovers += 1
        metrics.PREVERIFY_TAKEOVERS.inc()
        for pod, known_at in backlog:
            self._enqueue(pod, swept=False, known_at=known_at)
        log.info("scheduler calls arrived after an idle spell: verifying ahead again, %d pending pod(s) the "
                 "watch holds queued for background verification", len(backlog))
        return len(backlog)

    def idle_status(self) -> dict:
        """For /readyz: whether verifying ahead, since when the last call came, the backlog."""
        last = self._last_call
        return {"active": self.active(), "idle_after": self.settings.prepare_idle_after,
                "last_call_seconds_ago": None if last is None else round(self._timer() - last, 3),
                "backlog": len(self._backlog), "queued": len(self._queue), "takeovers": self.takeovers}

    def _enqueue(self, pod: PodRef, *, swept: bool, known_at: int | None = None) -> None:
        if known_at is None:
            known_at = self.checker.cache.tick()
        with self._queue_cond:
            if len(self._queue) >= MAX_QUEUE:  # the scheduler's call still verifies inline
                metrics.PREVERIFY_DROPPED.inc()
                return
            self._queue.append((pod, swept, known_at))
            self._queue_cond.notify()

    def _verify_loop(self) -> None:
        while not self._stop.is_set():
            self.verify_next(wait=1.0)

    def verify_next(self, *, wait: float = 0.0) -> bool:
        """Verify the next queued pod (waiting up to ``wait`` seconds for one), after queueing the
        backlog when a takeover is due. False if there was none."""
        with self._queue_cond:
            if not self._queue and not self._takeover and wait > 0 and not self._stop.is_set():
                self._queue_cond.wait(wait)
            takeover, self._takeover = self._takeover, False
        if takeover:
            self._take_backlog()
        with self._queue_cond:
            if not self._queue or self._stop.is_set():
                return False
            pod, swept, known_at = self._queue.popleft()
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
        """Pods some replica lists as unscheduled while another synced replica does not."""
        with self._lock:
            views = [v for v in self._views.values() if v.synced]
        if len(views) < 2:
            return []
        listed: dict[str, PodRef] = {}
        for v in views:
            listed.update(v.pods)
        return [pod for uid, pod in listed.items() if any(uid not in v.pods for v in views)]

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

    def _sweep_loop(self) -> None:
        """Keeps the replica set current (discovery is due-checked each second) and sweeps."""
        last_sweep = time.monotonic()
        while not self._stop.wait(1.0):
            try:
                metrics.PREVERIFY_ACTIVE.set(1 if self.active() else 0)
                metrics.PREVERIFY_BACKLOG.set(len(self._backlog))
                self.pool.clients()
                self._fallback_check()
                if time.monotonic() - last_sweep >= self.settings.sweep_interval:
                    last_sweep = time.monotonic()
                    self.sweep()
                    for hook in self.sweep_hooks:
                        hook()
            except Exception:
                log.exception("sweep failed")

    # -- when no replica can be watched: the kubeconfig's own server ---------------------------

    def _fallback_check(self) -> None:
        """Watch through the kubeconfig's server while no discovered replica can be watched, so
        pre-verification never silently stops; say so once when it starts and once when it ends."""
        with self._lock:
            views = list(self._views.values())
            fallback = self._fallback
        if fallback is None and all(v.state == "retrying" for v in views):
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
        elif fallback is not None and any(v.state == "synced" for v in views):
            with self._lock:
                self._fallback = None
            fallback.stop.set()  # its thread ends at its next event or the watch's timeout
            fallback.client.close()
            metrics.WATCH_FALLBACK.set(0)
            log.warning("apiserver replica %s watched again; stopped pre-verifying through the kubeconfig's server",
                        ", ".join(str(v.client.replica) for v in views if v.state == "synced"))

    def pending_views(self) -> dict[str, tuple[bool, dict[str, PodRef]]]:
        """Per replica (the kubeconfig-server fallback excluded): whether its watch is synced, and a
        copy of the pending pods it shows (uid -> PodRef). Read by guard.cache_health."""
        with self._lock:
            views = dict(self._views)
        return {address: (v.synced, dict(v.pods)) for address, v in views.items()}

    def watch_status(self) -> dict:
        """Per replica, its watch's state; and the kubeconfig-server fallback's, while it runs (/readyz)."""
        with self._lock:
            views = dict(self._views)
            fallback = self._fallback
        return {"replicas": {address: v.status() for address, v in sorted(views.items())},
                "fallback": None if fallback is None else {"server": self.pool.kube.host, **fallback.status()}}
