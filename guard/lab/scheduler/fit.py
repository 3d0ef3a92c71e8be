"""Which nodes a pod fits: the built-in filters, NodeResourcesFit arithmetic, scoring, victims.

Pure functions of pod and node objects (decoded JSON), like the plugins of
pkg/scheduler/framework/plugins (noderesources, nodeunschedulable,
nodeaffinity) and DefaultPreemption's SelectVictimsOnNode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

from guard.lab.scheduler.config import Obj

UNSCHEDULABLE = "Unschedulable"
UNRESOLVABLE = "UnschedulableAndUnresolvable"

Status = tuple[str, tuple[str, ...]]
"""A node's failure: (code, reasons), as framework.Status: one reason per failed check
(NodeResourcesFit gives "Insufficient cpu" and "Insufficient memory" separately; an
extender's FailedNodes entry is one reason, commas and all)."""


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


def pod_priority(pod: Obj) -> int:
    return int((pod.get("spec") or {}).get("priority") or 0)


def object_key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def object_uid(obj: Obj) -> str:
    return (obj.get("metadata") or {}).get("uid", "")


def is_terminal(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def _tolerates_unschedulable(pod: Obj) -> bool:
    for t in (pod.get("spec") or {}).get("tolerations") or []:
        key, op = t.get("key", ""), t.get("operator", "Equal")
        if (key == "" and op == "Exists") or key == "node.kubernetes.io/unschedulable":
            if t.get("effect", "") in ("", "NoSchedule"):
                return True
    return False


def static_filters(pod: Obj, node: Obj) -> Status | None:
    """NodeUnschedulable and NodeAffinity (nodeSelector): failures preemption cannot resolve."""
    if (node.get("spec") or {}).get("unschedulable") and not _tolerates_unschedulable(pod):
        return UNRESOLVABLE, ("node(s) were unschedulable",)
    labels = (node.get("metadata") or {}).get("labels") or {}
    for key, value in ((pod.get("spec") or {}).get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return UNRESOLVABLE, ("node(s) didn't match Pod's node affinity/selector",)
    return None


def fit_reasons(pod: Obj, node: Obj, others: Iterable[Obj]) -> list[str]:
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


def free_score(pod: Obj, node: Obj, others: Iterable[Obj]) -> Decimal:
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


def fit_error_message(total: int, statuses: Mapping[str, Status]) -> str:
    """FitError.Error(): how many nodes gave each reason, sorted."""
    counts: dict[str, int] = {}
    for _code, reasons in statuses.values():
        for reason in reasons:
            counts[reason] = counts.get(reason, 0) + 1
    parts = sorted(f"{n} {reason}" for reason, n in counts.items())
    return f"0/{total} nodes are available: {', '.join(parts)}." if parts else f"0/{total} nodes are available."


def select_victims(pod: Obj, node: Obj, pods: list[Obj], nominated: list[Obj]) -> list[Obj]:
    """SelectVictimsOnNode: drop every lower-priority pod, then reprieve the most important first."""
    priority = pod_priority(pod)
    uid = object_uid(pod)
    higher_nominated = [p for p in nominated if object_uid(p) != uid and pod_priority(p) >= priority]
    potential = [p for p in pods if pod_priority(p) < priority]
    if not potential:
        return []
    kept = [p for p in pods if pod_priority(p) >= priority]
    if fit_reasons(pod, node, kept + higher_nominated):
        return []
    potential.sort(key=lambda p: (-pod_priority(p), (p.get("status") or {}).get("startTime") or "", object_key(p)))
    victims = []
    for p in potential:
        if not fit_reasons(pod, node, kept + [p] + higher_nominated):
            kept.append(p)
        else:
            victims.append(p)
    return victims
