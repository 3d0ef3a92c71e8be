"""``ghost-guard serve --heal``: heal a ghost automatically once a replica is confirmed to serve it stale.

Off the request path: the incident recorder submits a ghost (:meth:`AutoHealer.submit`) when a
replica's confirmation round still finds it serving; one background thread heals one name at a
time (a name already queued or being healed is not queued again), at most ``--heal-rate`` heals
per second with a burst of ``--heal-burst`` (:class:`guard.core.token_bucket.TokenBucket`), each within
``--heal-timeout`` seconds. Each attempt's outcome goes to the audit store
(``record_heal``), to a ``GhostHealed`` (Normal) or ``GhostHealFailed`` (Warning) Event on the
ghost, to ``ghost_guard_heals_total{action,outcome}`` and to the log. The heal itself
(:class:`guard.engine.healer.Healer`) re-verifies by quorum GET and never touches a live pod beyond one
annotation. Per worker process (run one worker, as recommended).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from guard import metrics
from guard.engine.background import Background
from guard.engine.healer import Healer
from guard.core.heal_plan import HealResult, Outcome
from guard.core.token_bucket import TokenBucket
from guard.kube.reads import Kube
from guard.kube.writes import emit_event
from guard.core.records import AuditError, UnknownGhostError
from guard.engine.replicas import ReplicaPool
from guard.core.settings import Settings
from guard.core.verdict import PodRef

log = logging.getLogger("guard.autoheal")

MAX_QUEUED = 1000  # ghosts waiting for a heal at most; more are dropped (counted) until the queue drains


class AutoHealer:
    def __init__(self, settings: Settings, kube: Kube, pool: ReplicaPool, audit, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.kube = kube
        self.audit = audit
        self._healer = Healer(kube, pool.clients, timeout=settings.heal_timeout)
        self._bucket = TokenBucket(settings.heal_rate, settings.heal_burst, clock)
        self._cond = threading.Condition()
        # The heals waiting, each with the Future its submitter holds (the incident recorder re-probes when it is done).
        self._queue: collections.deque[tuple[PodRef, Future[HealResult]]] = collections.deque()
        self._names: set[tuple[str, str]] = set()  # queued or being healed
        self._stopping = False
        self._bg = Background(log)
        self._thread: threading.Thread | None = None

    def submit(self, pod: PodRef) -> Future[HealResult] | None:
        """Queue a heal of ``pod``'s name: its result to come (the caller decides what follows it; the
        healer calls no one back), or None if that name is already queued or being healed, or the queue
        is full. A heal still queued at close() is cancelled."""
        key = (pod.namespace, pod.name)
        with self._cond:
            if self._stopping or key in self._names:
                return None
            if len(self._queue) >= MAX_QUEUED:
                metrics.HEALS_DROPPED.inc()
                return None
            self._names.add(key)
            future: Future[HealResult] = Future()
            self._queue.append((pod, future))
            if self._thread is None:
                self._thread = self._bg.thread("ghost-heal", self._run)
            self._cond.notify_all()
        return future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                pod, future = self._queue[0]
                wait = self._bucket.take()
                if wait > 0:
                    self._cond.wait(wait)  # the rate bound; a new submit or close() wakes it early, then it re-checks
                    continue
                self._queue.popleft()
            try:
                result = self._heal(pod)
            except Exception as e:  # noqa: BLE001 - one heal's bug never stops the others
                log.exception("automatic heal of %s failed", pod)
                future.set_exception(e)
            else:
                future.set_result(result)
            finally:
                with self._cond:
                    self._names.discard((pod.namespace, pod.name))

    def _heal(self, pod: PodRef) -> HealResult:
        result = self._healer.heal(pod.namespace, pod.name)
        metrics.HEALS.labels(result.action.value, result.outcome.value).inc()
        text = (f"kube-ghost-guard heal of {pod} (ghost uid {pod.uid}): {result.outcome} by {result.action}, "
                f"{result.writes} write(s), {result.seconds:.2f}s: {result.detail}")
        if result.advice:
            text += f"; {result.advice}"
        (log.info if result.ok else log.warning)("%s", text)
        if self.audit is not None:
            try:
                self.audit.record_heal(uid=pod.uid or str(pod), action=result.action.value, outcome=result.outcome.value,
                                       detail=(result.detail + (f"; {result.advice}" if result.advice else "")),
                                       at=time.time())
            except UnknownGhostError as e:
                log.debug("audit store: heal of %s not recorded: %s", pod, e)
            except (AuditError, OSError, ValueError) as e:
                log.warning("audit store: cannot record the heal of %s: %s", pod, e)
        if self.settings.events:
            healed = result.outcome in (Outcome.HEALED, Outcome.ALIVE)
            try:
                emit_event(self.kube, namespace=pod.namespace, pod_name=pod.name, pod_uid=pod.uid,
                           reason="GhostHealed" if healed else "GhostHealFailed", message=text,
                           key=f"heal-{result.outcome.value}", event_type="Normal" if healed else "Warning")
            except Exception as e:  # noqa: BLE001 - Events are best effort
                log.warning("cannot emit the heal Event for %s: %s", pod, str(e)[:200])
        return result

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            for _, future in self._queue:
                future.cancel()
        self._bg.close()
        self._healer.close()
