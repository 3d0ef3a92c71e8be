"""Settings: one frozen dataclass with the defaults and their validation.

Pure. ``ghost-guard serve`` fills it from flags and ``GHOST_GUARD_*``
environment variables; ``validate()`` rejects bad combinations before any
server starts, with one line that says what to change. The field defaults
are the only place a default is written: guard/cli.py gives every ``serve``
option its field's default (and ``--help`` shows it).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

# kube-scheduler's default extender httpTimeout; every request must answer well below it.
SCHEDULER_HTTP_TIMEOUT = 5.0
# The validating webhook's timeoutSeconds in manifests/webhook (a test keeps them equal).
WEBHOOK_TIMEOUT_SECONDS = 5.0
# The SQLite audit store's path (--audit-db), for `serve` and for the commands that read the store.
DEFAULT_AUDIT_DB = "/var/lib/ghost-guard/audit.db"


class SettingsError(ValueError):
    """A setting (or a combination) is invalid. The message names the flag."""


@dataclass(frozen=True)
class Settings:
    bind: str = "0.0.0.0:8443"
    kubeconfig: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    client_ca: str | None = None
    insecure_http: bool = False
    workers: int = 1
    threads: int = 16
    get_timeout: float = 1.0
    # Every /filter, /preempt and /validate/binding answer is ready within this many seconds from
    # its arrival at the app (all quorum GETs and waits included); past it the guard fails open
    # (or closed with --fail-closed), counted. Clearly below the callers' timeouts: kube-scheduler's
    # httpTimeout (5 s) and the webhook's timeoutSeconds (WEBHOOK_TIMEOUT_SECONDS).
    request_budget: float = 2.0
    ghost_ttl: float = 3600.0
    ghost_cache_size: int = 100_000
    alive_ttl: float = 0.5
    read_cache_size: int = 10_000
    fail_closed: bool = False
    # Sized for the protocol: kube-scheduler's names-mode body for 15,000 nodes is about 1 MB with
    # 63-character names and 3.9 MB with 253-character ones (docs/RELIABILITY.md); a pod is small.
    max_body_bytes: int = 4 * 1024 * 1024
    access_log: bool = True
    log_level: str = "info"
    # apiserver replicas (attribution, pre-verification)
    apiserver_replicas: str | None = None
    apiserver_server_name: str = "kubernetes.default.svc"
    discovery_interval: float = 60.0
    probe_timeout: float = 0.5
    reprobe_interval: float = 30.0
    stale_confirm_delay: float = 2.0
    # audit store and Events
    audit_db: str = DEFAULT_AUDIT_DB
    # Where the audit goes: None/"sqlite" (audit_db), "sqlite:PATH", or "kubernetes" (GhostPod objects).
    audit_store: str | None = None
    audit_max_age: float = 30 * 86400.0  # --audit-retention (alias --audit-max-age)
    audit_max_records: int = 100_000
    # GhostPod writes (--audit-store kubernetes): per second at most, and identities waiting at most.
    audit_write_qps: float = 20.0
    audit_write_interval: float = 10.0  # seconds between two writes of one record by one guard process
    audit_queue_size: int = 50_000
    events: bool = True
    # First sightings of ghosts no replica ever listed (forged names, mostly: guard/core/flood.py) that get
    # a record, an Event and a follow-up: per namespace per second, and at once; all namespaces
    # together get ten times both. Sighted and confirmed ghosts are never budgeted.
    unsighted_ghost_rate: float = 0.2
    unsighted_ghost_burst: int = 10
    # pre-verification: watch unscheduled pods, quorum-verify each new UID before the scheduler asks
    prepare: bool = True
    prepared_max_age: float = 300.0
    prepared_grace: float = 0.5
    verify_concurrency: int = 16
    verify_qps: float = 500.0
    sweep_interval: float = 30.0
    # Verify ahead only while scheduler calls (/filter, /preempt, /validate/binding) arrived within this
    # many seconds: a guard replica nobody calls costs no quorum GETs. 0: always (guard/engine/prepare.py).
    prepare_idle_after: float = 60.0
    # ghost Nodes: watch every replica's Node names, refuse candidates etcd lacks (guard/engine/ghost_nodes.py)
    ghost_nodes: bool = True
    # replica caches that miss pods or froze (guard/engine/cache_health.py)
    missing_after: float = 30.0
    frozen_after: float = 30.0
    # --- serving: connection deadlines and limits (guard/serving/connection.py), TLS, caller identities ---
    tls_handshake_timeout: float = 2.0
    header_timeout: float = 5.0
    body_timeout: float = 5.0
    body_min_rate: int = 1024 * 1024  # bytes/s: a larger body gets length/rate seconds instead of --body-timeout
    write_timeout: float = 5.0
    keepalive_timeout: float = 30.0
    max_connections: int = 512  # per worker process
    max_connections_per_client: int = 64  # per source address, per worker process
    # Requests over 64 KiB reserve their size (and hold it until the reply is written) from this
    # per-worker budget; beyond it a 503. Bounds the memory many large uploads can take at once.
    max_buffered_bytes: int = 16 * 1024 * 1024  # 4 bodies at --max-body-bytes: bounds worker RSS (RELIABILITY)
    tls_min_version: str = "1.2"
    # Client-certificate identities (CN or DNS SAN) allowed per role; only with --client-ca.
    scheduler_identities: str = "system:kube-scheduler"
    apiserver_identities: str = "kube-apiserver-ghost-guard-client"
    monitoring_identities: str = "ghost-guard-monitoring"
    # request bounds (memory per request; the body is bounded by max_body_bytes)
    max_nodes: int = 15_000  # either mode; a Kubernetes cluster has at most 5,000 nodes
    # serve --heal: heal a ghost once a replica is confirmed to serve it stale (guard/engine/autoheal.py)
    heal: bool = False
    heal_rate: float = 1.0  # heals per second on average
    heal_burst: int = 3  # heals at once at most
    heal_timeout: float = 10.0  # seconds per heal

    @property
    def revision_interval(self) -> float:
        """Seconds between two looks at every replica's cache revision: a third of --frozen-after
        (at least 1 s, at most 20 s), so a frozen replica is named within --frozen-after plus two looks."""
        return min(20.0, max(1.0, self.frozen_after / 3))

    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.bind.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise SettingsError(f"--bind must be HOST:PORT, got {self.bind!r}")
        host = host.strip("[]")
        p = int(port)
        if not 0 < p < 65536:
            raise SettingsError(f"--bind port must be 1-65535, got {p}")
        return host, p

    def validate(self) -> "Settings":
        host, _ = self.host_port()
        if self.insecure_http:
            if self.tls_cert or self.tls_key or self.client_ca:
                raise SettingsError("--insecure-http cannot be combined with --tls-cert, --tls-key or --client-ca")
            if not _is_loopback(host):
                raise SettingsError(
                    f"--insecure-http serves plain HTTP and is for a loopback sidecar only; bind 127.0.0.1 (got {host})")
        else:
            if not (self.tls_cert and self.tls_key):
                raise SettingsError("HTTPS is the default: pass --tls-cert and --tls-key "
                                    "(see `ghost-guard certs`), or --insecure-http for a loopback sidecar")
        if not 0 < self.get_timeout < SCHEDULER_HTTP_TIMEOUT:
            raise SettingsError(f"--get-timeout must be between 0 and the scheduler's httpTimeout "
                                f"({SCHEDULER_HTTP_TIMEOUT:g}s), got {self.get_timeout:g}")
        caller = min(SCHEDULER_HTTP_TIMEOUT, WEBHOOK_TIMEOUT_SECONDS)
        if not 0 < self.request_budget <= caller * 0.6:
            raise SettingsError(f"--request-budget must be positive and at most 60% of the callers' timeout "
                                f"({caller * 0.6:g}s of {caller:g}s), got {self.request_budget:g}")
        if self.get_timeout > self.request_budget:
            raise SettingsError(f"--get-timeout ({self.get_timeout:g}s) must not exceed --request-budget "
                                f"({self.request_budget:g}s)")
        for flag, count in (("--workers", self.workers), ("--threads", self.threads),
                            ("--ghost-cache-size", self.ghost_cache_size), ("--read-cache-size", self.read_cache_size),
                            ("--max-body-bytes", self.max_body_bytes)):
            if count < 1:
                raise SettingsError(f"{flag} must be at least 1, got {count}")
        if self.ghost_ttl <= 0:
            raise SettingsError(f"--ghost-ttl must be positive, got {self.ghost_ttl:g}")
        if not 0 < self.alive_ttl < 1.0:
            raise SettingsError(f"--alive-ttl must be between 0 and 1s (the scheduler's initial backoff), "
                                f"got {self.alive_ttl:g}")
        for flag, value in (("--discovery-interval", self.discovery_interval), ("--probe-timeout", self.probe_timeout),
                            ("--reprobe-interval", self.reprobe_interval), ("--audit-retention", self.audit_max_age),
                            ("--audit-write-qps", self.audit_write_qps),
                            ("--audit-write-interval", self.audit_write_interval),
                            ("--prepared-max-age", self.prepared_max_age), ("--verify-qps", self.verify_qps),
                            ("--sweep-interval", self.sweep_interval)):
            if not value > 0:
                raise SettingsError(f"{flag} must be positive, got {value:g}")
        for flag, value in (("--missing-after", self.missing_after), ("--frozen-after", self.frozen_after)):
            if not 0 < value <= 3600:
                raise SettingsError(f"{flag} must be between 0 and 3600 seconds, got {value:g}")
        if not 0 <= self.prepare_idle_after <= 86400:
            raise SettingsError(f"--prepare-idle-after must be between 0 (always verify ahead) and 86400 seconds, "
                                f"got {self.prepare_idle_after:g}")
        if self.stale_confirm_delay < 0:
            raise SettingsError(f"--stale-confirm-delay must be >= 0, got {self.stale_confirm_delay:g}")
        if not 0 <= self.prepared_grace < 1.0:
            raise SettingsError(f"--prepared-grace must be between 0 and 1s (the scheduler's initial backoff), "
                                f"got {self.prepared_grace:g}")
        if self.audit_store is not None:
            kind, _, path = self.audit_store.strip().partition(":")
            if not (self.audit_store.strip() in ("sqlite", "kubernetes") or (kind == "sqlite" and path)):
                raise SettingsError(f"--audit-store must be `kubernetes`, `sqlite` or `sqlite:PATH`, "
                                    f"got {self.audit_store!r}")
        for flag, value in (("--audit-max-records", self.audit_max_records), ("--audit-queue-size", self.audit_queue_size),
                            ("--verify-concurrency", self.verify_concurrency), ("--max-nodes", self.max_nodes)):
            if value < 1:
                raise SettingsError(f"{flag} must be at least 1, got {value}")
        if self.apiserver_replicas is not None:
            parse_replicas(self.apiserver_replicas)
        self._validate_serving()
        if not 0 < self.unsighted_ghost_rate <= 1000:
            raise SettingsError(f"--unsighted-ghost-rate must be between 0 and 1000 per second, got "
                                f"{self.unsighted_ghost_rate:g}")
        if not 1 <= self.unsighted_ghost_burst <= 100_000:
            raise SettingsError(f"--unsighted-ghost-burst must be between 1 and 100000, got {self.unsighted_ghost_burst}")
        if not 0 < self.heal_rate <= 100:
            raise SettingsError(f"--heal-rate must be between 0 and 100 heals per second, got {self.heal_rate:g}")
        if not 1 <= self.heal_burst <= 100:
            raise SettingsError(f"--heal-burst must be between 1 and 100, got {self.heal_burst}")
        if not 0 < self.heal_timeout <= 300:
            raise SettingsError(f"--heal-timeout must be between 0 and 300 seconds, got {self.heal_timeout:g}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise SettingsError(f"--log-level must be debug, info, warning or error, got {self.log_level!r}")
        return self


    def _validate_serving(self) -> None:
        for flag, value in (("--tls-handshake-timeout", self.tls_handshake_timeout),
                            ("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout),
                            ("--write-timeout", self.write_timeout), ("--keepalive-timeout", self.keepalive_timeout)):
            if not 0 < value <= 300:
                raise SettingsError(f"{flag} must be between 0 and 300 seconds, got {value:g}")
        for flag, value in (("--body-min-rate", self.body_min_rate), ("--max-connections", self.max_connections),
                            ("--max-connections-per-client", self.max_connections_per_client)):
            if value < 1:
                raise SettingsError(f"{flag} must be at least 1, got {value}")
        if self.max_buffered_bytes < self.max_body_bytes:
            raise SettingsError(f"--max-buffered-bytes ({self.max_buffered_bytes}) must be at least --max-body-bytes "
                                f"({self.max_body_bytes}): the largest accepted request must fit")
        if self.max_connections_per_client > self.max_connections:
            raise SettingsError(f"--max-connections-per-client ({self.max_connections_per_client}) must not exceed "
                                f"--max-connections ({self.max_connections})")
        if self.tls_min_version not in ("1.2", "1.3"):
            raise SettingsError(f"--tls-min-version must be 1.2 or 1.3, got {self.tls_min_version!r}")
        for flag, names in (("--scheduler-identities", self.scheduler_identities),
                            ("--apiserver-identities", self.apiserver_identities),
                            ("--monitoring-identities", self.monitoring_identities)):
            if not parse_identities(names):
                raise SettingsError(f"{flag} must name at least one certificate CN or DNS SAN, got {names!r}")


def parse_identities(spec: str) -> frozenset[str]:
    """``a,b, c`` -> {"a", "b", "c"}: the client-certificate names (CN or DNS SAN) of one role."""
    return frozenset(x.strip() for x in spec.split(",") if x.strip())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ReplicaSpecError(SettingsError):
    """A ``--apiserver-replicas`` entry is not ``https://HOST:PORT``."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One kube-apiserver replica, dialled directly (never through the Service VIP)."""

    address: str  # "IP:PORT": its name in metrics, the audit store and Events
    url: str  # https://IP:PORT
    identity: str = ""  # identity Lease name (apiserver-<hash>) when it could be matched

    def __str__(self) -> str:
        return f"{self.address} ({self.identity})" if self.identity else self.address


def parse_replicas(spec: str) -> list[Replica]:
    """``https://IP:PORT,https://IP:PORT`` -> replicas (the static list replaces discovery)."""
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        parts = urlsplit(item)
        if parts.scheme not in ("https", "http") or not parts.hostname or not parts.port or parts.path not in ("", "/"):
            raise ReplicaSpecError(f"--apiserver-replicas entries must be https://HOST:PORT, got {item!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out.append(Replica(f"{host}:{parts.port}", f"{parts.scheme}://{host}:{parts.port}"))
    if not out:
        raise ReplicaSpecError("--apiserver-replicas is empty")
    return out
