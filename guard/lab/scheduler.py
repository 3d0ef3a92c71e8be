"""Scheduler simulator: the parts of kube-scheduler that make the ghost loop.

Test and demo infrastructure (never imported by the serving path). It talks to
one apiserver replica through the official ``kubernetes`` client, like a real
scheduler whose connection landed on that replica:

- **informers** for Pods and Nodes: LIST ``resourceVersion=0`` (watch cache),
  then WATCH from the list's resourceVersion; a new WATCH from the last seen
  resourceVersion when one ends; a re-LIST on ``410 Gone``
  (client-go ``tools/cache/reflector.go``);
- a **scheduling queue** with activeQ, backoffQ and the unschedulable pool
  (``pkg/scheduler/backend/queue/scheduling_queue.go``): error backoff starts at
  ``pod_initial_backoff`` and doubles to ``pod_max_backoff``; backoffQ is flushed
  every ``backoff_flush_period``; any cluster event (pod or node add, update,
  delete) moves unschedulable pods out, subject to backoff; pods left in the
  pool longer than ``pod_max_in_unschedulable`` are flushed;
- **serial scheduling cycles** (``schedule_one.go``): built-in filters first
  (node unschedulable, nodeSelector, resource requests against allocatable
  minus the pods bound or assumed there and nominated pods of equal or higher
  priority), then each extender's filter verb with the nodes that passed
  (``extender.go``), then a node by least-allocated score, then the Binding
  POST; on failure the pod is forgotten and, **if the informer still holds
  it**, requeued with backoff, and a status PATCH (``PodScheduled=False``) is
  sent when the condition changes;
- **preemption** like DefaultPreemption (``framework/preemption/preemption.go``,
  ``plugins/defaultpreemption``) when no node fits: candidates on nodes not
  marked unresolvable, victims chosen by removing lower-priority pods and
  reprieving the most important ones, the extenders' preempt verb, then the
  victims really deleted through the API (after a ``DisruptionTarget``
  condition patch) and the preemptor's ``nominatedNodeName`` patched.

Every constant is in :class:`Timings` so tests can run fast. Per-pod counters are
available from :meth:`Scheduler.stats`.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import datetime as _dt
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from decimal import Decimal
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

__all__ = [
    "ExtenderConfig",
    "ExtenderError",
    "PodStats",
    "Scheduler",
    "TLSConfig",
    "Timings",
]

log = logging.getLogger(__name__)

UNSCHEDULABLE = "Unschedulable"
UNRESOLVABLE = "UnschedulableAndUnresolvable"

Obj = dict[str, Any]


# --- configuration ------------------------------------------------------------


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


# --- extender client ------------------------------------------------------------


class ExtenderError(Exception):
    """An extender call failed: transport error, non-200, bad JSON or a non-empty ``Error``."""


def _field(reply: Mapping[str, Any], name: str) -> Any:
    """Go's encoding/json matches keys case-insensitively."""
    if name in reply:
        return reply[name]
    lowered = name.lower()
    for key, value in reply.items():
        if isinstance(key, str) and key.lower() == lowered:
            return value
    return None


def _wire(obj: Obj) -> Obj:
    """An object as Go marshals an embedded one: TypeMeta left empty, so no apiVersion/kind."""
    out = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}
    return out


class _ExtenderClient:
    """HTTPExtender (pkg/scheduler/extender.go): POST urlPrefix/verb, JSON both ways."""

    def __init__(self, config: ExtenderConfig) -> None:
        self.config = config
        self._tmpfiles: list[str] = []
        kwargs: dict[str, Any] = {}
        tls = config.tls_config or TLSConfig()
        if config.enable_https:
            has_ca = bool(tls.ca_file or tls.ca_data)
            if tls.insecure or not has_ca:  # makeTransport: no CA means Insecure
                kwargs["cert_reqs"] = "CERT_NONE"
                kwargs["assert_hostname"] = False
            else:
                kwargs["cert_reqs"] = "CERT_REQUIRED"
                if tls.ca_file:
                    kwargs["ca_certs"] = tls.ca_file
                else:
                    kwargs["ca_cert_data"] = tls.ca_data.decode()
                if tls.server_name:
                    kwargs["server_hostname"] = tls.server_name
                    kwargs["assert_hostname"] = tls.server_name
            cert = tls.cert_file or self._tmp(tls.cert_data)
            key = tls.key_file or self._tmp(tls.key_data)
            if cert:
                kwargs["cert_file"] = cert
                kwargs["key_file"] = key or None
        self._pool = urllib3.PoolManager(
            num_pools=2, maxsize=2, retries=False, timeout=urllib3.Timeout(total=config.http_timeout), **kwargs
        )

    def _tmp(self, data: bytes) -> str:
        if not data:
            return ""
        fd, path = tempfile.mkstemp(prefix="sched-ext-", suffix=".pem")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        self._tmpfiles.append(path)
        return path

    def close(self) -> None:
        self._pool.clear()
        for path in self._tmpfiles:
            try:
                os.unlink(path)
            except OSError:
                pass

    def interested(self, pod: Obj) -> bool:
        """IsInterested: no managedResources means every pod."""
        managed = set(self.config.managed_resources)
        if not managed:
            return True
        spec = pod.get("spec") or {}
        for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
            resources = container.get("resources") or {}
            for part in ("requests", "limits"):
                if managed & set(resources.get(part) or {}):
                    return True
        return False

    def send(self, verb: str, args: Obj) -> Obj:
        url = self.config.url_prefix.rstrip("/") + "/" + verb
        try:
            resp = self._pool.request(
                "POST", url, body=json.dumps(args).encode(), headers={"Content-Type": "application/json"}
            )
        except urllib3.exceptions.HTTPError as e:
            raise ExtenderError(f"{verb} at {url}: {e}") from e
        if resp.status != 200:
            raise ExtenderError(f"failed {verb} with extender at URL {url}, code {resp.status}")
        try:
            reply = json.loads(resp.data)
        except ValueError as e:
            raise ExtenderError(f"{verb} at {url}: undecodable reply: {e}") from e
        if not isinstance(reply, dict):
            raise ExtenderError(f"{verb} at {url}: reply is not a JSON object")
        return reply

    def filter(self, pod: Obj, nodes: Sequence[Obj]) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """Filter: returns (passing node names, FailedNodes, FailedAndUnresolvableNodes)."""
        by_name = {n["metadata"]["name"]: n for n in nodes}
        if self.config.node_cache_capable:
            args = {"Pod": _wire(pod), "Nodes": None, "NodeNames": list(by_name)}
        else:
            args = {"Pod": _wire(pod), "Nodes": {"metadata": {}, "items": [_wire(n) for n in nodes]}, "NodeNames": None}
        reply = self.send(self.config.filter_verb, args)
        error = _field(reply, "Error")
        if error:
            raise ExtenderError(str(error))
        passed: list[str] = []
        names = _field(reply, "NodeNames")
        node_list = _field(reply, "Nodes")
        if self.config.node_cache_capable and names is not None:
            for name in names:
                if name not in by_name:
                    raise ExtenderError(
                        f"extender {self.config.url_prefix!r} claims a filtered node {name!r} "
                        "which is not found in the input node list"
                    )
                passed.append(name)
        elif node_list is not None:
            for item in _field(node_list, "items") or []:
                name = ((item or {}).get("metadata") or {}).get("name", "")
                if name not in by_name:
                    raise ExtenderError(f"extender returned node {name!r} which was not in the request")
                passed.append(name)
        failed = {str(k): str(v) for k, v in (_field(reply, "FailedNodes") or {}).items()}
        unresolvable = {str(k): str(v) for k, v in (_field(reply, "FailedAndUnresolvableNodes") or {}).items()}
        return passed, failed, unresolvable

    def process_preemption(
        self, pod: Obj, victims: Mapping[str, list[Obj]], pods_on_node: Mapping[str, Sequence[Obj]]
    ) -> dict[str, list[Obj] | None]:
        """ProcessPreemption: candidates in, the extender's candidates (as pods) out."""
        if self.config.node_cache_capable:
            args = {
                "Pod": _wire(pod),
                "NodeNameToVictims": None,
                "NodeNameToMetaVictims": {
                    node: {"Pods": [{"UID": p["metadata"].get("uid", "")} for p in pods], "NumPDBViolations": 0}
                    for node, pods in victims.items()
                },
            }
        else:
            args = {
                "Pod": _wire(pod),
                "NodeNameToVictims": {
                    node: {"Pods": [_wire(p) for p in pods], "NumPDBViolations": 0} for node, pods in victims.items()
                },
                "NodeNameToMetaVictims": None,
            }
        reply = self.send(self.config.preempt_verb, args)
        result: dict[str, list[Obj] | None] = {}
        for node, meta in (_field(reply, "NodeNameToMetaVictims") or {}).items():
            if node not in pods_on_node:
                raise ExtenderError(f"extender returned unknown node {node!r} for preemption")
            if meta is None:
                result[node] = None
                continue
            by_uid = {p["metadata"].get("uid"): p for p in pods_on_node[node]}
            chosen = []
            for meta_pod in _field(meta, "Pods") or []:
                uid = _field(meta_pod or {}, "UID")
                if uid not in by_uid:
                    raise ExtenderError(
                        f"extender claims to preempt pod (UID: {uid}) on node: {node}, but the pod is not found on that node"
                    )
                chosen.append(by_uid[uid])
            result[node] = chosen
        return result


# --- resource arithmetic (NodeResourcesFit) ------------------------------------------


def _quantity(value: Any) -> Decimal:
    try:
        return Decimal(parse_quantity(value))
    except (ValueError, TypeError):
        return Decimal(0)


def pod_requests(pod: Obj) -> dict[str, Decimal]:
    """Effective requests: max(sum of containers, each init container) plus overhead."""
    spec = pod.get("spec") or {}
    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for name, value in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = total.get(name, Decimal(0)) + _quantity(value)
    for container in spec.get("initContainers") or []:
        for name, value in ((container.get("resources") or {}).get("requests") or {}).items():
            total[name] = max(total.get(name, Decimal(0)), _quantity(value))
    for name, value in (spec.get("overhead") or {}).items():
        total[name] = total.get(name, Decimal(0)) + _quantity(value)
    return total


def _allocatable(node: Obj) -> dict[str, Decimal]:
    status = node.get("status") or {}
    raw = status.get("allocatable") or status.get("capacity") or {}
    return {name: _quantity(value) for name, value in raw.items()}


def _priority(pod: Obj) -> int:
    return int((pod.get("spec") or {}).get("priority") or 0)


def _key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _uid(obj: Obj) -> str:
    return (obj.get("metadata") or {}).get("uid", "")


def _terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _tolerates_unschedulable(pod: Obj) -> bool:
    for t in (pod.get("spec") or {}).get("tolerations") or []:
        key, op = t.get("key", ""), t.get("operator", "Equal")
        if (key == "" and op == "Exists") or key == "node.kubernetes.io/unschedulable":
            if t.get("effect", "") in ("", "NoSchedule"):
                return True
    return False


def _static_filters(pod: Obj, node: Obj) -> tuple[str, str] | None:
    """NodeUnschedulable and NodeAffinity (nodeSelector): failures preemption cannot resolve."""
    if (node.get("spec") or {}).get("unschedulable") and not _tolerates_unschedulable(pod):
        return UNRESOLVABLE, "node(s) were unschedulable"
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in ((pod.get("spec") or {}).get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return UNRESOLVABLE, "node(s) didn't match Pod's node affinity/selector"
    return None


def _fit_reasons(pod: Obj, node: Obj, others: Iterable[Obj]) -> list[str]:
    """NodeResourcesFit: requests of ``pod`` against allocatable minus ``others``."""
    allocatable = _allocatable(node)
    used: dict[str, Decimal] = {}
    count = 0
    for other in others:
        count += 1
        for name, value in pod_requests(other).items():
            used[name] = used.get(name, Decimal(0)) + value
    reasons = []
    if "pods" in allocatable and count + 1 > allocatable["pods"]:
        reasons.append("Too many pods")
    for name, value in sorted(pod_requests(pod).items()):
        if value <= 0 or name == "pods":
            continue
        if value > allocatable.get(name, Decimal(0)) - used.get(name, Decimal(0)):
            reasons.append(f"Insufficient {name}")
    return reasons


def _free_score(pod: Obj, node: Obj, others: Iterable[Obj]) -> Decimal:
    """LeastAllocated over cpu and memory: the share left after placing the pod."""
    allocatable = _allocatable(node)
    used = pod_requests(pod)
    for other in others:
        for name, value in pod_requests(other).items():
            used[name] = used.get(name, Decimal(0)) + value
    score = Decimal(0)
    for name in ("cpu", "memory"):
        cap = allocatable.get(name, Decimal(0))
        if cap > 0:
            score += (cap - used.get(name, Decimal(0))) / cap
    return score


def _fit_error_message(total: int, statuses: Mapping[str, tuple[str, str]]) -> str:
    counts: dict[str, int] = {}
    for _code, reason in statuses.values():
        for part in reason.split(", "):
            counts[part] = counts.get(part, 0) + 1
    parts = sorted(f"{n} {reason}" for reason, n in counts.items())
    return f"0/{total} nodes are available: {', '.join(parts)}." if parts else f"0/{total} nodes are available."


def _discard(resp: Any) -> None:
    """Read a raw response to its end and hand the connection back to the pool."""
    resp.drain_conn()
    resp.release_conn()


def _now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- informer -------------------------------------------------------------------------


class _Gone(Exception):
    """The WATCH answered 410: relist."""


class _Informer:
    """A reflector + store for one resource: LIST rv=0, WATCH from its rv, relist on 410."""

    def __init__(
        self,
        kind: str,
        list_fn: Callable[..., Any],
        timings: Timings,
        stop: threading.Event,
        on_replace: Callable[[dict[str, Obj]], None],
        on_event: Callable[[str, Obj], None],
    ) -> None:
        self.kind = kind
        self._list_fn = list_fn
        self._timings = timings
        self._stop = stop
        self._on_replace = on_replace
        self._on_event = on_event
        self.synced = threading.Event()
        self.lists = 0
        self.watches = 0
        self._resp: Any = None
        self._resp_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"informer-{kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def interrupt(self) -> None:
        with self._resp_lock:
            resp = self._resp
        if resp is not None:
            try:
                resp.shutdown()
            except Exception:  # noqa: BLE001 - best effort on a dying socket
                pass

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        list_rv = "0"
        while not self._stop.is_set():
            try:
                rv = self._list(list_rv)
            except Exception as e:  # noqa: BLE001 - any failure: retry like the reflector
                log.info("%s informer: LIST failed: %s", self.kind, e)
                self._stop.wait(self._timings.retry_period)
                continue
            self.synced.set()
            list_rv = "0"
            while not self._stop.is_set():
                try:
                    rv = self._watch(rv)
                except _Gone:
                    log.info("%s informer: watch 410 Gone at %s, relisting", self.kind, rv)
                    list_rv = ""  # reflector: relist with a consistent read after 410
                    break
                except Exception as e:  # noqa: BLE001
                    if self._stop.is_set():
                        return
                    log.info("%s informer: WATCH failed: %s", self.kind, e)
                    self._stop.wait(self._timings.retry_period)

    def _list(self, resource_version: str) -> str:
        kwargs: dict[str, Any] = {"_preload_content": False, "_request_timeout": self._timings.request_timeout}
        if resource_version:
            kwargs["resource_version"] = resource_version
        resp = self._list_fn(**kwargs)
        body = json.loads(resp.data)
        self.lists += 1
        items = {}
        for item in body.get("items") or []:
            items[_key(item)] = item
        self._on_replace(items)
        return str((body.get("metadata") or {}).get("resourceVersion", "0"))

    def _watch(self, rv: str) -> str:
        try:
            resp = self._list_fn(
                watch=True,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=int(self._timings.watch_timeout),
                _preload_content=False,
                _request_timeout=(self._timings.request_timeout, self._timings.watch_timeout + 10),
            )
        except ApiException as e:
            if e.status == 410:
                raise _Gone() from e
            raise
        self.watches += 1
        with self._resp_lock:
            self._resp = resp
        try:
            if self._stop.is_set():
                return rv
            for line in self._lines(resp):
                event = json.loads(line)
                etype = event.get("type")
                obj = event.get("object") or {}
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if new_rv:
                    rv = str(new_rv)
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(etype, obj)
        finally:
            with self._resp_lock:
                self._resp = None
            resp.close()  # never hand a half-read stream back to the pool
        return rv

    @staticmethod
    def _lines(resp: Any) -> Iterator[bytes]:
        buffer = b""
        if resp.chunked:
            chunks: Iterable[bytes] = resp.stream(amt=None, decode_content=True)
        else:
            chunks = iter(lambda: resp.read1(65536), b"")
        for chunk in chunks:
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    yield line
        if buffer.strip():
            yield buffer


# --- scheduling queue -----------------------------------------------------------------


@dataclasses.dataclass
class _Queued:
    key: str
    uid: str
    where: str  # "active" | "backoff" | "unschedulable" | "inflight"
    timestamp: float  # when it last entered the queue (backoff counts from here)
    attempts: int = 0
    cycle: int = 0
    last_failure_unschedulable: bool = False


# --- the scheduler --------------------------------------------------------------------


class Scheduler:
    """A kube-scheduler that reads Pods and Nodes from one replica (see the module docstring).

    ``kubeconfig`` is a file aimed at the replica the scheduler's informers use;
    binds, status patches and evictions go to the same replica. Call
    :meth:`start` (waits for the first LISTs) and :meth:`stop`, or use it as a
    context manager.
    """

    def __init__(
        self,
        kubeconfig: str,
        *,
        extenders: Sequence[ExtenderConfig] = (),
        scheduler_name: str = "default-scheduler",
        timings: Timings | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.scheduler_name = scheduler_name
        self.timings = timings or Timings()
        self._extender_configs = tuple(extenders)
        self._extenders: list[_ExtenderClient] = []
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._pods: dict[str, Obj] = {}
        self._nodes: dict[str, Obj] = {}
        self._queue: dict[str, _Queued] = {}
        self._assumed: dict[str, tuple[str, Obj]] = {}  # uid -> (node, pod with nodeName)
        self._nominated: dict[str, tuple[str, Obj]] = {}  # uid -> (node, pod)
        self._stats: dict[str, PodStats] = {}
        self._cycle = 0
        self._move_request_cycle = -1
        self._next_backoff_flush = 0.0
        self._next_unschedulable_flush = 0.0
        self._api_client: Any = None
        self._watch_client: Any = None
        self._informers: list[_Informer] = []
        self._thread: threading.Thread | None = None
        self._started = False

    # lifecycle

    def __enter__(self) -> Scheduler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the informers, wait until both have listed, start scheduling cycles."""
        if self._started:
            raise RuntimeError("scheduler already started")
        self._started = True
        self._extenders = [_ExtenderClient(c) for c in self._extender_configs]
        self._api_client = k8s_config.new_client_from_config(config_file=self.kubeconfig)
        self._watch_client = k8s_config.new_client_from_config(config_file=self.kubeconfig)
        self._api = k8s_client.CoreV1Api(self._api_client)
        watch_api = k8s_client.CoreV1Api(self._watch_client)
        self._informers = [
            _Informer("pods", watch_api.list_pod_for_all_namespaces, self.timings, self._stop,
                      self._replace_pods, self._pod_event),
            _Informer("nodes", watch_api.list_node, self.timings, self._stop, self._replace_nodes, self._node_event),
        ]
        for informer in self._informers:
            informer.start()
        deadline = time.monotonic() + self.timings.sync_timeout
        for informer in self._informers:
            if not informer.synced.wait(max(0.0, deadline - time.monotonic())):
                self.stop()
                raise TimeoutError(f"{informer.kind} informer did not sync within {self.timings.sync_timeout}s")
        self._thread = threading.Thread(target=self._loop, name="scheduling-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling and the informers; joins every thread."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for informer in self._informers:
            informer.interrupt()
        if self._thread is not None:
            self._thread.join(self.timings.request_timeout + max((c.http_timeout for c in self._extender_configs), default=0) + 5)
        for informer in self._informers:
            informer.interrupt()
            informer.join(self.timings.request_timeout + 5)
        for ext in self._extenders:
            ext.close()
        for api_client in (self._api_client, self._watch_client):
            if api_client is not None:
                api_client.close()
        self._api_client = self._watch_client = None

    # observation

    def stats(self) -> dict[str, PodStats]:
        """A deep copy of the per-pod counters, keyed ``namespace/name``."""
        with self._lock:
            return copy.deepcopy(self._stats)

    def queue(self) -> dict[str, str]:
        """Where each pending pod is: ``active``, ``backoff``, ``unschedulable`` or ``inflight``."""
        with self._lock:
            return {key: q.where for key, q in self._queue.items()}

    def informer_pods(self) -> dict[str, Obj]:
        """A copy of the pod informer's store."""
        with self._lock:
            return copy.deepcopy(self._pods)

    def informer_stats(self) -> dict[str, dict[str, int]]:
        """LISTs and WATCHes each informer has made: ``{"pods": {"lists": n, "watches": m}, "nodes": {...}}``."""
        return {i.kind: {"lists": i.lists, "watches": i.watches} for i in self._informers}

    def wait_for(self, predicate: Callable[[dict[str, PodStats]], bool], timeout: float, interval: float = 0.02) -> bool:
        """Poll :meth:`stats` until ``predicate`` holds; False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            if predicate(self.stats()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)

    def _stat(self, key: str, uid: str = "") -> PodStats:
        stats = self._stats.get(key)
        if stats is None:
            stats = self._stats[key] = PodStats(uid=uid)
        elif uid and stats.uid != uid:
            stats.uid = uid
        return stats

    # informer handlers (eventhandlers.go)

    def _responsible(self, pod: Obj) -> bool:
        spec = pod.get("spec") or {}
        return (
            not spec.get("nodeName")
            and (spec.get("schedulerName") or "default-scheduler") == self.scheduler_name
            and not _terminal(pod)
        )

    def _replace_pods(self, items: dict[str, Obj]) -> None:
        with self._cond:
            for key in list(self._pods):
                if key not in items:
                    self._pod_event_locked("DELETED", self._pods[key])
            for key, pod in items.items():
                self._pod_event_locked("MODIFIED" if key in self._pods else "ADDED", pod)

    def _replace_nodes(self, items: dict[str, Obj]) -> None:
        with self._cond:
            for name in list(self._nodes):
                if name not in items:
                    del self._nodes[name]
            self._nodes.update({n["metadata"]["name"]: n for n in items.values()})
            self._move_all_locked()

    def _node_event(self, etype: str, node: Obj) -> None:
        log.debug("node %s %s rv=%s", etype, node["metadata"]["name"], node["metadata"].get("resourceVersion"))
        with self._cond:
            name = node["metadata"]["name"]
            if etype == "DELETED":
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = node
            self._move_all_locked()

    def _pod_event(self, etype: str, pod: Obj) -> None:
        log.debug("pod %s %s rv=%s", etype, _key(pod), (pod.get("metadata") or {}).get("resourceVersion"))
        with self._cond:
            self._pod_event_locked(etype, pod)

    def _pod_event_locked(self, etype: str, pod: Obj) -> None:
        key = _key(pod)
        old = self._pods.get(key)
        if etype == "DELETED":
            self._pods.pop(key, None)
            queued = self._queue.get(key)
            if queued is not None and queued.where != "inflight":
                del self._queue[key]
            self._forget_uid(_uid(pod))
            self._move_all_locked()
            return
        self._pods[key] = pod
        if old is not None and _uid(old) != _uid(pod):
            self._forget_uid(_uid(old))
        if (pod.get("spec") or {}).get("nodeName"):
            self._assumed.pop(_uid(pod), None)
            self._nominated.pop(_uid(pod), None)
            queued = self._queue.get(key)
            if queued is not None and queued.where != "inflight":
                del self._queue[key]
            self._move_all_locked()
            return
        if not self._responsible(pod):
            return
        queued = self._queue.get(key)
        if queued is None:
            self._queue[key] = _Queued(key=key, uid=_uid(pod), where="active", timestamp=time.monotonic())
            self._cond.notify_all()
        elif queued.where == "unschedulable" and old is not None and self._pod_updated(old, pod):
            self._requeue_locked(queued)
        if queued is not None:
            queued.uid = _uid(pod)

    @staticmethod
    def _pod_updated(old: Obj, new: Obj) -> bool:
        """isPodUpdated: anything but resourceVersion, managedFields and status changed."""

        def strip(p: Obj) -> Obj:
            p = dict(p)
            p.pop("status", None)
            meta = dict(p.get("metadata") or {})
            for k in ("resourceVersion", "managedFields", "generation"):
                meta.pop(k, None)
            p["metadata"] = meta
            return p

        return strip(old) != strip(new)

    def _forget_uid(self, uid: str) -> None:
        self._assumed.pop(uid, None)
        self._nominated.pop(uid, None)

    # queue operations (caller holds the lock)

    def _backoff_expired(self, queued: _Queued, now: float) -> bool:
        return now >= queued.timestamp + self.timings.backoff(queued.attempts)

    def _requeue_locked(self, queued: _Queued) -> None:
        queued.where = "active" if self._backoff_expired(queued, time.monotonic()) else "backoff"
        self._cond.notify_all()

    def _move_all_locked(self) -> None:
        """moveAllToActiveOrBackoffQueue: every cluster event requeues the unschedulable pool."""
        self._move_request_cycle = self._cycle
        for queued in self._queue.values():
            if queued.where == "unschedulable":
                self._requeue_locked(queued)

    def _pop(self) -> _Queued | None:
        """Next pod from activeQ (highest priority, then oldest); runs the two flush tickers."""
        with self._cond:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= self._next_backoff_flush:  # flushBackoffQCompleted
                    for queued in self._queue.values():
                        if queued.where == "backoff" and self._backoff_expired(queued, now):
                            queued.where = "active"
                    self._next_backoff_flush = now + self.timings.backoff_flush_period
                if now >= self._next_unschedulable_flush:  # flushUnschedulablePodsLeftover
                    for queued in self._queue.values():
                        if (queued.where == "unschedulable"
                                and now - queued.timestamp >= self.timings.pod_max_in_unschedulable):
                            self._requeue_locked(queued)
                    self._next_unschedulable_flush = now + self.timings.unschedulable_flush_period
                active = [q for q in self._queue.values() if q.where == "active"]
                if active:
                    best = min(active, key=lambda q: (-_priority(self._pods.get(q.key, {})), q.timestamp))
                    best.where = "inflight"
                    best.attempts += 1
                    self._cycle += 1
                    best.cycle = self._cycle
                    return best
                self._cond.wait(max(0.001, min(self._next_backoff_flush, self._next_unschedulable_flush) - now))
        return None

    def _done(self, queued: _Queued) -> None:
        with self._cond:
            if self._queue.get(queued.key) is queued:
                del self._queue[queued.key]

    def _add_unschedulable_if_not_present(self, queued: _Queued, unschedulable: bool) -> None:
        """AddUnschedulableIfNotPresent: errors go to backoffQ; unschedulable pods to the pool,
        or to backoffQ when a cluster event arrived during their cycle."""
        with self._cond:
            if self._queue.get(queued.key) is not queued:
                return
            queued.timestamp = time.monotonic()
            queued.last_failure_unschedulable = unschedulable
            if unschedulable and self._move_request_cycle < queued.cycle:
                queued.where = "unschedulable"
            else:
                queued.where = "backoff"
            self._cond.notify_all()

    # the scheduling cycle

    def _loop(self) -> None:
        while not self._stop.is_set():
            queued = self._pop()
            if queued is None:
                return
            try:
                self._schedule_one(queued)
            except Exception:  # noqa: BLE001 - a cycle must never kill the loop
                log.exception("scheduling cycle for %s failed", queued.key)
                self._add_unschedulable_if_not_present(queued, unschedulable=False)

    def _snapshot(self) -> tuple[dict[str, Obj], dict[str, list[Obj]], dict[str, list[Obj]]]:
        """Nodes, pods per node (bound and assumed), nominated pods per node."""
        with self._lock:
            nodes = dict(self._nodes)
            on_node: dict[str, list[Obj]] = {name: [] for name in nodes}
            for pod in self._pods.values():
                node = (pod.get("spec") or {}).get("nodeName")
                if node and not _terminal(pod) and node in on_node:
                    on_node[node].append(pod)
            for node, pod in self._assumed.values():
                if node in on_node:
                    on_node[node].append(pod)
            nominated: dict[str, list[Obj]] = {}
            for node, pod in self._nominated.values():
                nominated.setdefault(node, []).append(pod)
        return nodes, on_node, nominated

    def _schedule_one(self, queued: _Queued) -> None:
        with self._lock:
            pod = self._pods.get(queued.key)
            if pod is None or not self._responsible(pod):
                self._done_locked(queued)
                return
            # skipPodSchedule: being deleted, or already assumed (bound, the informer not caught up yet).
            if (pod.get("metadata") or {}).get("deletionTimestamp") or _uid(pod) in self._assumed:
                self._done_locked(queued)
                return
            stats = self._stat(queued.key, _uid(pod))
            stats.attempts += 1
        nodes, on_node, nominated = self._snapshot()
        uid = _uid(pod)
        priority = _priority(pod)

        statuses: dict[str, tuple[str, str]] = {}
        feasible: list[str] = []
        for name in sorted(nodes):
            node = nodes[name]
            failure = _static_filters(pod, node)
            if failure is None:
                others = on_node[name] + [
                    p for p in nominated.get(name, []) if _uid(p) != uid and _priority(p) >= priority
                ]
                reasons = _fit_reasons(pod, node, others)
                if reasons:
                    failure = (UNSCHEDULABLE, ", ".join(reasons))
            if failure is None:
                feasible.append(name)
            else:
                statuses[name] = failure

        for ext in self._extenders:
            if not feasible:
                break
            if not ext.config.filter_verb or not ext.interested(pod):
                continue
            with self._lock:
                stats.filter_calls += 1
            try:
                passed, failed, unresolvable = ext.filter(pod, [nodes[n] for n in feasible])
            except ExtenderError as e:
                if ext.config.ignorable:
                    log.info("skipping ignorable extender %s: %s", ext.config.url_prefix, e)
                    continue
                with self._lock:
                    stats.scheduling_errors += 1
                self._failure(queued, pod, unschedulable=False, reason="SchedulerError", message=str(e))
                return
            for name, message in unresolvable.items():
                statuses[name] = (UNRESOLVABLE, message)
            for name, message in failed.items():
                if name not in unresolvable:
                    statuses[name] = (UNSCHEDULABLE, message)
            feasible = passed

        if not feasible:
            message = _fit_error_message(len(nodes), statuses)
            nominated_node, post_message = self._preempt(pod, stats, nodes, on_node, nominated, statuses)
            if post_message:
                message = f"{message} {post_message}"
            if nominated_node:
                with self._lock:
                    self._nominated[uid] = (nominated_node, pod)
                    stats.nominated_node = nominated_node
            self._failure(queued, pod, unschedulable=True, reason="Unschedulable", message=message,
                          nominated_node=nominated_node)
            return

        def score(name: str) -> tuple[Decimal, str]:
            return (-_free_score(pod, nodes[name], on_node[name]), name)

        host = min(feasible, key=score)
        bound = copy.deepcopy(pod)
        bound.setdefault("spec", {})["nodeName"] = host
        with self._lock:
            self._assumed[uid] = (host, bound)  # assume
            self._nominated.pop(uid, None)
            stats.bind_attempts += 1
        status, message = self._bind(pod, host)
        if status is None:
            with self._lock:
                stats.bound_node = host
                stats.last_message = ""
            self._done(queued)
            return
        with self._lock:
            self._assumed.pop(uid, None)  # forget
            stats.bind_failures[status] = stats.bind_failures.get(status, 0) + 1
        self._failure(queued, pod, unschedulable=False, reason="SchedulerError",
                      message=f'running Bind plugin "DefaultBinder": {message}')

    def _done_locked(self, queued: _Queued) -> None:
        if self._queue.get(queued.key) is queued:
            del self._queue[queued.key]

    def _failure(self, queued: _Queued, pod: Obj, *, unschedulable: bool, reason: str, message: str,
                 nominated_node: str = "") -> None:
        """handleSchedulingFailure: requeue only if the informer still has the pod, then patch status."""
        with self._lock:
            stats = self._stat(queued.key)
            stats.last_message = message
            if unschedulable:
                stats.unschedulable += 1
            cached = self._pods.get(queued.key)
        if cached is None or (cached.get("spec") or {}).get("nodeName"):
            self._done(queued)
        else:
            self._add_unschedulable_if_not_present(queued, unschedulable)
        self._update_pod_status(pod, reason, message, nominated_node)

    # API writes

    def _status_of(self, e: ApiException) -> tuple[int, str]:
        try:
            body = json.loads(e.body or b"{}")
            message = body.get("message") or e.reason or ""
        except (ValueError, AttributeError):
            message = str(e.reason or "")
        return int(e.status or 0), message

    def _bind(self, pod: Obj, node: str) -> tuple[int | None, str]:
        meta = pod["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid", "")},
            "target": {"kind": "Node", "name": node},
        }
        try:
            _discard(self._api.create_namespaced_pod_binding(
                meta["name"], meta["namespace"], body,
                _preload_content=False, _request_timeout=self.timings.request_timeout,
            ))
        except ApiException as e:
            return self._status_of(e)
        except urllib3.exceptions.HTTPError as e:
            return 0, str(e)
        return None, ""

    def _update_pod_status(self, pod: Obj, reason: str, message: str, nominated_node: str) -> None:
        """updatePod: patch only when the condition or nominatedNodeName changes (against the queued copy)."""
        status = pod.get("status") or {}
        current = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
        nnn_changed = bool(nominated_node) and status.get("nominatedNodeName", "") != nominated_node
        condition_changed = current is None or (current.get("status"), current.get("reason"), current.get("message")) != (
            "False", reason, message)
        if not condition_changed and not nnn_changed:
            return
        condition = {"type": "PodScheduled", "status": "False", "reason": reason, "message": message,
                     "lastProbeTime": None, "lastTransitionTime": _now_rfc3339()}
        if current is not None and current.get("status") == "False":
            condition["lastTransitionTime"] = current.get("lastTransitionTime")
        patch: Obj = {"status": {"conditions": [condition]}}
        if nnn_changed:
            patch["status"]["nominatedNodeName"] = nominated_node
        key = _key(pod)
        with self._lock:
            self._stat(key).status_patches += 1
        failure = self._patch_status(pod, patch)
        if failure is not None:
            with self._lock:
                failures = self._stat(key).status_patch_failures
                failures[failure] = failures.get(failure, 0) + 1

    def _patch_status(self, pod: Obj, patch: Obj) -> int | None:
        meta = pod["metadata"]
        try:
            _discard(self._api.patch_namespaced_pod_status(
                meta["name"], meta["namespace"], patch,
                _content_type="application/strategic-merge-patch+json",
                _preload_content=False, _request_timeout=self.timings.request_timeout,
            ))
        except ApiException as e:
            return int(e.status or 0)
        except urllib3.exceptions.HTTPError:
            return 0
        return None

    # preemption (framework/preemption/preemption.go)

    def _eligible(self, pod: Obj, on_node: Mapping[str, list[Obj]]) -> str:
        """PodEligibleToPreemptOthers: '' if eligible, else why not."""
        spec = pod.get("spec") or {}
        if spec.get("preemptionPolicy") == "Never":
            return "not eligible due to preemptionPolicy=Never."
        nominated = (pod.get("status") or {}).get("nominatedNodeName")
        if nominated and nominated in on_node:
            priority = _priority(pod)
            for p in on_node[nominated]:
                if (p.get("metadata") or {}).get("deletionTimestamp") and _priority(p) < priority:
                    return "not eligible due to a terminating pod on the nominated node."
        return ""

    @staticmethod
    def _select_victims(pod: Obj, node: Obj, pods: list[Obj], nominated: list[Obj]) -> list[Obj]:
        """SelectVictimsOnNode: drop every lower-priority pod, then reprieve the most important first."""
        priority = _priority(pod)
        uid = _uid(pod)
        higher_nominated = [p for p in nominated if _uid(p) != uid and _priority(p) >= priority]
        potential = [p for p in pods if _priority(p) < priority]
        if not potential:
            return []
        kept = [p for p in pods if _priority(p) >= priority]
        if _fit_reasons(pod, node, kept + higher_nominated):
            return []
        potential.sort(key=lambda p: (-_priority(p), (p.get("status") or {}).get("startTime") or "", _key(p)))
        victims = []
        for p in potential:
            if not _fit_reasons(pod, node, kept + [p] + higher_nominated):
                kept.append(p)
            else:
                victims.append(p)
        return victims

    def _preempt(self, pod: Obj, stats: PodStats, nodes: Mapping[str, Obj], on_node: Mapping[str, list[Obj]],
                 nominated: Mapping[str, list[Obj]], statuses: Mapping[str, tuple[str, str]]) -> tuple[str, str]:
        """DefaultPreemption's PostFilter: returns (nominated node, message appended to the fit error)."""
        why_not = self._eligible(pod, on_node)
        if why_not:
            return "", f"preemption: {why_not}"
        candidates: dict[str, list[Obj]] = {}
        why: dict[str, tuple[str, str]] = {}
        for name in sorted(nodes):
            code = statuses.get(name, (UNRESOLVABLE, ""))[0]
            if code != UNSCHEDULABLE:  # nodesWherePreemptionMightHelp
                why[name] = (UNRESOLVABLE, "Preemption is not helpful for scheduling")
                continue
            victims = self._select_victims(pod, nodes[name], on_node[name], nominated.get(name, []))
            if victims:
                candidates[name] = victims
            else:
                why[name] = (UNSCHEDULABLE, "No preemption victims found for incoming pod")
        if not candidates:
            return "", f"preemption: {_fit_error_message(len(nodes), why)}"
        for ext in self._extenders:
            if not ext.config.preempt_verb or not ext.interested(pod):
                continue
            with self._lock:
                stats.preempt_calls += 1
            try:
                result = ext.process_preemption(pod, candidates, on_node)
            except ExtenderError as e:
                if ext.config.ignorable:
                    continue
                with self._lock:
                    stats.scheduling_errors += 1
                return "", f"preemption: {e}"
            checked: dict[str, list[Obj]] = {}
            for name, victims in result.items():
                if not victims:
                    if ext.config.ignorable:
                        continue
                    with self._lock:
                        stats.scheduling_errors += 1
                    return "", f'preemption: expected at least one victim pod on node "{name}"'
                checked[name] = victims
            candidates = checked
            if not candidates:
                break
        if not candidates:
            return "", "preemption: no candidate node for preemption"

        def rank(name: str) -> tuple[int, int, int, str]:
            victims = candidates[name]
            prios = [_priority(v) for v in victims]
            return (max(prios), sum(prios), len(victims), name)

        best = min(candidates, key=rank)
        preemptor = _key(pod)
        for victim in candidates[best]:
            if (victim.get("metadata") or {}).get("deletionTimestamp"):
                continue
            if self._evict(victim, pod):
                with self._lock:
                    stats.evictions.append(_key(victim))
                    self._stat(_key(victim), _uid(victim)).evicted_by = preemptor
        return best, ""

    def _evict(self, victim: Obj, preemptor: Obj) -> bool:
        """prepareCandidate: DisruptionTarget condition, then DELETE. True if the DELETE succeeded."""
        meta = victim["metadata"]
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": f"{self.scheduler_name}: preempting to accommodate a higher priority pod",
            "lastTransitionTime": _now_rfc3339(),
        }
        self._patch_status(victim, {"status": {"conditions": [condition]}})
        try:
            _discard(self._api.delete_namespaced_pod(
                meta["name"], meta["namespace"],
                _preload_content=False, _request_timeout=self.timings.request_timeout,
            ))
        except ApiException as e:
            log.info("preemption: deleting %s for %s failed: %s", _key(victim), _key(preemptor), e.status)
            return False
        except urllib3.exceptions.HTTPError as e:
            log.info("preemption: deleting %s failed: %s", _key(victim), e)
            return False
        return True
