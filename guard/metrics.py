"""Every Prometheus metric the guard exports.

Under gunicorn the server sets ``PROMETHEUS_MULTIPROC_DIR`` before this module
is imported, so values live in per-process files and ``/metrics`` aggregates
them (``registry()``). Pod names and UIDs never go into labels: they are in the
audit log.
"""

from __future__ import annotations

import functools
import glob
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

# Sub-millisecond buckets: the cache-hit path answers in well under 1 ms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

REQUESTS = Counter("ghost_guard_requests", "HTTP requests served, by endpoint and status code.", ["endpoint", "code"])
REQUEST_DURATION = Histogram("ghost_guard_request_duration_seconds", "Time to answer a request, by endpoint.",
                             ["endpoint"], buckets=LATENCY_BUCKETS)
VERDICTS = Counter("ghost_guard_verdicts", "Verdicts handed out, by verdict.", ["verdict"])
VERDICTS_PREPARED = Counter("ghost_guard_verdicts_prepared", "Scheduler calls answered from a verdict verified in "
                            "the background before the call (no apiserver round trip on the scheduling path).")
VERDICTS_INLINE = Counter("ghost_guard_verdicts_inline", "Scheduler calls that found no cached or prepared verdict "
                          "and made a quorum GET of their own on the scheduling path.")
VERDICTS_SHARED = Counter("ghost_guard_verdicts_shared_read", "Scheduler calls that found no prepared verdict but "
                          "shared a quorum read already in flight or just made (by the background verification or "
                          "another call): they waited for it instead of a GET of their own.")
PREPARE_VERIFIED = Counter("ghost_guard_prepare_verified", "Pods verified ahead, in the background (new pods the watch or a listing showed), "
                      "by verdict.", ["verdict"])
PREPARE_DROPPED = Counter("ghost_guard_prepare_dropped", "New pods not queued for background verification "
                            "because the queue was full (their first scheduling call verifies inline).")
PREPARE_ACTIVE = Gauge("ghost_guard_prepare_active", "1 while this guard verifies new pods ahead (a scheduler "
                         "call arrived within --prepare-idle-after, or it is 0), 0 while idle: no watch, its listings "
                         "of every replica run, it makes no quorum GETs for new pods (sampled every second).", multiprocess_mode="livemax")
PREPARE_TAKEOVERS = Counter("ghost_guard_prepare_takeovers", "First scheduler calls after an idle spell (or "
                              "since start): each queued the pending pods the listings held for background verification.")
PREPARE_DEFERRED = Counter("ghost_guard_prepare_deferred", "New pods seen while idle, not verified ahead (kept "
                             "for the next takeover; a call for one before then verifies it inline).")
PREPARE_BACKLOG = Gauge("ghost_guard_prepare_backlog", "Pending pods seen while idle, waiting for a takeover "
                          "(sampled every second).", multiprocess_mode="livesum")
WATCH_RESTARTS = Counter("ghost_guard_watch_restarts", "Restarts of the unscheduled-pod watch on a replica, by reason "
                         "(expired = 410 re-list, error).", ["reason"])
FOLLOWUPS_DROPPED = Counter("ghost_guard_followups_dropped", "Ghost follow-ups (audit record, replica probes, "
                            "Events) dropped because more than 100,000 pod identities were waiting beyond the 1,000 "
                            "running or queued; verdicts are unaffected. Should stay 0.")
GHOSTS_BLOCKED = Counter("ghost_guard_ghosts_blocked", "Distinct ghost pods (by UID) first blocked, by verdict.",
                         ["verdict"])
VERDICTS_RETRACTED = Counter("ghost_guard_verdicts_retracted", "Ghost verdicts withdrawn because a quorum read "
                             "showed the pod pending after all (its audit record is marked retracted). Should stay 0.")
CACHE_LOOKUPS = Counter("ghost_guard_cache_lookups", "Verdict cache lookups, by cache (ghosts, reads) and result.",
                        ["cache", "result"])
QUORUM_GET_DURATION = Histogram("ghost_guard_quorum_get_duration_seconds",
                                "Quorum GETs of pods (served by etcd), by outcome (found, not-found, error).",
                                ["outcome"], buckets=LATENCY_BUCKETS)
FAIL_OPEN = Counter("ghost_guard_fail_open", "Requests answered as if the pod were alive because the guard could "
                    "not decide (apiserver trouble or an internal error), by reason.", ["reason"])
FAIL_CLOSED = Counter("ghost_guard_fail_closed", "Pods rejected by --fail-closed because the guard could not decide.",
                      ["reason"])
STALE_REPLICA = Gauge("ghost_guard_stale_replica", "1 while an apiserver replica's watch cache serves a pod that "
                      "etcd no longer has, else 0.", ["replica"], multiprocess_mode="mostrecent")
STALE_REPLICA_DETECTIONS = Counter("ghost_guard_stale_replica_detections",
                                   "Probes that found an apiserver replica serving a ghost.", ["replica"])
CONNECTIONS_REJECTED = Counter("ghost_guard_connections_rejected", "Client connections refused or cut off by the "
                               "serving layer, by reason (over-client-limit, over-total-limit, stalled-evicted: no "
                               "request head sent yet, closed at the total limit to admit a new one, "
                               "over-client-calls: a large call whose turn did not come within the budget, "
                               "tls-handshake-timeout, "
                               "tls-handshake-failed, header-timeout, body-timeout, write-timeout, head-too-large, "
                               "body-too-large, body-incomplete, bad-framing, over-buffer-limit).", ["reason"])
CONNECTIONS_OPEN = Gauge("ghost_guard_connections_open", "Client connections open (sampled every second), "
                         "summed over the live worker processes.", multiprocess_mode="livesum")
CALLS_PARKED = Gauge("ghost_guard_calls_parked", "Scheduler calls waiting, without a thread, for their pod's quorum "
                     "GET already in flight (sampled every second), summed over the live worker processes.",
                     multiprocess_mode="livesum")
BUFFERED_BYTES = Gauge("ghost_guard_buffered_bytes", "Bytes of --max-buffered-bytes held by requests being read, "
                       "run or answered and by replies not yet sent (sampled every second), summed over the live "
                       "worker processes.", multiprocess_mode="livesum")
CALLS_QUEUED = Gauge("ghost_guard_calls_queued", "Large calls waiting for their client's turn at a pool thread "
                     "(at most 1 per client address runs at once; sampled every second), summed over the live "
                     "worker processes.", multiprocess_mode="livesum")
REQUESTS_FORBIDDEN = Counter("ghost_guard_requests_forbidden", "Requests refused with 403 because the client "
                             "certificate is not of the endpoint's role, by endpoint and required role.",
                             ["endpoint", "role"])

# Health of what degrades one feature, never the verdicts (also in /readyz's details).
AUDIT_STORE_HEALTHY = Gauge("ghost_guard_audit_store_healthy", "1 while the audit store is writable, 0 while it is "
                            "not (ghosts are still blocked, but not recorded); the lowest of the live workers.",
                            multiprocess_mode="livemin")
AUDIT_WRITE_ERRORS = Counter("ghost_guard_audit_write_errors", "Audit store writes that failed, by operation "
                             "(block, probe, check: the /readyz write test).", ["operation"])
# The GhostPod store (--audit-store kubernetes, guard/audit/ghostpods.py): writes happen in the background.
AUDIT_PENDING = Gauge("ghost_guard_audit_pending_records", "Audit records (pod identities) waiting to be written to "
                      "the Kubernetes API, summed over the live workers.", multiprocess_mode="livesum")
AUDIT_WRITES = Counter("ghost_guard_audit_writes", "GhostPod writes (one identity's pending operations), by outcome "
                       "(ok; retry: no answer, 429, 5xx, 401/403 or the CRD not served: kept and retried; rejected: "
                       "refused by the apiserver, dropped).", ["outcome"])
AUDIT_RECORDS_DROPPED = Counter("ghost_guard_audit_records_dropped", "Audit records dropped, by reason (queue-full: "
                                "more identities waiting than --audit-queue-size; rejected: refused by the apiserver). "
                                "Should stay 0.", ["reason"])
AUDIT_PRUNED = Counter("ghost_guard_audit_pruned", "GhostPods deleted by retention (--audit-retention, "
                       "--audit-max-records).")
FLOOD_SHED = Counter("ghost_guard_flood_shed", "Ghost first sightings that got no audit record, Event or "
                     "follow-up (still blocked), and follow-ups dropped, for ghosts no apiserver replica ever listed "
                     "(forged names, mostly), by reason (namespace-budget, global-budget: --unsighted-ghost-rate and "
                     "--unsighted-ghost-burst; queue-full). Ghosts a replica listed or served are never shed.", ["reason"])
for _reason in ("namespace-budget", "global-budget", "queue-full"):  # guard.core.flood.SHED_REASONS, shown from 0
    FLOOD_SHED.labels(_reason)
FOLLOWUPS_COALESCED = Counter("ghost_guard_followups_coalesced", "Ghost follow-ups merged into one already waiting "
                              "for the same pod identity because more than 1,000 were pending (a repeated sighting "
                              "of a looping ghost), or, for a ghost no replica ever listed, because one sighting of "
                              "it was pending; its extra blocks are not counted in the audit.")
REPLICA_WATCH_UP = Gauge("ghost_guard_replica_watch_up", "1 while the guard's view of an apiserver replica's "
                         "unscheduled pods (its last listing, or the watch on it) is synced, 0 while it is retrying.", ["replica"], multiprocess_mode="livemin")
WATCH_FALLBACK = Gauge("ghost_guard_watch_fallback", "1 while no apiserver replica answers and pre-verification "
                       "watches through the kubeconfig's own server instead.", multiprocess_mode="livemax")
REPLICA_PROBE_ERRORS = Counter("ghost_guard_replica_probe_errors", "Cache probes of an apiserver replica that got "
                               "no answer, by replica and kind (unreachable: timeout or refused, not-ready: 429, error).",
                               ["replica", "kind"])

# Replica caches that miss pods or stopped (guard/engine/cache_health.py). "Ghosts served" per replica is
# ghost_guard_stale_replica above.
REPLICA_PODS_MISSING = Gauge("ghost_guard_replica_pods_missing", "Pods pending in etcd (quorum read) that an "
                             "apiserver replica's watch cache lacks although its revision is past theirs (its "
                             "watch lost their creation), by replica.", ["replica"], multiprocess_mode="livemax")
REPLICA_PODS_MISSING_DETECTIONS = Counter("ghost_guard_replica_pods_missing_detections", "Pods found missing from "
                                          "an apiserver replica's watch cache, by replica.", ["replica"])
REPLICA_SECONDS_BEHIND = Gauge("ghost_guard_replica_seconds_behind", "Seconds an apiserver replica's watch cache "
                               "has been behind a revision etcd had (0 when last seen caught up), by replica.",
                               ["replica"], multiprocess_mode="livemax")
REPLICA_FROZEN = Gauge("ghost_guard_replica_frozen", "1 while an apiserver replica's watch cache revision stands "
                       "still behind etcd's (a frozen watch: only a restart of that replica helps), else 0.",
                       ["replica"], multiprocess_mode="livemax")


# Ghost Nodes (guard/engine/ghost_nodes.py, guard/core/node_verdict.py): Nodes etcd lacks that a replica's cache serves.
GHOST_NODES = Gauge("ghost_guard_ghost_nodes", "Ghost Nodes (deleted in etcd, confirmed by a quorum read) an "
                    "apiserver replica's watch cache still serves, by replica.", ["replica"],
                    multiprocess_mode="livemax")
GHOST_NODE_DETECTIONS = Counter("ghost_guard_ghost_node_detections", "Nodes confirmed ghost by a quorum read "
                                "(etcd: not found) while a replica's cache served them, by replica.", ["replica"])
GHOST_NODE_CANDIDATES = Counter("ghost_guard_ghost_node_candidates_failed", "Candidate Nodes refused to a live pod "
                                "because they are ghost Nodes, by verb (filter: in FailedAndUnresolvableNodes, "
                                "preempt: dropped).", ["verb"])
NODE_READS = Counter("ghost_guard_node_reads", "Quorum reads of Nodes that replicas disagree on, by outcome (ghost, "
                     "real, error: the Node passes, fail open; stale: the name changed while the read ran).",
                     ["outcome"])
NODE_WATCH_UP = Gauge("ghost_guard_node_watch_up", "1 while the guard's list and watch of an apiserver replica's "
                      "Nodes is synced, 0 while it is retrying.", ["replica"], multiprocess_mode="livemin")


@functools.lru_cache(maxsize=1024)
def labelled(metric, *values: str):
    """``metric.labels(*values)``, looked up once: the per-pod paths count several labelled metrics per
    call, and each ``labels()`` validates and locks (about 2.5 us). Only for label values from small
    fixed sets (verdicts, outcomes, endpoints, status codes); the bound keeps a mistake from growing."""
    return metric.labels(*values)


# Large calls decoded in helper processes (guard/serving/offload.py).
OFFLOAD_FAILURES = Counter("ghost_guard_offload_helper_failures", "Large calls (over 256 KiB) whose helper process "
                           "did not answer, by reason (late: past 90 % of --request-budget, the call got a 503 and the "
                           "helper was replaced; failed: the helper died or answered out of turn, the worker decoded "
                           "the call itself; start-failed: no helper process could be started, the worker decodes "
                           "large calls itself). Should stay 0; a 503 fails open at kube-scheduler (the extender is "
                           "ignorable).", ["reason"])

HEALS = Counter("ghost_guard_heals", "Automatic heals of stale watch caches (serve --heal), by action (placeholder, "
                "annotate, none) and outcome (healed, frozen, refused, failed, alive, timeout).", ["action", "outcome"])
HEALS_DROPPED = Counter("ghost_guard_heals_dropped", "Automatic heals not queued because the heal queue was full.")


class _Collector(multiprocess.MultiProcessCollector):
    """prometheus_client's multiprocess collector, skipping a file a process is still creating: a ``.db`` file
    is empty between its creation and its first size (prometheus_client's MmapedDict), and reading it raised
    ``struct.error`` (``/metrics`` answered 500 while a gunicorn worker or helper started: seen in a loaded
    full run)."""

    def collect(self):
        files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _sized(f)]
        return self.merge(files, accumulate=True)


def _sized(path: str) -> bool:
    """The file holds at least MmapedDict's 8-byte header (the used length it reads first)."""
    try:
        return os.path.getsize(path) >= 8
    except OSError:  # gone meanwhile (a process's file removed)
        return False


def registry() -> CollectorRegistry | None:
    """The registry to expose: a fresh multiprocess collector under gunicorn, else the default."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        reg = CollectorRegistry()
        _Collector(reg)
        return reg
    return None


def exposition() -> bytes:
    from prometheus_client import REGISTRY

    return generate_latest(registry() or REGISTRY)


# Every labelled counter starts at 0 for the label values known ahead, so that an alert rule "should stay 0"
# (rate(...) > 0, increase(...) > 0) sees a series from the start, not only after the first event. Per-replica
# series start when the replica is known (guard.engine.cache_health).
KNOWN_LABELS: tuple[tuple[Counter, tuple[tuple[str, ...], ...]], ...] = (
    (FAIL_OPEN, (("apiserver",), ("budget",), ("internal-error",))),
    (FAIL_CLOSED, (("apiserver",), ("budget",), ("internal-error",))),
    (VERDICTS, tuple((v,) for v in ("alive", "ghost-deleted", "ghost-replaced", "already-bound", "terminating",
                                    "unknown"))),
    (GHOSTS_BLOCKED, (("ghost-deleted",), ("ghost-replaced",), ("already-bound",), ("terminating",))),
    (PREPARE_VERIFIED, tuple((v,) for v in ("alive", "ghost-deleted", "ghost-replaced", "already-bound", "terminating",
                                            "unknown"))),
    (WATCH_RESTARTS, (("expired",), ("error",))),
    (CACHE_LOOKUPS, (("ghosts", "hit"), ("ghosts", "miss"), ("reads", "hit"), ("reads", "miss"))),
    (CONNECTIONS_REJECTED, tuple((r,) for r in (
        "over-client-limit", "over-total-limit", "idle-evicted", "tls-handshake-timeout", "tls-handshake-failed",
        "header-timeout", "body-timeout", "write-timeout", "head-too-large", "body-too-large", "body-incomplete",
        "bad-framing", "over-buffer-limit"))),
    (AUDIT_WRITE_ERRORS, (("block",), ("probe",), ("check",))),
    (AUDIT_WRITES, (("ok",), ("retry",), ("rejected",))),
    (AUDIT_RECORDS_DROPPED, (("queue-full",), ("rejected",))),
    (OFFLOAD_FAILURES, (("late",), ("failed",), ("start-failed",))),
    (HEALS, tuple((a, o) for a in ("placeholder", "annotate", "none")
                  for o in ("healed", "frozen", "refused", "failed", "alive", "timeout"))),
)
for _metric, _values in KNOWN_LABELS:
    for _v in _values:
        _metric.labels(*_v)


def replica_known(replica: str) -> None:
    """A replica's counters start at 0 once the guard knows the replica."""
    STALE_REPLICA_DETECTIONS.labels(replica)
    REPLICA_PODS_MISSING_DETECTIONS.labels(replica)
