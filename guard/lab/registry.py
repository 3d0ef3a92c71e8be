"""What a replica writes to etcd: create, update, patch, delete, bind (the generic registry store).

Mirrors k8s.io/apiserver/pkg/registry/generic/registry/store.go (GuaranteedUpdate:
read, change, compare-and-swap on mod_revision, retry) and
pkg/registry/core/pod/storage/storage.go (BindingREST). Reads without a
resourceVersion (``get_quorum``) go to etcd like the real GET.
"""

from __future__ import annotations

import base64
import copy
import datetime
import hashlib
import random
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from guard.lab.api import (
    ApiError, Obj, Resource, already_exists, apply_patch, bad_request, conflict, invalid, modified_conflict, not_found,
    known_resource, now_micro, now_rfc3339, uid_precondition_failed, validate_name, delete_precondition_failed,
)
from guard.lab.watchcache import decode
from guard.lab.store import KV, EtcdClient

MAX_RETRIES = 16
PODS = known_resource("", "v1", "pods")


def encode(obj: Obj) -> bytes:
    out = dict(obj)
    if isinstance(out.get("metadata"), dict):
        out["metadata"] = {k: v for k, v in out["metadata"].items() if k != "resourceVersion"}
    return orjson.dumps(out, option=orjson.OPT_SORT_KEYS)


def storage_form(r: Resource, obj: Obj) -> Obj:
    """events.k8s.io/v1 Events are stored as core v1 Events (pkg/apis/events conversion)."""
    if r.group != "events.k8s.io":
        return obj
    out = {k: v for k, v in obj.items() if k not in ("regarding", "note", "reportingController", "deprecatedSource",
                                                      "deprecatedFirstTimestamp", "deprecatedLastTimestamp", "deprecatedCount")}
    out["apiVersion"], out["kind"] = "v1", "Event"
    for new, old in (("regarding", "involvedObject"), ("note", "message"), ("reportingController", "reportingComponent"),
                     ("deprecatedSource", "source"), ("deprecatedFirstTimestamp", "firstTimestamp"),
                     ("deprecatedLastTimestamp", "lastTimestamp"), ("deprecatedCount", "count")):
        if new in obj:
            out[old] = obj[new]
    return out


def output_form(r: Resource, obj: Obj) -> Obj:
    """The object as resource ``r`` shows it (core Events converted for events.k8s.io/v1)."""
    if r.group != "events.k8s.io":
        return obj
    out = {k: v for k, v in obj.items() if k not in ("involvedObject", "message", "reportingComponent", "source",
                                                      "firstTimestamp", "lastTimestamp", "count")}
    out["apiVersion"], out["kind"] = "events.k8s.io/v1", "Event"
    for new, old in (("regarding", "involvedObject"), ("note", "message"), ("reportingController", "reportingComponent"),
                     ("deprecatedSource", "source"), ("deprecatedFirstTimestamp", "firstTimestamp"),
                     ("deprecatedLastTimestamp", "lastTimestamp"), ("deprecatedCount", "count")):
        if old in obj:
            out[new] = obj[old]
    return out


def output_field(r: Resource, field: str) -> str:
    """Map an events.k8s.io field label onto the stored (core) field."""
    if r.group != "events.k8s.io":
        return field
    if field.startswith("regarding."):
        return "involvedObject." + field[len("regarding."):]
    return {"reportingController": "reportingComponent"}.get(field, field)


def _type_error(field: str, want: str, value: Any) -> ApiError:
    """How the apiserver's JSON decoder rejects a wrongly typed field (400)."""
    got = {dict: "object", list: "array", str: "string", bool: "bool", int: "number", float: "number"}.get(type(value), "null")
    return bad_request(f"json: cannot unmarshal {got} into Go struct field {field} of type {want}")


def check_shape(obj: Any) -> None:
    """Reject objects whose common fields have the wrong JSON type (what decoding into Go structs would refuse)."""
    if not isinstance(obj, dict):
        raise bad_request("the body of the request must be a JSON object")
    meta = obj.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise _type_error(".metadata", "v1.ObjectMeta", meta)
    for k in ("name", "generateName", "namespace", "uid", "resourceVersion"):
        if meta.get(k) is not None and not isinstance(meta[k], str):
            raise _type_error(f"ObjectMeta.metadata.{k}", "string", meta[k])
    for k in ("labels", "annotations"):
        v = meta.get(k)
        if v is not None and (not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values())):
            raise _type_error(f"ObjectMeta.metadata.{k}", "map[string]string", v)
    fin = meta.get("finalizers")
    if fin is not None and (not isinstance(fin, list) or not all(isinstance(x, str) for x in fin)):
        raise _type_error("ObjectMeta.metadata.finalizers", "[]string", fin)
    for k in ("spec", "status"):
        if obj.get(k) is not None and not isinstance(obj[k], dict):
            raise _type_error(f".{k}", "struct", obj[k])
    containers = (obj.get("spec") or {}).get("containers")
    if containers is not None and (not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers)):
        raise _type_error("PodSpec.spec.containers", "[]v1.Container", containers)


def _meta(obj: Obj) -> Obj:
    m = obj.get("metadata")
    if not isinstance(m, dict):
        m = obj["metadata"] = {}
    return m


def _suffix() -> str:
    return "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))


def _pod_defaults(pod: Obj) -> None:
    spec = pod.setdefault("spec", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("priority", 0)
    spec.setdefault("enableServiceLinks", True)
    # PrepareForCreate: whatever status the client sent is replaced
    pod["status"] = {"phase": "Pending", "qosClass": _qos_class(spec)}


def _qos_class(spec: Obj) -> str:
    """pkg/apis/core/helper/qos GetPodQOS, for cpu and memory."""
    requests: list[dict] = []
    limits: list[dict] = []
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        res = (c.get("resources") or {}) if isinstance(c, dict) else {}
        requests.append({k: v for k, v in (res.get("requests") or {}).items() if k in ("cpu", "memory")})
        limits.append({k: v for k, v in (res.get("limits") or {}).items() if k in ("cpu", "memory")})
    if not any(requests) and not any(limits):
        return "BestEffort"
    for req, lim in zip(requests, limits):
        if set(lim) != {"cpu", "memory"} or any(req.get(k, lim[k]) != lim[k] for k in lim):
            return "Burstable"
    return "Guaranteed"


def _status_update(r: Resource, cur: Obj, new: Obj) -> Obj:
    """A write to the status subresource changes the status only (registry strategies' status
    PrepareForUpdate; apiextensions-apiserver customresource status_strategy.go: the old object is
    copied, then the new status set, or removed when the new object has none)."""
    if "status" in new:
        cur["status"] = new["status"]
    elif r.custom:
        cur.pop("status", None)
    else:
        cur["status"] = {}
    return cur


def _custom_update(cur: Obj, new: Obj) -> Obj:
    """A write to a custom resource itself keeps the stored status (strategy.go PrepareForUpdate with the
    status subresource enabled) and bumps metadata.generation when anything but metadata and status
    changed."""
    if "status" in cur:
        new["status"] = cur["status"]
    else:
        new.pop("status", None)
    changed = {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
        {k: v for k, v in cur.items() if k not in ("metadata", "status")}
    generation = int((cur.get("metadata") or {}).get("generation") or 1)
    _meta(new)["generation"] = generation + 1 if changed else generation
    return new


class Registry:
    def __init__(self, client: EtcdClient) -> None:
        self.etcd = client

    # --- reads ---------------------------------------------------------------

    def _read(self, r: Resource, key: str, name: str) -> tuple[Obj, KV]:
        kv, _ = self.etcd.get(key)
        if kv is None:
            raise not_found(r, name)
        return decode(kv.value, kv.mod_revision), kv

    def get_quorum(self, r: Resource, namespace: str | None, name: str) -> Obj:
        """GET without resourceVersion: a linearizable read from etcd."""
        return self._read(r, r.key(namespace, name), name)[0]

    def list_quorum(self, r: Resource, namespace: str | None, revision: int = 0) -> tuple[list[Obj], int]:
        kvs, rev = self.etcd.range_prefix(r.prefix(namespace), revision)
        return [decode(kv.value, kv.mod_revision) for kv in kvs], (revision or rev)

    # --- create --------------------------------------------------------------

    def create(self, r: Resource, namespace: str | None, body: Any) -> Obj:
        check_shape(body)
        obj = storage_form(r, copy.deepcopy(body))
        meta = _meta(obj)
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + _suffix()
            else:
                raise invalid(r, "", "metadata.name", "name or generateName is required")
        name = meta["name"]
        if not isinstance(name, str):
            raise _type_error("ObjectMeta.metadata.name", "string", name)
        validate_name(r, name)  # 422 as the real apiserver answers (ValidateObjectMeta), e.g. for "web-0,x=y"
        if r.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        storage_r = r if r.group != "events.k8s.io" else known_resource("", "v1", "events")
        obj["apiVersion"], obj["kind"] = storage_r.api_version, storage_r.kind
        meta.pop("resourceVersion", None)
        meta.pop("deletionTimestamp", None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        if r is PODS:
            if not isinstance(obj.get("spec"), dict) or not obj["spec"].get("containers"):
                raise invalid(r, name, "spec.containers", "")
            _pod_defaults(obj)
        if r.custom:
            # apiextensions-apiserver customresource strategy.go PrepareForCreate: with the status
            # subresource enabled the status sent with a create is dropped; metadata.generation = 1.
            obj.pop("status", None)
            meta["generation"] = 1
        created, rev, _ = self.etcd.create(r.key(namespace, name), encode(obj))
        if not created:
            raise already_exists(r, name)
        meta["resourceVersion"] = str(rev)
        return output_form(r, obj)

    # --- update / patch --------------------------------------------------------

    def _guaranteed_update(self, r: Resource, namespace: str | None, name: str, change: Any,
                           uid: str | None = None, resource_version: str | None = None) -> Obj:
        """GuaranteedUpdate: read from etcd, ``change(current) -> new``, compare-and-swap, retry on races."""
        key = r.key(namespace, name)
        for _ in range(MAX_RETRIES):
            cur, kv = self._read(r, key, name)
            cmeta = _meta(cur)
            if uid and uid != cmeta.get("uid"):
                raise uid_precondition_failed(r, key, name, uid, cmeta.get("uid", ""))
            if resource_version and resource_version != cmeta.get("resourceVersion"):
                raise modified_conflict(r, name)
            new = change(copy.deepcopy(cur))
            nmeta = _meta(new)
            for k in ("uid", "creationTimestamp", "name", "namespace"):
                if k in cmeta:
                    nmeta[k] = cmeta[k]
            if "deletionTimestamp" in cmeta:
                nmeta["deletionTimestamp"] = cmeta["deletionTimestamp"]
                if "deletionGracePeriodSeconds" in cmeta:
                    nmeta["deletionGracePeriodSeconds"] = cmeta["deletionGracePeriodSeconds"]
            if nmeta.get("deletionTimestamp") and not nmeta.get("finalizers"):
                ok, rev, _ = self.etcd.delete(key, kv.mod_revision)  # last finalizer gone: the object goes
            else:
                ok, rev, _ = self.etcd.update(key, encode(new), kv.mod_revision)
            if ok:
                nmeta["resourceVersion"] = str(rev)
                return new
        raise conflict(r.qualified, name, "too many concurrent updates")

    def update(self, r: Resource, namespace: str | None, name: str, body: Any, status_only: bool = False) -> Obj:
        check_shape(body)
        body = storage_form(r, copy.deepcopy(body))
        bmeta = _meta(body)
        if bmeta.get("name", name) != name:
            raise bad_request("the name of the object does not match the name on the URL")
        rv = bmeta.get("resourceVersion") or None

        def change(cur: Obj) -> Obj:
            if status_only:
                return _status_update(r, cur, body)
            body.setdefault("apiVersion", cur.get("apiVersion"))
            body.setdefault("kind", cur.get("kind"))
            if r is PODS:
                body["spec"] = cur.get("spec")  # pod spec is (nearly) immutable; binding sets nodeName
                body.setdefault("status", cur.get("status"))
            if r.custom:
                return _custom_update(cur, body)
            return body

        return output_form(r, self._guaranteed_update(r, namespace, name, change, resource_version=rv))

    def patch(self, r: Resource, namespace: str | None, name: str, content_type: str, body: bytes,
              status_only: bool = False) -> Obj:
        def change(cur: Obj) -> Obj:
            patched = apply_patch(content_type, output_form(r, cur), body)
            if not isinstance(patched, dict):
                raise bad_request("the patch produced no object")
            check_shape(patched)
            patched = storage_form(r, patched)
            prv = (patched.get("metadata") or {}).get("resourceVersion")
            if prv and prv != cur["metadata"]["resourceVersion"]:
                raise modified_conflict(r, name)
            if status_only:
                return _status_update(r, cur, patched)
            if r.custom:
                return _custom_update(cur, patched)
            return patched

        return output_form(r, self._guaranteed_update(r, namespace, name, change))

    # --- delete -------------------------------------------------------------------

    def delete(self, r: Resource, namespace: str | None, name: str, grace: int | None,
               uid: str | None = None, resource_version: str | None = None) -> tuple[Obj, bool]:
        """Delete; returns (the object as last written, whether it is gone).

        Pods are deleted gracefully like the generic store does for any
        graceful-delete strategy (store.go updateForGracefulDeletionAndFinalizers):
        first an update sets ``deletionTimestamp`` and ``deletionGracePeriodSeconds``
        (the period from pod/strategy.go CheckGracefulDelete: the request's, else
        the pod's ``terminationGracePeriodSeconds``, 0 when unscheduled or
        finished), then the object is removed. With a period > 0 a real cluster
        waits for the kubelet's final delete; the lab plays that kubelet at once.
        Objects with finalizers only get ``deletionTimestamp``.
        """
        key = r.key(namespace, name)
        for _ in range(MAX_RETRIES):
            cur, kv = self._read(r, key, name)
            meta = _meta(cur)
            if uid and uid != meta.get("uid"):
                raise delete_precondition_failed(r, name, "UID", uid, meta.get("uid", ""))
            if resource_version and resource_version != meta.get("resourceVersion"):
                raise delete_precondition_failed(r, name, "ResourceVersion", resource_version, meta.get("resourceVersion", ""))
            if (r is PODS or meta.get("finalizers")) and not meta.get("deletionTimestamp"):
                spec, status = cur.get("spec") or {}, cur.get("status") or {}
                period = grace if grace is not None else int(spec.get("terminationGracePeriodSeconds", 0) or 0)
                if r is not PODS or not spec.get("nodeName") or status.get("phase") in ("Failed", "Succeeded"):
                    period = 0
                if period < 0:
                    period = 1
                when = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=period)
                meta["deletionTimestamp"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
                meta["deletionGracePeriodSeconds"] = period
                ok, rev, _ = self.etcd.update(key, encode(cur), kv.mod_revision)
                if not ok:
                    continue
                meta["resourceVersion"] = str(rev)
                if meta.get("finalizers"):
                    return output_form(r, cur), False
                ok, _, _ = self.etcd.delete(key, rev)  # grace period over (or the lab's kubelet confirms)
                if ok:
                    return output_form(r, cur), True
                continue
            if meta.get("finalizers"):
                return output_form(r, cur), False
            ok, _, _ = self.etcd.delete(key, kv.mod_revision)
            if ok:
                return output_form(r, cur), True
        raise conflict(r.qualified, name, "too many concurrent updates")

    # --- binding (pkg/registry/core/pod/storage/storage.go BindingREST) -----------

    def bind(self, namespace: str, name: str, body: Any) -> None:
        check_shape(body)
        meta = body.get("metadata") or {}
        if meta.get("name") and meta["name"] != name:
            raise bad_request("name in URL does not match name in Binding object")
        target = body.get("target") or {}
        if not isinstance(target, dict):
            raise _type_error("Binding.target", "v1.ObjectReference", target)
        node = target.get("name")
        if node is not None and not isinstance(node, str):
            raise _type_error("ObjectReference.target.name", "string", node)
        if not node:
            raise invalid(PODS, name, "target.name", "")
        annotations = meta.get("annotations") or {}

        def change(pod: Obj) -> Obj:
            pmeta = _meta(pod)
            if pmeta.get("deletionTimestamp"):
                raise conflict("pods/binding", name, f"pod {name} is being deleted, cannot be assigned to a host")
            if pod.get("spec", {}).get("nodeName"):
                raise conflict("pods/binding", name, f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
            pod.setdefault("spec", {})["nodeName"] = node
            if annotations:
                pmeta.setdefault("annotations", {}).update(annotations)
            conds = pod.setdefault("status", {}).setdefault("conditions", [])
            cond = {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now_rfc3339()}
            for i, c in enumerate(conds):
                if c.get("type") == "PodScheduled":
                    conds[i] = cond
                    break
            else:
                conds.append(cond)
            return pod

        self._guaranteed_update(PODS, namespace, name, change, uid=meta.get("uid") or None,
                                resource_version=meta.get("resourceVersion") or None)

    # --- the apiserver's own objects -------------------------------------------------

    def ensure(self, r: Resource, namespace: str | None, obj: Obj) -> None:
        """Create ``obj`` if absent (bootstrap objects)."""
        try:
            self.create(r, namespace, obj)
        except Exception as e:  # noqa: BLE001 - AlreadyExists is fine
            if getattr(e, "reason", "") != "AlreadyExists":
                raise

    def reconcile_endpoints(self, ip: str, port: int, present: bool) -> None:
        """Add or remove one apiserver IP in ``default/kubernetes`` Endpoints and EndpointSlice
        (pkg/controlplane/reconcilers/lease.go: each apiserver adds itself, removes itself on shutdown)."""
        ports = [{"name": "https", "port": port, "protocol": "TCP"}]
        ep_r, es_r = known_resource("", "v1", "endpoints"), known_resource("discovery.k8s.io", "v1", "endpointslices")

        def ips_of_ep(o: Obj) -> list[str]:
            return [a["ip"] for s in o.get("subsets") or [] for a in s.get("addresses") or []]

        def set_ep(o: Obj, ips: list[str]) -> None:
            o["subsets"] = [{"addresses": [{"ip": i} for i in ips], "ports": ports}] if ips else []

        def ips_of_es(o: Obj) -> list[str]:
            return [a for e in o.get("endpoints") or [] for a in e.get("addresses") or []]

        def set_es(o: Obj, ips: list[str]) -> None:
            o["endpoints"] = [{"addresses": [i], "conditions": {"ready": True}} for i in ips]
            o["ports"] = ports
            o["addressType"] = "IPv4"

        targets: list[tuple[Resource, Obj, Callable[[Obj], list[str]], Callable[[Obj, list[str]], None]]] = [
            (ep_r, {"metadata": {"name": "kubernetes", "namespace": "default",
                                 "labels": {"endpointslice.kubernetes.io/skip-mirror": "true"}}}, ips_of_ep, set_ep),
            (es_r, {"metadata": {"name": "kubernetes", "namespace": "default",
                                 "labels": {"kubernetes.io/service-name": "kubernetes"}},
                    "addressType": "IPv4", "endpoints": [], "ports": ports}, ips_of_es, set_es),
        ]
        for r, blank, get_ips, set_ips in targets:
            for _ in range(MAX_RETRIES):
                key = r.key("default", "kubernetes")
                kv, _ = self.etcd.get(key)
                obj = decode(kv.value, kv.mod_revision) if kv else copy.deepcopy(blank)
                ips = set(get_ips(obj))
                want = (ips | {ip}) if present else (ips - {ip})
                if kv is not None and want == ips and (not present or r is not es_r or obj.get("ports") == ports):
                    break
                ordered = sorted(want, key=lambda s: tuple(int(p) for p in s.split(".")))
                set_ips(obj, ordered)
                if kv is None:
                    obj["apiVersion"], obj["kind"] = r.api_version, r.kind
                    obj["metadata"]["uid"] = str(uuid.uuid4())
                    obj["metadata"]["creationTimestamp"] = now_rfc3339()
                    ok, _, _ = self.etcd.create(key, encode(obj))
                else:
                    ok, _, _ = self.etcd.update(key, encode(obj), kv.mod_revision)
                if ok:
                    break

    def write_identity_lease(self, hostname: str, peer_address: str | None = None) -> Obj:
        """The apiserver identity lease (pkg/controlplane/apiserver/server.go, controller/apiserverleasegc).

        ``peer_address`` ("IP:PORT") adds the ``kubernetes.io/peer-advertise-address`` annotation, which
        only the UnknownVersionInteroperabilityProxy feature gate sets (k8s.io/api/core/v1 well_known_labels).
        """
        digest = hashlib.sha256(hostname.encode()).digest()[:16]
        lease_name = "apiserver-" + base64.b32encode(digest).decode().rstrip("=").lower()
        r = known_resource("coordination.k8s.io", "v1", "leases")
        holder = f"{lease_name}_{uuid.uuid4()}"
        spec = {"holderIdentity": holder, "leaseDurationSeconds": 3600, "renewTime": now_micro()}
        labels = {"apiserver.kubernetes.io/identity": "kube-apiserver", "kubernetes.io/hostname": hostname}
        annotations = {"kubernetes.io/peer-advertise-address": peer_address} if peer_address else {}
        meta: Obj = {"name": lease_name, "labels": labels}
        if annotations:
            meta["annotations"] = annotations
        try:
            return self.create(r, "kube-system", {"metadata": meta, "spec": spec})
        except Exception as e:  # noqa: BLE001
            if getattr(e, "reason", "") != "AlreadyExists":
                raise

        def change(cur: Obj) -> Obj:
            cur["spec"] = spec
            _meta(cur)["labels"] = labels
            if annotations:
                _meta(cur)["annotations"] = annotations
            else:
                _meta(cur).pop("annotations", None)
            return cur

        return self._guaranteed_update(r, "kube-system", lease_name, change)


