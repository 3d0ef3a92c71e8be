"""Writes to the apiserver: the heal's pod and Node writes (:class:`PodWrites`, part of
:class:`guard.kube.reads.Kube`), core/v1 Events, and GhostPod audit records (:class:`GhostPods`).
Calls go through :func:`guard.kube.api.open_api` (the official ``kubernetes`` client, or its light twin)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import urllib3

from guard.core.names import visible
from guard.kube.api import ApiError, status_reason

if TYPE_CHECKING:
    from guard.kube.reads import Kube


class KubeWriteError(Exception):
    """A write the apiserver refused or did not answer: ``status`` (0: no answer), ``reason``, ``message``."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class PodWrites:
    """The heal's writes (guard/engine/healer.py, node_healer.py); a part of :class:`guard.kube.reads.Kube`."""

    core: Any
    timeout: float

    def create_pod(self, namespace: str, body: dict, timeout: float | None = None) -> dict:
        return self._write(lambda t: self.core.create_namespaced_pod(namespace, body, _preload_content=False,
                                                                     _request_timeout=t), timeout)

    def read_pod(self, namespace: str, name: str, timeout: float | None = None) -> dict:
        """The pod as etcd has it (GET without resourceVersion), whole; 404 raises KubeWriteError too."""
        return self._write(lambda t: self.core.read_namespaced_pod(name, namespace, _preload_content=False,
                                                                   _request_timeout=t), timeout)

    def delete_pod(self, namespace: str, name: str, uid: str, timeout: float | None = None) -> dict:
        """DELETE with a UID precondition (409 Conflict if the name now holds another pod) and no grace period."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        return self._write(lambda t: self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False,
                                                                     _request_timeout=t), timeout)

    def merge_patch_pod(self, namespace: str, name: str, patch: dict, timeout: float | None = None) -> dict:
        """A JSON merge patch; a ``metadata.resourceVersion`` in it is a precondition (409 Conflict otherwise)."""
        return self._write(lambda t: self.core.patch_namespaced_pod(name, namespace, patch, _preload_content=False,
                                                                    _content_type="application/merge-patch+json",
                                                                    _request_timeout=t), timeout)

    def create_node(self, body: dict, timeout: float | None = None) -> dict:
        """Create a Node (``heal node/NAME``'s placeholder, guard/engine/node_healer.py)."""
        return self._write(lambda t: self.core.create_node(body, _preload_content=False, _request_timeout=t), timeout)

    def read_node_object(self, name: str, timeout: float | None = None) -> dict:
        """The Node as etcd has it (GET without resourceVersion), whole; 404 raises KubeWriteError too."""
        return self._write(lambda t: self.core.read_node(name, _preload_content=False, _request_timeout=t), timeout)

    def delete_node(self, name: str, uid: str, timeout: float | None = None) -> dict:
        """DELETE a Node with a UID precondition (409 Conflict if the name now holds another Node)."""
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        return self._write(lambda t: self.core.delete_node(name, body=body, _preload_content=False,
                                                           _request_timeout=t), timeout)

    def _write(self, call, timeout: float | None) -> dict:
        t = self.timeout if timeout is None else timeout
        try:
            resp = call(t)
            return orjson.loads(resp.data)
        except ApiError as e:
            if not e.status:
                raise KubeWriteError(0, "TLSError", "TLS error talking to the apiserver") from e
            reason, body = status_reason(e)
            message = str(body.get("message") or e.reason or "")[:1000]
            raise KubeWriteError(e.status, reason or "Error", message) from e
        except (urllib3.exceptions.TimeoutError, TimeoutError) as e:
            if isinstance(e, urllib3.exceptions.NewConnectionError):
                raise KubeWriteError(0, "Unreachable", f"connection error: {type(e).__name__}") from e
            raise KubeWriteError(0, "Timeout", f"no answer within {t:g}s") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise KubeWriteError(0, "Unreachable", f"connection error: {type(e).__name__}") from e
        except (orjson.JSONDecodeError, ValueError) as e:
            raise KubeWriteError(0, "Undecodable", f"undecodable apiserver reply: {type(e).__name__}") from e


# --- Events -------------------------------------------------------------------


def _now_rfc3339() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def emit_event(kube: Kube, *, namespace: str, pod_name: str, pod_uid: str, reason: str, message: str,
               key: str = "", event_type: str = "Warning") -> None:
    """Create a core/v1 Event about a pod, or bump its count if it exists (aggregated, never repeated).

    The Event name is derived from the pod, its UID, the reason and ``key``, so
    every guard instance aggregates into the same Event.
    """
    import hashlib
    import socket

    digest = hashlib.sha256(f"{pod_uid}/{reason}/{key}".encode()).hexdigest()[:16]
    name = f"{pod_name[:200]}.{digest}"
    now = _now_rfc3339()
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod_name, "uid": pod_uid},
        "reason": reason, "message": visible(message)[:1024], "type": event_type,
        "source": {"component": "ghost-guard", "host": socket.gethostname()},
        "reportingComponent": "ghost-guard", "reportingInstance": socket.gethostname(),
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    try:
        kube.core.create_namespaced_event(namespace, body, _request_timeout=kube.timeout * 2)
        return
    except ApiError as e:
        if e.status != 409:
            raise
    resp = kube.core.read_namespaced_event(name, namespace, _preload_content=False, _request_timeout=kube.timeout * 2)
    count = int((orjson.loads(resp.data).get("count") or 1)) + 1
    kube.core.patch_namespaced_event(name, namespace, {"count": count, "lastTimestamp": now, "message": visible(message)[:1024]},
                                     _content_type="application/merge-patch+json", _request_timeout=kube.timeout * 2)


def emit_node_event(kube: Kube, node: str, reason: str, message: str) -> None:
    """A Warning Event about a Node (namespace default, as the node controller's), or its time and message
    bumped when it exists (aggregated, one per Node and reason)."""
    import hashlib
    import socket

    name = f"{node[:200]}.{hashlib.sha256(f'{node}/{reason}'.encode()).hexdigest()[:16]}"
    now = _now_rfc3339()
    body = {
        "apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "default"},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
        "reason": reason, "message": visible(message)[:1024], "type": "Warning",
        "source": {"component": "ghost-guard", "host": socket.gethostname()},
        "reportingComponent": "ghost-guard", "reportingInstance": socket.gethostname(),
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
    try:
        kube.core.create_namespaced_event("default", body, _request_timeout=kube.timeout * 2)
    except ApiError as e:
        if e.status != 409:
            raise
        kube.core.patch_namespaced_event(name, "default", {"lastTimestamp": now, "message": visible(message)[:1024]},
                                         _content_type="application/merge-patch+json",
                                         _request_timeout=kube.timeout * 2)


# --- GhostPod audit records (kube-ghost-guard.io/v1alpha1, manifests/crd) ------------------

GHOSTPOD_GROUP = "kube-ghost-guard.io"
GHOSTPOD_VERSION = "v1alpha1"
GHOSTPOD_PLURAL = "ghostpods"
GHOSTNODE_PLURAL = "ghostnodes"  # cluster-scoped: one per ghost Node identity (guard/core/ghostpod_mapping.py)


class GhostPodError(Exception):
    """A GhostPod call failed. ``status`` is the HTTP status (0: no answer: timeout, refused, TLS),
    ``reason`` the Status reason (``AlreadyExists``, ``Conflict``, ``NotFound``, ...).
    ``missing``: a 404 for the object itself (not for the resource: a CRD that is not installed)."""

    def __init__(self, status: int, reason: str, message: str, *, missing: bool = False, kind: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.missing = missing
        self.kind = kind  # the Status details' kind: "ghostpods", "namespaces" (the namespace is gone), ...

    @property
    def transient(self) -> bool:
        """Worth retrying later: no answer, 429, 5xx, or the resource not served (yet) / not allowed (yet).
        Not a 404 of the object's namespace (deleted: the record can never be written there)."""
        return self.status == 0 or self.status == 429 or self.status >= 500 or self.status in (401, 403) or (
            self.status == 404 and not self.missing and self.kind != "namespaces")


class GhostPods:
    """Raw calls on GhostPod objects; every client error becomes a :class:`GhostPodError`.
    ``GhostPods(kube, nodes=True)``: the same calls on the cluster-scoped GhostNode objects (``namespace``
    is then ignored)."""

    def __init__(self, kube: Kube, *, timeout: float = 5.0, list_timeout: float = 60.0, nodes: bool = False) -> None:
        self.kube = kube
        self.timeout = timeout
        self.list_timeout = list_timeout  # a page of a LIST (an apiserver may not paginate, as the lab does not)
        self.objects = kube.api.CustomObjectsApi()
        self.nodes = nodes
        self.plural = GHOSTNODE_PLURAL if nodes else GHOSTPOD_PLURAL

    def _call(self, what: str, fn, *args, timeout: float | None = None, **kwargs) -> dict:
        timeout = self.timeout if timeout is None else timeout
        try:
            resp = fn(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
            return orjson.loads(resp.data) if resp.data else {}
        except ApiError as e:
            if not e.status:
                raise GhostPodError(0, "", f"{what}: TLS error talking to the apiserver") from e
            reason, body = status_reason(e)
            raw_details = body.get("details")
            details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
            message = str(body.get("message") or e.reason or "")[:300]
            raise GhostPodError(e.status, reason, f"{what}: HTTP {e.status} {reason}: {message}",
                                missing=e.status == 404 and details.get("kind") == self.plural,
                                kind=str(details.get("kind") or "")) from e
        except urllib3.exceptions.NewConnectionError as e:
            raise GhostPodError(0, "", f"{what}: connection error: {type(e).__name__}") from e
        except (urllib3.exceptions.TimeoutError, TimeoutError) as e:
            raise GhostPodError(0, "", f"{what}: timeout after {timeout:g}s") from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise GhostPodError(0, "", f"{what}: connection error: {type(e).__name__}") from e
        except (orjson.JSONDecodeError, ValueError) as e:
            raise GhostPodError(0, "", f"{what}: undecodable apiserver reply: {type(e).__name__}") from e

    def create(self, namespace: str, body: dict) -> dict:
        if self.nodes:
            return self._call("create ghostnode", self.objects.create_cluster_custom_object,
                              GHOSTPOD_GROUP, GHOSTPOD_VERSION, GHOSTNODE_PLURAL, body)
        return self._call(f"create ghostpod in {namespace}", self.objects.create_namespaced_custom_object,
                          GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, body)

    def get(self, namespace: str, name: str) -> dict:
        """A quorum read (no resourceVersion): the newest object, to retry a write after a conflict."""
        if self.nodes:
            return self._call(f"get ghostnode {name}", self.objects.get_cluster_custom_object,
                              GHOSTPOD_GROUP, GHOSTPOD_VERSION, GHOSTNODE_PLURAL, name)
        return self._call(f"get ghostpod {namespace}/{name}", self.objects.get_namespaced_custom_object,
                          GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, name)

    def patch_status(self, namespace: str, name: str, patch: dict) -> dict:
        """A JSON merge patch of the status subresource (``patch`` may carry metadata.resourceVersion:
        then the apiserver applies it only to that version, else 409 Conflict)."""
        if self.nodes:
            return self._call(f"patch ghostnode {name} status", self.objects.patch_cluster_custom_object_status,
                              GHOSTPOD_GROUP, GHOSTPOD_VERSION, GHOSTNODE_PLURAL, name, patch,
                              _content_type="application/merge-patch+json")
        return self._call(f"patch ghostpod {namespace}/{name} status", self.objects.patch_namespaced_custom_object_status,
                          GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, name, patch,
                          _content_type="application/merge-patch+json")

    def list(self, namespace: str | None, *, limit: int = 500, cont: str | None = None) -> tuple[list[dict], str | None]:
        """One page of GhostPods (every namespace when ``namespace`` is None) and the continue token."""
        kwargs: dict = {"limit": limit, "timeout": self.list_timeout}
        if cont:
            kwargs["_continue"] = cont
        if namespace is None or self.nodes:
            doc = self._call(f"list {self.plural}", self.objects.list_cluster_custom_object, GHOSTPOD_GROUP,
                             GHOSTPOD_VERSION, self.plural, **kwargs)
        else:
            doc = self._call(f"list ghostpods in {namespace}", self.objects.list_namespaced_custom_object, GHOSTPOD_GROUP,
                             GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, **kwargs)
        raw_items = doc.get("items")
        items: list[Any] = raw_items if isinstance(raw_items, list) else []
        return [i for i in items if isinstance(i, dict)], ((doc.get("metadata") or {}).get("continue") or None)

    def delete(self, namespace: str, name: str, *, uid: str, resource_version: str) -> None:
        """Delete exactly this version of the object (preconditions): a record written since is kept."""
        options = {"apiVersion": "v1", "kind": "DeleteOptions",
                   "preconditions": {"uid": uid, "resourceVersion": resource_version}}
        if self.nodes:
            self._call(f"delete ghostnode {name}", self.objects.delete_cluster_custom_object, GHOSTPOD_GROUP,
                       GHOSTPOD_VERSION, GHOSTNODE_PLURAL, name, body=options)
            return
        self._call(f"delete ghostpod {namespace}/{name}", self.objects.delete_namespaced_custom_object,
                   GHOSTPOD_GROUP, GHOSTPOD_VERSION, namespace, GHOSTPOD_PLURAL, name, body=options)
