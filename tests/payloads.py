"""What callers send the guard, written once: ``from payloads import filter_body, binding_review``.

kube-scheduler's extender calls (k8s.io/kube-scheduler/extender/v1: ExtenderArgs, ExtenderPreemptionArgs; Go
field names as keys) and the apiserver's AdmissionReview of a pods/binding CREATE. Each returns the
document as a dict: ``GuardProcess.post`` encodes it, a raw socket test uses ``orjson.dumps``. The
tests of malformed input (tests/integration/test_hostile_input.py, tests/unit/test_admission.py) build
their own documents: their subject is the shape.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any


def scheduler_pod(namespace: str, name: str, uid: str | None, *, spec: bool = True) -> dict[str, Any]:
    """The Pod as kube-scheduler embeds it (TypeMeta empty: no apiVersion/kind). ``uid=None`` leaves the
    UID out (a forged call); ``spec=False`` sends the metadata alone (all the guard reads)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid is not None:
        meta["uid"] = uid
    if not spec:
        return {"metadata": meta}
    return {"metadata": meta, "spec": {"containers": [{"name": "app", "image": "pause"}]},
            "status": {"phase": "Pending"}}


def filter_body(namespace: str, name: str, uid: str | None, nodes: Sequence[str] = ("n1",), *,
                node_list: list[dict[str, Any]] | None = None, spec: bool = True) -> dict[str, Any]:
    """ExtenderArgs for the filter verb: ``NodeNames`` (nodeCacheCapable) or, with ``node_list``, the
    full ``Nodes`` list (``NodeNames`` null)."""
    pod = scheduler_pod(namespace, name, uid, spec=spec)
    if node_list is not None:
        return {"Pod": pod, "Nodes": node_list, "NodeNames": None}
    return {"Pod": pod, "Nodes": None, "NodeNames": list(nodes)}


def preempt_body(namespace: str, name: str, uid: str | None, node: str = "n1", *, victim_uid: str = "v-1",
                 spec: bool = True) -> dict[str, Any]:
    """ExtenderPreemptionArgs with meta victims (nodeCacheCapable): one victim on ``node``."""
    return {"Pod": scheduler_pod(namespace, name, uid, spec=spec), "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {node: {"Pods": [{"UID": victim_uid}], "NumPDBViolations": 0}}}


def binding_review(namespace: str, name: str, uid: str | None, *, node: str = "n1", dry_run: bool | None = None,
                   review_uid: str | None = None) -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview of a pods/binding CREATE (``dry_run=None``: no dryRun field)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid is not None:
        meta["uid"] = uid
    request: dict[str, Any] = {
        "uid": review_uid or str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Binding"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": "binding",
        "name": name, "namespace": namespace, "operation": "CREATE",
        "object": {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}}
    if dry_run is not None:
        request["dryRun"] = dry_run
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
