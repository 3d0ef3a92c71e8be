"""The simulator's configuration: ``extenders[]`` entries, timings, and the per-pod counters it keeps."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]
"""A Kubernetes object as decoded JSON."""

@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """``extenders[].tlsConfig`` of KubeSchedulerConfiguration (file or inline PEM)."""

    insecure: bool = False
    server_name: str = ""
    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    cert_data: bytes = b""
    key_data: bytes = b""
    ca_data: bytes = b""


@dataclasses.dataclass(frozen=True)
class ExtenderConfig:
    """One ``extenders[]`` entry of KubeSchedulerConfiguration.

    ``prioritize_verb`` and ``weight`` are accepted but never called (the
    simulator scores nodes itself); a bind verb is refused: the guard never
    implements one (a bind timeout was retried forever, kubernetes#96579;
    k8s.io/kube-scheduler/extender/v1/types.go).
    """

    url_prefix: str
    filter_verb: str = ""
    preempt_verb: str = ""
    prioritize_verb: str = ""
    weight: int = 1
    enable_https: bool = False
    tls_config: TLSConfig | None = None
    http_timeout: float = 5.0
    node_cache_capable: bool = False
    managed_resources: tuple[str, ...] = ()
    ignorable: bool = False

    def __post_init__(self) -> None:
        if not self.url_prefix:
            raise ValueError("extender urlPrefix is empty")
        if self.http_timeout <= 0:
            raise ValueError("extender httpTimeout must be positive")

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> ExtenderConfig:
        """Build from a KubeSchedulerConfiguration ``extenders[]`` entry (camelCase keys).

        ``httpTimeout`` may be a number of seconds or a Go duration such as
        ``"5s"`` or ``"500ms"``; ``*Data`` fields are base64, as in YAML.
        """
        known = {
            "urlPrefix", "filterVerb", "preemptVerb", "prioritizeVerb", "bindVerb", "weight",
            "enableHTTPS", "tlsConfig", "httpTimeout", "nodeCacheCapable", "managedResources", "ignorable",
        }
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"unknown extender keys: {', '.join(unknown)}")
        if entry.get("bindVerb"):
            raise ValueError("bindVerb is not supported by the simulator (and must not be used with the guard)")
        tls = entry.get("tlsConfig")
        tls_config = None
        if tls is not None:
            tls_config = TLSConfig(
                insecure=bool(tls.get("insecure", False)),
                server_name=tls.get("serverName", ""),
                cert_file=tls.get("certFile", ""),
                key_file=tls.get("keyFile", ""),
                ca_file=tls.get("caFile", ""),
                cert_data=base64.b64decode(tls.get("certData", "") or ""),
                key_data=base64.b64decode(tls.get("keyData", "") or ""),
                ca_data=base64.b64decode(tls.get("caData", "") or ""),
            )
        return cls(
            url_prefix=entry.get("urlPrefix", ""),
            filter_verb=entry.get("filterVerb", ""),
            preempt_verb=entry.get("preemptVerb", ""),
            prioritize_verb=entry.get("prioritizeVerb", ""),
            weight=int(entry.get("weight", 1)),
            enable_https=bool(entry.get("enableHTTPS", False)),
            tls_config=tls_config,
            http_timeout=_duration(entry.get("httpTimeout", 5.0)),
            node_cache_capable=bool(entry.get("nodeCacheCapable", False)),
            managed_resources=tuple(m["name"] for m in entry.get("managedResources") or ()),
            ignorable=bool(entry.get("ignorable", False)),
        )


def _duration(value: Any) -> float:
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * scale
    return float(text)


@dataclasses.dataclass(frozen=True)
class Timings:
    """Timing constants; the defaults are kube-scheduler's."""

    pod_initial_backoff: float = 1.0  # podInitialBackoffSeconds
    pod_max_backoff: float = 10.0  # podMaxBackoffSeconds
    backoff_flush_period: float = 1.0  # flushBackoffQCompleted ticker
    pod_max_in_unschedulable: float = 300.0  # podMaxInUnschedulablePodsDuration
    unschedulable_flush_period: float = 30.0  # flushUnschedulablePodsLeftover ticker
    watch_timeout: int = 300  # timeoutSeconds of each WATCH (reflector: 5 to 10 min)
    request_timeout: float = 10.0  # every other API call
    retry_period: float = 0.5  # informer wait after a failed LIST or WATCH
    sync_timeout: float = 30.0  # start() waits this long for the first LISTs

    def backoff(self, attempts: int) -> float:
        """calculateBackoffDuration: initial, doubled per extra attempt, capped."""
        duration = self.pod_initial_backoff
        for _ in range(1, attempts):
            if duration > self.pod_max_backoff - duration:
                return self.pod_max_backoff
            duration += duration
        return min(duration, self.pod_max_backoff)


# --- statistics ---------------------------------------------------------------


@dataclasses.dataclass
class PodStats:
    """What the scheduler did with one pod (keyed ``namespace/name``)."""

    uid: str = ""
    attempts: int = 0  # scheduling cycles
    filter_calls: int = 0  # extender filter verb calls
    preempt_calls: int = 0  # extender preempt verb calls
    bind_attempts: int = 0
    bind_failures: dict[int, int] = dataclasses.field(default_factory=dict)  # HTTP status -> count (0: no answer)
    status_patches: int = 0
    status_patch_failures: dict[int, int] = dataclasses.field(default_factory=dict)
    unschedulable: int = 0  # times it ended a cycle with no feasible node
    scheduling_errors: int = 0  # extender errors and other scheduling errors
    evictions: list[str] = dataclasses.field(default_factory=list)  # victims deleted for this pod
    evicted_by: str = ""  # the preemptor, when this pod was deleted as a victim
    nominated_node: str = ""
    bound_node: str = ""
    last_message: str = ""

    @property
    def bind_failures_total(self) -> int:
        return sum(self.bind_failures.values())
