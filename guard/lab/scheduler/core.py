"""The scheduler: informers, queue and extenders wired into kube-scheduler's serial cycles.

pkg/scheduler/schedule_one.go (the cycle, binding, ``handleSchedulingFailure``),
eventhandlers.go (informer events into the queue) and
framework/preemption/preemption.go (DefaultPreemption's PostFilter). See the
package docstring (:mod:`guard.lab.scheduler`) for what is simulated.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from guard.lab.scheduler.config import ExtenderConfig, Obj, PodStats, Timings
from guard.lab.scheduler.extender import ExtenderClient, ExtenderError
from guard.lab.scheduler.fit import (
    UNRESOLVABLE,
    UNSCHEDULABLE,
    Status,
    fit_error_message,
    fit_reasons,
    free_score,
    is_terminal,
    object_key,
    object_uid,
    pod_priority,
    select_victims,
    static_filters,
)
from guard.lab.scheduler.informer import Informer
from guard.lab.scheduler.queue import Queued, SchedulingQueue

log = logging.getLogger(__name__)


def _discard(resp: Any) -> None:
    """Read a raw response to its end and hand the connection back to the pool."""
    resp.drain_conn()
    resp.release_conn()


def _now_rfc3339() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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
        self._extenders: list[ExtenderClient] = []
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._pods: dict[str, Obj] = {}
        self._nodes: dict[str, Obj] = {}
        self._queue = SchedulingQueue(self.timings, self._cond, self._stop)
        self._assumed: dict[str, tuple[str, Obj]] = {}  # uid -> (node, pod with nodeName)
        self._nominated: dict[str, tuple[str, Obj]] = {}  # uid -> (node, pod)
        self._stats: dict[str, PodStats] = {}
        self._api_client: Any = None
        self._watch_client: Any = None
        self._informers: list[Informer] = []
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
        self._extenders = [ExtenderClient(c) for c in self._extender_configs]
        self._api_client = k8s_config.new_client_from_config(config_file=self.kubeconfig)
        self._watch_client = k8s_config.new_client_from_config(config_file=self.kubeconfig)
        self._api = k8s_client.CoreV1Api(self._api_client)
        watch_api = k8s_client.CoreV1Api(self._watch_client)
        self._informers = [
            Informer("pods", watch_api.list_pod_for_all_namespaces, self.timings, self._stop,
                      self._replace_pods, self._pod_event),
            Informer("nodes", watch_api.list_node, self.timings, self._stop, self._replace_nodes, self._node_event),
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
            return self._queue.where_locked()

    def informer_pods(self) -> dict[str, Obj]:
        """A copy of the pod informer's store."""
        with self._lock:
            return copy.deepcopy(self._pods)

    def informer_nodes(self) -> dict[str, Obj]:
        """A copy of the node informer's store, keyed by node name."""
        with self._lock:
            return copy.deepcopy(self._nodes)

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
        """A pod this scheduler must place: unbound, its schedulerName, not finished, and not gated.

        A pod with ``spec.schedulingGates`` never enters activeQ: the SchedulingGates PreEnqueue plugin
        (pkg/scheduler/framework/plugins/schedulinggates) keeps it out until the gates are removed, so
        it is never filtered, bound or preempted for."""
        spec = pod.get("spec") or {}
        return (
            not spec.get("nodeName")
            and (spec.get("schedulerName") or "default-scheduler") == self.scheduler_name
            and not is_terminal(pod)
            and not spec.get("schedulingGates")
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
            self._queue.move_all_locked()

    def _node_event(self, etype: str, node: Obj) -> None:
        log.debug("node %s %s rv=%s", etype, node["metadata"]["name"], node["metadata"].get("resourceVersion"))
        with self._cond:
            name = node["metadata"]["name"]
            if etype == "DELETED":
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = node
            self._queue.move_all_locked()

    def _pod_event(self, etype: str, pod: Obj) -> None:
        log.debug("pod %s %s rv=%s", etype, object_key(pod), (pod.get("metadata") or {}).get("resourceVersion"))
        with self._cond:
            self._pod_event_locked(etype, pod)

    def _pod_event_locked(self, etype: str, pod: Obj) -> None:
        key = object_key(pod)
        old = self._pods.get(key)
        if etype == "DELETED":
            self._pods.pop(key, None)
            self._queue.discard_locked(key)
            self._forget_uid(object_uid(pod))
            self._queue.move_all_locked()
            return
        self._pods[key] = pod
        if old is not None and object_uid(old) != object_uid(pod):
            self._forget_uid(object_uid(old))
        if (pod.get("spec") or {}).get("nodeName"):
            self._assumed.pop(object_uid(pod), None)
            self._nominated.pop(object_uid(pod), None)
            self._queue.discard_locked(key)
            self._queue.move_all_locked()
            return
        if not self._responsible(pod):
            self._queue.discard_locked(key)  # e.g. gated now: out of the queues (a cycle holding it ends it)
            return
        uid = object_uid(pod)
        queued = self._queue.get_locked(key)
        if queued is None or (queued.where == "inflight" and queued.uid != uid):
            # A new pod, or a new pod under the name of one whose cycle still runs (bound, deleted and
            # recreated before the bind's answer came back): its own entry in activeQ. The real queue
            # keys activeQ by name but moved the popped pod to inFlightPods by UID (scheduling_queue.go
            # Pop, Done), so the old cycle's end never drops the new pod.
            self._queue.add_locked(key, uid)
            return
        if queued.where == "unschedulable" and old is not None and self._pod_updated(old, pod):
            self._queue.requeue_locked(queued)
        queued.uid = uid

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

    # the scheduling cycle

    def _loop(self) -> None:
        while not self._stop.is_set():
            queued = self._queue.pop(lambda key: pod_priority(self._pods.get(key, {})))
            if queued is None:
                return
            try:
                self._schedule_one(queued)
            except Exception:  # noqa: BLE001 - a cycle must never kill the loop
                log.exception("scheduling cycle for %s failed", queued.key)
                self._queue.add_unschedulable_if_not_present(queued, unschedulable=False)

    def _snapshot(self) -> tuple[dict[str, Obj], dict[str, list[Obj]], dict[str, list[Obj]]]:
        """Nodes, pods per node (bound and assumed), nominated pods per node."""
        with self._lock:
            nodes = dict(self._nodes)
            on_node: dict[str, list[Obj]] = {name: [] for name in nodes}
            for pod in self._pods.values():
                node = (pod.get("spec") or {}).get("nodeName")
                if node and not is_terminal(pod) and node in on_node:
                    on_node[node].append(pod)
            for node, pod in self._assumed.values():
                if node in on_node:
                    on_node[node].append(pod)
            nominated: dict[str, list[Obj]] = {}
            for node, pod in self._nominated.values():
                nominated.setdefault(node, []).append(pod)
        return nodes, on_node, nominated

    def _schedule_one(self, queued: Queued) -> None:
        with self._lock:
            pod = self._pods.get(queued.key)
            if pod is None or not self._responsible(pod):
                self._queue.done_locked(queued)
                return
            # skipPodSchedule: being deleted, or already assumed (bound, the informer not caught up yet).
            if (pod.get("metadata") or {}).get("deletionTimestamp") or object_uid(pod) in self._assumed:
                self._queue.done_locked(queued)
                return
            stats = self._stat(queued.key, object_uid(pod))
            stats.attempts += 1
        nodes, on_node, nominated = self._snapshot()
        uid = object_uid(pod)
        priority = pod_priority(pod)

        statuses: dict[str, Status] = {}
        feasible: list[str] = []
        for name in sorted(nodes):
            node = nodes[name]
            failure = static_filters(pod, node)
            if failure is None:
                others = on_node[name] + [
                    p for p in nominated.get(name, []) if object_uid(p) != uid and pod_priority(p) >= priority
                ]
                reasons = fit_reasons(pod, node, others)
                if reasons:
                    failure = (UNSCHEDULABLE, tuple(reasons))
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
                statuses[name] = (UNRESOLVABLE, (message,))
            for name, message in failed.items():
                if name not in unresolvable:
                    statuses[name] = (UNSCHEDULABLE, (message,))
            feasible = passed

        if not feasible:
            message = fit_error_message(len(nodes), statuses)
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
            return (-free_score(pod, nodes[name], on_node[name]), name)

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
            self._queue.done(queued)
            return
        with self._lock:
            self._assumed.pop(uid, None)  # forget
            stats.bind_failures[status] = stats.bind_failures.get(status, 0) + 1
        self._failure(queued, pod, unschedulable=False, reason="SchedulerError",
                      message=f'running Bind plugin "DefaultBinder": {message}')

    def _failure(self, queued: Queued, pod: Obj, *, unschedulable: bool, reason: str, message: str,
                 nominated_node: str = "") -> None:
        """handleSchedulingFailure: requeue only if the informer still has the pod, then patch status."""
        with self._lock:
            stats = self._stat(queued.key)
            stats.last_message = message
            if unschedulable:
                stats.unschedulable += 1
            cached = self._pods.get(queued.key)
        if cached is None or (cached.get("spec") or {}).get("nodeName"):
            self._queue.done(queued)
        else:
            self._queue.add_unschedulable_if_not_present(queued, unschedulable)
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
        key = object_key(pod)
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
            priority = pod_priority(pod)
            for p in on_node[nominated]:
                if (p.get("metadata") or {}).get("deletionTimestamp") and pod_priority(p) < priority:
                    return "not eligible due to a terminating pod on the nominated node."
        return ""

    def _preempt(self, pod: Obj, stats: PodStats, nodes: Mapping[str, Obj], on_node: Mapping[str, list[Obj]],
                 nominated: Mapping[str, list[Obj]], statuses: Mapping[str, Status]) -> tuple[str, str]:
        """DefaultPreemption's PostFilter: returns (nominated node, message appended to the fit error)."""
        why_not = self._eligible(pod, on_node)
        if why_not:
            return "", f"preemption: {why_not}"
        candidates: dict[str, list[Obj]] = {}
        why: dict[str, Status] = {}
        for name in sorted(nodes):
            code = statuses.get(name, (UNRESOLVABLE, ()))[0]
            if code != UNSCHEDULABLE:  # nodesWherePreemptionMightHelp
                why[name] = (UNRESOLVABLE, ("Preemption is not helpful for scheduling",))
                continue
            victims = select_victims(pod, nodes[name], on_node[name], nominated.get(name, []))
            if victims:
                candidates[name] = victims
            else:
                why[name] = (UNSCHEDULABLE, ("No preemption victims found for incoming pod",))
        if not candidates:
            return "", f"preemption: {fit_error_message(len(nodes), why)}"
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
            for name, chosen in result.items():
                if not chosen:
                    if ext.config.ignorable:
                        continue
                    with self._lock:
                        stats.scheduling_errors += 1
                    return "", f'preemption: expected at least one victim pod on node "{name}"'
                checked[name] = chosen
            candidates = checked
            if not candidates:
                break
        if not candidates:
            return "", "preemption: no candidate node for preemption"

        def rank(name: str) -> tuple[int, int, int, str]:
            victims = candidates[name]
            prios = [pod_priority(v) for v in victims]
            return (max(prios), sum(prios), len(victims), name)

        best = min(candidates, key=rank)
        preemptor = object_key(pod)
        for victim in candidates[best]:
            if (victim.get("metadata") or {}).get("deletionTimestamp"):
                continue
            if self._evict(victim, pod):
                with self._lock:
                    stats.evictions.append(object_key(victim))
                    self._stat(object_key(victim), object_uid(victim)).evicted_by = preemptor
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
            log.info("preemption: deleting %s for %s failed: %s", object_key(victim), object_key(preemptor), e.status)
            return False
        except urllib3.exceptions.HTTPError as e:
            log.info("preemption: deleting %s failed: %s", object_key(victim), e)
            return False
        return True
