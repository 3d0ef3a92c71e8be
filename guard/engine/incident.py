"""What happens once a ghost is found: the record, the attribution, the alerts.

Runs on background threads, never on the scheduling path:

1. the audit store gets the block (durable before it counts as recorded); a
   ghost new to the store is also written to stdout as one JSON line for log
   shippers (:func:`announce_new_ghost`, the store's ``on_new`` hook);
2. etcd is asked first (a quorum GET of the name): a replica is only ever
   blamed for serving the ghost's UID while etcd has no pending pod with that
   UID. If etcd has it pending after all, the ghost verdict is withdrawn at
   once, its audit record marked retracted, and no replica is named. Then
   every apiserver replica's watch cache is probed in parallel (LIST
   ``resourceVersion=0``, one name); replicas still serving the ghost are
   probed again after ``--stale-confirm-delay``: a cache that still serves it
   and whose revision moved on *missed the delete* (not mere lag) and is
   reported stale (gauge, counter, ``StaleWatchCache`` Event, audit);
3. a ``GhostPodBlocked`` Warning Event on the pod, aggregated;
4. later sightings of the same ghost re-probe at most every
   ``--reprobe-interval``, so a restarted replica is seen to have healed;
5. with ``serve --heal``, a ghost confirmed stale on a replica is handed to
   :class:`guard.engine.autoheal.AutoHealer` (``heal``); the recorder probes again
   when the heal it was handed back is done (:meth:`IncidentRecorder.after_heal`).

The pure rules (what counts as stale, healed, missed delete) are in
:mod:`guard.core.attribution`.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from concurrent.futures import CancelledError, Future

from guard import metrics
from guard.core import attribution
from guard.core.attribution import ReplicaObservation
from guard.audit.backend import AuditBackend, GuardAudit
from guard.engine.background import Background
from guard.engine.checker import Events
from guard.kube.reads import Kube
from guard.kube.watch import ReplicaClient
from guard.kube.writes import emit_event
from guard.core.heal_plan import HealResult
from guard.core.records import AuditRecord, block_evidence
from guard.engine.replicas import ReplicaPool
from guard.core.rendering import format_time, new_ghost_line
from guard.core.settings import Settings
from guard.core.verdict import Decision, PodRef, QuorumRead, ReadStatus, Verdict, pending_in_etcd

log = logging.getLogger("guard.incident")

# What etcd says instead, by verdict: the words of the StaleWatchCache alert.
_TRUTH = {
    Verdict.GHOST_DELETED: "no longer has it",
    Verdict.GHOST_REPLACED: "has another pod (another UID) under that name",
    Verdict.ALREADY_BOUND: "has it bound to a node",
    Verdict.TERMINATING: "has it terminating",
}


def announce_new_ghost(record: AuditRecord) -> None:
    """The new-ghost line: one JSON line on stdout (``guard.core.rendering.new_ghost_line``) for log shippers, once per
    ghost across every process sharing the store (the store calls this for the write that created the record)."""
    try:
        sys.stdout.write(new_ghost_line(record) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError) as e:
        log.warning("cannot write new-ghost line: %s", e)


# A replica whose cache probe got no answer (a timeout on a loaded machine, a replica restarting) is asked again
# this many times, this many seconds apart; then the ghost's next sighting past --reprobe-interval asks it.
PROBE_RETRIES = 3
PROBE_RETRY_DELAY = 1.0

class IncidentRecorder:
    """Every piece of incident state is keyed by the ghost's identity (a PodRef: namespace, name, UID).

    ``retract(pod)`` withdraws a ghost verdict (the checker's); ``later(delay, fn, *args)`` runs
    ``fn`` after ``delay`` seconds (default: the recorder's one timer, guard.engine.background; tests pass
    one that records the delay).
    """

    def __init__(self, settings: Settings, kube: Kube, pool: ReplicaPool, audit: GuardAudit | AuditBackend | None, *,
                 retract: Callable[[PodRef], bool] | None = None,
                 later: Callable[..., None] | None = None, audit_error: str | None = None,
                 heal: Callable[[PodRef], Future[HealResult] | None] | None = None) -> None:
        self.settings = settings
        self.kube = kube
        self.pool = pool
        # The store and its health (guard/audit/backend.py): opened by wiring, or a bare store (tests).
        self.audit = audit if isinstance(audit, GuardAudit) else GuardAudit(settings, audit, error=audit_error)
        self._retract = retract or (lambda pod: False)
        self._bg = Background(log)
        self._schedule = later or self._bg.later
        self._probes = self._bg.pool("ghost-probe", 8)
        self._lock = threading.Lock()
        self._last_probe: dict[PodRef, float] = {}  # ghost -> monotonic time of the last probe round
        self._stale: dict[str, set[PodRef]] = {}  # replica address -> ghosts it was confirmed to serve
        self._stale_pods: set[PodRef] = set()  # ghosts some replica was confirmed to serve
        self._verdicts: dict[PodRef, Verdict] = {}  # ghost -> its verdict, for the words of the alert
        self._last_probes: dict[str, dict] = {}  # replica address -> its newest probe's outcome, for /readyz
        self._closed = False
        self._heal = heal  # serve --heal: AutoHealer.submit
        # Whether the guard's cache check names a replica's watch frozen (CacheHealthMonitor.frozen, set by
        # guard.engine.wiring): then no advice says a write heals it.
        self.frozen: Callable[[str], bool] = lambda replica: False

    # -- entry points (the Checker's events: guard.engine.wiring.GuardEvents) ------

    @property
    def records_inline(self) -> bool:
        """Whether blocks are recorded on the request path (:meth:`record_block_now`, the
        Checker's ``record_block`` event): for a store that only queues them in memory (GhostPods), so
        that a block is recorded even when its follow-up waits or the process exits first."""
        return self.audit.writes_in_background

    def events(self, **more: Any) -> Events:
        """The Checker's events this recorder hears: each block on the request path
        (:meth:`record_block_now`), a first sighting (:meth:`new_ghost`), every later one
        (:meth:`sighting`); ``more``: the others (Events' fields: ``called``, ``tier``)."""
        return Events(record_block=self.record_block_now, new_ghost=self.new_ghost, sighting=self.sighting, **more)

    def record_block_now(self, pod: PodRef, decision: Decision, read: QuorumRead | None) -> None:
        if self.records_inline:
            self._record_block(pod, decision, block_evidence(decision, read))

    def new_ghost(self, pod: PodRef, decision: Decision, read: QuorumRead) -> None:
        if not self.records_inline:
            self._record_block(pod, decision, block_evidence(decision, read))
        with self._lock:
            if len(self._verdicts) > 100_000:
                self._verdicts.clear()
            self._verdicts[pod] = decision.verdict
        # etcd again, past every cache: a verdict that a wrong read made (a bug) must not name anyone.
        # Ghosts are rare; one more GET each.
        holds = self.truth(pod)
        if holds is False:
            return  # etcd has it pending: withdrawn, no Event, no replica named
        if holds:
            self._probe_round(pod, confirm=True)
        if self.settings.events:
            self._event(pod, "GhostPodBlocked", f"kube-ghost-guard blocked scheduling: {decision.reason}")

    def sighting(self, pod: PodRef, decision: Decision) -> None:
        if not self.records_inline:
            self._record_block(pod, decision, block_evidence(decision, None))
        with self._lock:
            last = self._last_probe.get(pod, -1e18)
        if attribution.should_reprobe(last, time.monotonic(), self.settings.reprobe_interval):
            self.probe(pod)

    # -- attribution ---------------------------------------------------------------

    def truth(self, pod: PodRef) -> bool | None:
        """Ask etcd whether ``pod`` may be called a ghost: True when etcd has no pending pod with its
        UID, None when the read failed (no claim either way). When etcd has it pending after all,
        the ghost verdict is withdrawn at once and its audit record marked retracted: False."""
        if not pod.uid:
            # A read of a name says nothing about a pod created under it a moment later (kubernetes-facts
            # section 9): with no UID to compare, any replica could be blamed for a live pod. No claim.
            log.info("attribution of %s skipped: the call named no UID, so no replica is named", pod)
            return None
        with self._lock:  # a round begins (bounds the re-probe rate, whatever etcd answers)
            self._last_probe[pod] = time.monotonic()
            if len(self._last_probe) > 100_000:
                self._last_probe.clear()
        read = self.kube.quorum_get(pod.namespace, pod.name)
        if read.status is ReadStatus.ERROR:
            log.info("attribution of %s uid %s postponed: the quorum read failed (%s)", pod, pod.uid, read.error)
            return None
        if not pending_in_etcd(read, pod.uid):
            return True
        self._withdraw(pod)
        return False

    def _withdraw(self, pod: PodRef) -> None:
        self._retract(pod)
        with self._lock:
            for uids in self._stale.values():
                uids.discard(pod)
            self._stale_pods.discard(pod)
            cleared = [r for r, uids in self._stale.items() if not uids]
        for replica in cleared:
            metrics.STALE_REPLICA.labels(replica).set(0)
        self.audit.write("retract", f"the retraction of {pod}", lambda store: store.retract(
            uid=pod.uid or f"{pod}", at=time.time(), namespace=pod.namespace, name=pod.name), health=False)

    def probe(self, pod: PodRef, *, confirm: bool = True) -> list[ReplicaObservation] | None:
        """Probe every replica's cache for the ghost (in parallel); record and act on the result.

        etcd is asked first: None (and no probe) when it has the pod pending (the verdict is
        withdrawn) or cannot answer (a replica serving the truth must never be named)."""
        if not self.truth(pod):
            return None
        return self._probe_round(pod, confirm=confirm)

    def _probe_round(self, pod: PodRef, *, confirm: bool, clients: list[ReplicaClient] | None = None,
                     attempt: int = 0) -> list[ReplicaObservation]:
        """One parallel probe of every replica (or of ``clients``), for a ghost etcd was just asked about. A
        replica that gave no answer is asked again, PROBE_RETRIES times at most, PROBE_RETRY_DELAY apart."""
        clients = self.pool.clients() if clients is None else clients
        now = time.time()
        try:
            observations = list(self._probes.map(lambda c: c.probe(pod.namespace, pod.name, pod.uid, at=now), clients))
        except (RuntimeError, CancelledError):  # a follow-up that ran into the close: "cannot schedule new futures
            if not self._closed:                 # after shutdown", or its probes cancelled by it
                raise
            log.debug("probe round for %s/%s skipped: the guard is stopping", pod.namespace, pod.name)
            return []
        with self._lock:
            confirmed = {r for r, ghosts in self._stale.items() if pod in ghosts}
        for obs in observations:
            self._note_probe(obs)
            # A replica seen serving the ghost once may only lag: it is written down (and so named by
            # `report`) when the confirmation round still finds it serving, or if it was confirmed before.
            if obs.serves_ghost is not True or obs.replica in confirmed:
                self._record_probe(pod, obs)
            if obs.serves_ghost is False:
                self._healed(pod, obs.replica)
        serving = [(c, o) for c, o in zip(clients, observations) if o.serves_ghost]
        if serving and confirm:
            self._later(self.settings.stale_confirm_delay, self._confirm, pod, serving)
        unanswered = [c for c, o in zip(clients, observations) if o.serves_ghost is None]
        if unanswered and attempt < PROBE_RETRIES:
            self._later(PROBE_RETRY_DELAY, self._retry_round, pod, unanswered, attempt + 1, confirm)
        return observations

    def _retry_round(self, pod: PodRef, clients: list[ReplicaClient], attempt: int, confirm: bool) -> None:
        """The replicas that gave no answer, asked again (etcd first, as every round): those still known."""
        known = {c.replica.address for c in self.pool.clients()}
        clients = [c for c in clients if c.replica.address in known]
        if clients and self.truth(pod):
            self._probe_round(pod, confirm=confirm, clients=clients, attempt=attempt)

    def _confirm(self, pod: PodRef, first: list[tuple[ReplicaClient, ReplicaObservation]], attempt: int = 0) -> None:
        if not self.truth(pod):  # etcd again: the verdict may have been withdrawn meanwhile
            return
        for client, before in first:
            after = client.probe(pod.namespace, pod.name, pod.uid, at=time.time())
            self._note_probe(after)
            self._record_probe(pod, after)
            if after.serves_ghost is False:
                self._healed(pod, after.replica)
                continue
            if after.serves_ghost is None and attempt < PROBE_RETRIES:  # no answer: this confirmation again
                self._later(PROBE_RETRY_DELAY, self._confirm, pod, [(client, before)], attempt + 1)
                continue
            if after.serves_ghost:
                advanced = attribution.missed_delete(before.cache_resource_version, after.cache_resource_version, True)
                # Still serving after the delay is what operators must know; say whether the cache moved on
                # (it missed the delete for good) or stood still (a frozen watch, or an idle cluster).
                self._stale_confirmed(pod, client, after, note="" if advanced else (
                    " (its cache revision did not advance: watch frozen or cluster idle)"))

    def _stale_confirmed(self, pod: PodRef, client: ReplicaClient, obs: ReplicaObservation, note: str = "") -> None:
        replica = client.replica.address
        with self._lock:
            uids = self._stale.setdefault(replica, set())
            new = pod not in uids
            uids.add(pod)
            self._stale_pods.add(pod)
        metrics.STALE_REPLICA.labels(replica).set(1)
        if not new:
            return
        metrics.STALE_REPLICA_DETECTIONS.labels(replica).inc()
        with self._lock:
            verdict = self._verdicts.get(pod, Verdict.GHOST_DELETED)
        frozen = self.frozen(replica)
        message = (f"apiserver replica {client.replica} still serves pod {pod} uid {pod.uid} from its watch cache as "
                   f"waiting to be scheduled (cache resourceVersion {obs.cache_resource_version}) although etcd "
                   f"{_TRUTH[verdict]}{note}; " + (
                       "its watch is frozen; writes cannot heal it, restart that apiserver replica" if frozen else
                       "healing it (serve --heal)" if self._heal is not None else
                       f"heal it without a restart: ghost-guard heal {pod.namespace}/{pod.name} (restart that "
                       "replica only if heal reports it frozen)"))
        log.warning("%s", message)
        if self.settings.events:
            self._event(pod, "StaleWatchCache", message, key=replica)
        if self._heal is not None and not frozen:
            healing = self._heal(pod)
            if healing is not None:  # the heal's result comes back here: no callback into the recorder to set
                healing.add_done_callback(lambda done: self.after_heal(pod, done))

    def after_heal(self, pod: PodRef, healing: Future[HealResult]) -> None:
        """After an automatic heal (serve --heal), on the healer's thread: probe the replicas again, so the
        stale gauge and the audit show which replicas no longer serve the ghost."""
        if healing.cancelled() or healing.exception() is not None:
            return
        if healing.result().ok:
            self.probe(pod, confirm=False)

    def _healed(self, pod: PodRef, replica: str) -> None:
        with self._lock:
            uids = self._stale.get(replica)
            if not uids or pod not in uids:
                return
            uids.discard(pod)
            clear = not uids
            if not any(pod in u for u in self._stale.values()):
                self._stale_pods.discard(pod)
        log.info("apiserver replica %s no longer serves ghost %s uid %s: healed", replica, pod, pod.uid)
        if clear:
            metrics.STALE_REPLICA.labels(replica).set(0)

    def reprobe_stale(self) -> None:
        """Re-probe ghosts that some replica was confirmed to serve (bounded by --reprobe-interval),
        so a restarted replica is seen to heal even when no scheduler asks about the ghost again."""
        now = time.monotonic()
        with self._lock:
            due = [p for p in self._stale_pods
                   if attribution.should_reprobe(self._last_probe.get(p, -1e18), now, self.settings.reprobe_interval)]
        for pod in due:
            self.probe(pod, confirm=False)

    def _note_probe(self, obs: ReplicaObservation) -> None:
        """The newest probe of each replica (for /readyz); a probe that got no answer is counted."""
        outcome = attribution.classify(obs)
        if obs.serves_ghost is None:
            metrics.REPLICA_PROBE_ERRORS.labels(obs.replica, outcome).inc()
        with self._lock:
            self._last_probes[obs.replica] = {"outcome": outcome, "at": format_time(obs.checked_at), "error": obs.error}

    def confirmed(self, pod: PodRef) -> bool:
        """Whether a probe confirmed some replica serving this ghost (and no later probe saw it healed)."""
        return pod in self._stale_pods

    def probe_status(self) -> dict[str, dict]:
        """Per replica, the newest cache probe's outcome (stale, consistent, not-ready, unreachable, error)."""
        with self._lock:
            return {replica: dict(v) for replica, v in sorted(self._last_probes.items())}

    # -- plumbing -------------------------------------------------------------------

    def check_audit(self) -> dict:
        """The audit store's health, for /readyz (guard.audit.backend.GuardAudit.check)."""
        return self.audit.check()

    def _record_block(self, pod: PodRef, decision: Decision, evidence: dict) -> None:
        self.audit.write("block", f"block of {pod}", lambda store: store.record_block(
            uid=pod.uid or f"{pod}", namespace=pod.namespace, name=pod.name, verdict=decision.verdict.value,
            evidence=evidence, at=time.time()))

    def _record_probe(self, pod: PodRef, obs: ReplicaObservation) -> None:
        self.audit.write("probe", f"probe of {pod} on {obs.replica}", lambda store: store.record_probe(
            uid=pod.uid or f"{pod}", replica=obs.replica, serves=obs.serves_ghost,
            cache_resource_version=obs.cache_resource_version, error=obs.error, at=obs.checked_at,
            namespace=pod.namespace, name=pod.name))

    def _event(self, pod: PodRef, reason: str, message: str, key: str = "") -> None:
        try:
            emit_event(self.kube, namespace=pod.namespace, pod_name=pod.name, pod_uid=pod.uid, reason=reason,
                       message=message, key=key)
        except Exception as e:  # Events are best effort
            log.warning("cannot emit %s Event for %s: %s", reason, pod, str(e)[:200])

    def _later(self, delay: float, fn, *args) -> None:
        if self._closed:
            return
        self._schedule(delay, self._run_safely, fn, *args)

    @staticmethod
    def _run_safely(fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("attribution step %s failed", getattr(fn, "__name__", fn))

    def close(self) -> None:
        self._closed = True
        self._bg.close()
