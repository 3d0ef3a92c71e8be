"""``AdmissionReview`` (admission.k8s.io/v1) for ``pods/binding`` CREATE. Pure.

Admission runs before the binding storage's existence check, so a validating
webhook sees the ghost's bind. The scheduler sets the Binding's
``metadata.uid`` to the pod's UID, so replaced pods are caught too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from guard.core.extender import ProtocolError, decode, pod_ref
from guard.core.verdict import PodRef

API_VERSION = "admission.k8s.io/v1"


@dataclass(frozen=True, slots=True)
class BindingReview:
    uid: str  # the AdmissionReview request UID, echoed in the response
    pod: PodRef | None  # None: not a pods/binding CREATE, allow without a check
    dry_run: bool = False  # request.dryRun: answer, but record nothing (sideEffects: NoneOnDryRun)


def parse_review(body: bytes) -> BindingReview:
    doc = decode(body)
    if not isinstance(doc, dict):
        raise ProtocolError("request body must be an AdmissionReview object")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != "AdmissionReview":
        raise ProtocolError(f"expected apiVersion {API_VERSION} kind AdmissionReview, got "
                            f"{str(doc.get('apiVersion'))[:60]} {str(doc.get('kind'))[:60]}")
    req = doc.get("request")
    if not isinstance(req, dict):
        raise ProtocolError("AdmissionReview.request is missing or not an object")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid or len(uid) > 128:
        raise ProtocolError("AdmissionReview.request.uid is missing or not a string")
    raw_resource = req.get("resource")
    resource: dict[str, Any] = raw_resource if isinstance(raw_resource, dict) else {}
    if (resource.get("resource") != "pods" or req.get("subResource") != "binding"
            or req.get("operation") != "CREATE" or resource.get("group", "") != ""):
        return BindingReview(uid, None)
    obj: Any = req.get("object")
    if not isinstance(obj, dict):
        raise ProtocolError("AdmissionReview.request.object (the Binding) is missing")
    raw_meta = obj.get("metadata")
    meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    binding = {"metadata": {"name": meta.get("name") or req.get("name"),
                            "namespace": meta.get("namespace") or req.get("namespace") or "default",
                            "uid": meta.get("uid") or ""}}
    dry_run = req.get("dryRun", False)
    if not isinstance(dry_run, bool):
        raise ProtocolError("AdmissionReview.request.dryRun must be a boolean")
    return BindingReview(uid, pod_ref(binding, field="Binding"), dry_run)


def build_response(uid: str, *, allowed: bool, message: str = "") -> bytes:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if not allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": message}
    return orjson.dumps({"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response})
