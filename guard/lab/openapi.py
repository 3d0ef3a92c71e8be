"""The OpenAPI v3 documents a replica serves, so that ``kubectl create -f`` works without ``--validate=false``.

What kubectl (v1.25+) does before a create, update or apply with validation on (the default,
``--validate=strict``; k8s.io/kubectl/pkg/cmd/util/factory_client_access.go ``Validator``,
k8s.io/cli-runtime/pkg/resource/query_param_verifier_v3.go): it reads ``/openapi/v3`` (an index
of group-versions, each with a ``serverRelativeURL``), then that group-version's document, and
looks for a PATCH operation whose ``x-kubernetes-group-version-kind`` is the object's kind with a
``fieldValidation`` query parameter. Found: the server validates, kubectl sends
``?fieldValidation=Strict`` and validates nothing itself. Not found: kubectl validates on the
client against ``/openapi/v2``, which it only reads as protobuf.

So the documents list, for every resource a replica serves, its paths and operations with
the group-version-kind extension and the query parameters the lab honours (``fieldValidation``
among them, see :func:`guard.lab.api.unknown_fields`). Schemas are minimal but true: an object
with ``apiVersion``, ``kind``, ``metadata`` and, where the kind has them, ``spec`` and ``status``.
Pure: no sockets.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from guard.lab.api import RESOURCES, Resource

Obj = dict[str, Any]

FIELD_VALIDATION = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True},
                    "description": "Ignore, Warn or Strict: what to do with unknown or duplicate fields."}
_DRY_RUN = {"name": "dryRun", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
_FIELD_MANAGER = {"name": "fieldManager", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
_PRETTY = {"name": "pretty", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
_NAME = {"name": "name", "in": "path", "required": True, "schema": {"type": "string", "uniqueItems": True}}
_NAMESPACE = {"name": "namespace", "in": "path", "required": True, "schema": {"type": "string", "uniqueItems": True}}
_LIST_PARAMS = [{"name": n, "in": "query", "schema": {"type": t, "uniqueItems": True}} for n, t in (
    ("fieldSelector", "string"), ("labelSelector", "string"), ("resourceVersion", "string"),
    ("resourceVersionMatch", "string"), ("timeoutSeconds", "integer"), ("watch", "boolean"),
    ("allowWatchBookmarks", "boolean"), ("sendInitialEvents", "boolean"))]
_DELETE_PARAMS = [{"name": "gracePeriodSeconds", "in": "query", "schema": {"type": "integer", "uniqueItems": True}}]
_WITH_SPEC = {"Pod", "Node", "Namespace", "Service", "Lease"}
_WITH_STATUS = {"Pod", "Node", "Namespace", "Service"}


def gv_path(r: Resource) -> str:
    """``api/v1``, ``apis/coordination.k8s.io/v1``: the index key of a group-version."""
    return f"apis/{r.group}/{r.version}" if r.group else f"api/{r.version}"


def _schema_name(r: Resource) -> str:
    """``io.k8s.api.core.v1.Pod``, ``io.k8s.api.coordination.v1.Lease``: upstream's schema names."""
    return f"io.k8s.api.{r.group.split('.')[0] if r.group else 'core'}.{r.version}.{r.kind}"


def _gvk(r: Resource) -> Obj:
    return {"group": r.group, "version": r.version, "kind": r.kind}


def _ref(name: str) -> Obj:
    return {"$ref": f"#/components/schemas/{name}"}


def _op(r: Resource, action: str, params: list[Obj], body: bool, ok: int = 200) -> Obj:
    op: Obj = {"operationId": f"{action}{r.kind}", "tags": [gv_path(r).replace("/", "_")],
               "x-kubernetes-action": action, "x-kubernetes-group-version-kind": _gvk(r),
               "parameters": [_PRETTY, *params],
               "responses": {str(ok): {"description": "OK", "content": {"application/json": {"schema": _ref(_schema_name(r))}}},
                             "401": {"description": "Unauthorized"}}}
    if body:
        ctypes = (["application/json-patch+json", "application/merge-patch+json", "application/strategic-merge-patch+json"]
                  if action == "patch" else ["application/json"])
        op["requestBody"] = {"required": True, "content": {c: {"schema": _ref(_schema_name(r)) if action != "patch" else
                                                                {"type": "object"}} for c in ctypes}}
    return op


def _paths(r: Resource) -> dict[str, Obj]:
    base = f"/{gv_path(r)}"
    ns = [_NAMESPACE] if r.namespaced else []
    coll = f"{base}/namespaces/{{namespace}}/{r.plural}" if r.namespaced else f"{base}/{r.plural}"
    one = f"{coll}/{{name}}"
    write = [_DRY_RUN, _FIELD_MANAGER, FIELD_VALIDATION]
    out: dict[str, Obj] = {
        coll: {"parameters": ns, "get": _op(r, "list", _LIST_PARAMS, False),
               "post": _op(r, "post", write, True, 201)},
        one: {"parameters": [_NAME, *ns], "get": _op(r, "get", [{"name": "resourceVersion", "in": "query",
                                                                    "schema": {"type": "string"}}], False),
              "put": _op(r, "put", write, True), "patch": _op(r, "patch", write, True),
              "delete": _op(r, "delete", _DELETE_PARAMS, False)},
    }
    if r.namespaced:
        out[f"{base}/{r.plural}"] = {"get": _op(r, "list", _LIST_PARAMS, False)}
    if r.kind in _WITH_STATUS and not r.group:
        out[f"{one}/status"] = {"parameters": [_NAME, *ns], "get": _op(r, "get", [], False),
                                "put": _op(r, "put", write, True), "patch": _op(r, "patch", write, True)}
    return out


def _schema(r: Resource) -> Obj:
    props: Obj = {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                  "metadata": {"type": "object", "description": "Standard object metadata (ObjectMeta)."}}
    if r.kind in _WITH_SPEC:
        props["spec"] = {"type": "object"}
    if r.kind in _WITH_STATUS:
        props["status"] = {"type": "object"}
    if r.kind == "Event" and not r.group:
        props.update({k: {"type": "object"} for k in ("involvedObject", "source", "series")})
        props.update({k: {"type": "string"} for k in ("reason", "message", "type", "action", "firstTimestamp",
                                                       "lastTimestamp", "eventTime", "reportingComponent",
                                                       "reportingInstance")})
        props["count"] = {"type": "integer"}
    return {"type": "object", "description": f"{r.kind} as the ghost lab stores it (fields are not checked in depth).",
            "properties": props, "x-kubernetes-group-version-kind": [_gvk(r)]}


def group_versions() -> list[str]:
    return sorted({gv_path(r) for r in RESOURCES})


def document(path: str) -> Obj | None:
    """The OpenAPI v3 document of one group-version (``api/v1``), or None if the lab serves none there."""
    rs = [r for r in RESOURCES if gv_path(r) == path]
    if not rs:
        return None
    paths: dict[str, Obj] = {}
    schemas: dict[str, Obj] = {}
    for r in rs:
        paths.update(_paths(r))
        schemas[_schema_name(r)] = _schema(r)
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes (ghost lab)", "version": "v1.34.0-ghost-lab"},
            "paths": paths, "components": {"schemas": schemas}}


def document_bytes(path: str) -> bytes | None:
    doc = document(path)
    return orjson.dumps(doc) if doc is not None else None


def index() -> Obj:
    """``/openapi/v3``: each group-version with the URL of its document (hash: the document's SHA-512, as upstream)."""
    out = {}
    for gv in group_versions():
        data = document_bytes(gv) or b""
        digest = hashlib.sha512(data).hexdigest().upper()
        out[gv] = {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
    return {"paths": out}
