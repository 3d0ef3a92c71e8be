"""Kubernetes API shapes the lab's replicas serve: resources, Status errors, selectors, patches.

Pure helpers (no sockets, no etcd). Citations point at the Kubernetes source each
piece mirrors; docs/LAB.md lists them.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


# --- resources ---------------------------------------------------------------


@dataclass(frozen=True)
class Resource:
    group: str  # "" for core
    version: str
    plural: str
    kind: str
    namespaced: bool
    etcd_prefix: str  # "/registry/pods/" (then NS/NAME or NAME)
    field_labels: tuple[str, ...] = ("metadata.name", "metadata.namespace")
    list_kind: str = ""
    verbs: tuple[str, ...] = ("create", "delete", "get", "list", "patch", "update", "watch")
    # A custom resource (served as apiextensions-apiserver serves a CRD's objects): status subresource,
    # metadata.generation, and a server-side Table with these (name, type, JSONPath) printer columns.
    custom: bool = False
    printer_columns: tuple[tuple[str, str, str], ...] = ()
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``pods``, ``leases.coordination.k8s.io``: how errors name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def key(self, namespace: str | None, name: str) -> str:
        return f"{self.etcd_prefix}{namespace}/{name}" if self.namespaced else f"{self.etcd_prefix}{name}"

    def prefix(self, namespace: str | None) -> str:
        return f"{self.etcd_prefix}{namespace}/" if self.namespaced and namespace else self.etcd_prefix


# Storage prefixes as in pkg/registry/*/storage and the etcd layout of kube-apiserver
# (nodes are stored as "minions", endpoints under services/endpoints).
RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "pods", "Pod", True, "/registry/pods/",
             ("metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
              "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName")),
    Resource("", "v1", "nodes", "Node", False, "/registry/minions/", ("metadata.name", "spec.unschedulable")),
    Resource("", "v1", "namespaces", "Namespace", False, "/registry/namespaces/", ("metadata.name", "status.phase")),
    Resource("", "v1", "events", "Event", True, "/registry/events/",
             ("metadata.name", "metadata.namespace", "involvedObject.kind", "involvedObject.namespace",
              "involvedObject.name", "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
              "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type")),
    Resource("", "v1", "endpoints", "Endpoints", True, "/registry/services/endpoints/"),
    Resource("", "v1", "services", "Service", True, "/registry/services/specs/"),
    Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", True, "/registry/endpointslices/"),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", True, "/registry/leases/"),
    # events.k8s.io/v1 shares core events' storage (pkg/registry/core/event): converted on the way in and out.
    Resource("events.k8s.io", "v1", "events", "Event", True, "/registry/events/",
             ("metadata.name", "metadata.namespace", "regarding.kind", "regarding.namespace", "regarding.name",
              "regarding.uid", "reason", "reportingController", "type")),
    # The guard's own CRD (manifests/crd/ghostpods.yaml), served as a fixed resource: the lab does not install
    # CRDs dynamically. Custom resources are stored under /registry/<group>/<plural>/ (apiextensions-apiserver
    # customresource_handler.go: ResourcePrefix = group + "/" + plural). The printer columns repeat the
    # manifest's additionalPrinterColumns (tests/lab/test_lab_ghostpods.py keeps them equal).
    Resource("kube-ghost-guard.io", "v1alpha1", "ghostpods", "GhostPod", True, "/registry/kube-ghost-guard.io/ghostpods/",
             custom=True, short_names=("gp",), categories=("ghost-guard",),
             printer_columns=(("Pod", "string", ".spec.podName"), ("Verdict", "string", ".spec.verdict"),
                              ("Stale Replicas", "string", ".status.staleReplicas"),
                              ("Times Blocked", "integer", ".status.timesBlocked"),
                              ("Last Seen", "date", ".status.lastSeen"),
                              ("Age", "date", ".metadata.creationTimestamp"))),
    # manifests/crd/ghostnodes.yaml: the ghost Node records, cluster-scoped.
    Resource("kube-ghost-guard.io", "v1alpha1", "ghostnodes", "GhostNode", False,
             "/registry/kube-ghost-guard.io/ghostnodes/", ("metadata.name",), custom=True, short_names=("gn",),
             categories=("ghost-guard",),
             printer_columns=(("Node", "string", ".spec.nodeName"),
                              ("Stale Replicas", "string", ".status.staleReplicas"),
                              ("Times Detected", "integer", ".status.timesDetected"),
                              ("Last Seen", "date", ".status.lastSeen"),
                              ("Age", "date", ".metadata.creationTimestamp"))),
)


def resource_for(group: str, version: str, plural: str) -> Resource | None:
    for r in RESOURCES:
        if (r.group, r.version, r.plural) == (group, version, plural):
            return r
    return None


def known_resource(group: str, version: str, plural: str) -> Resource:
    """A resource the lab itself writes (pods, namespaces, endpoints, ...): always served."""
    r = resource_for(group, version, plural)
    if r is None:
        raise LookupError(f"the lab serves no {plural}.{version}.{group or 'core'}")
    return r


def resource_for_key(key: str) -> Resource | None:
    """The storage resource (core flavour) a key belongs to."""
    for r in RESOURCES:
        if key.startswith(r.etcd_prefix) and r.group != "events.k8s.io":
            return r
    return None


def split_key(r: Resource, key: str) -> tuple[str, str]:
    """(namespace, name) of a storage key ("" namespace for cluster-scoped)."""
    rest = key[len(r.etcd_prefix):]
    if r.namespaced:
        ns, _, name = rest.partition("/")
        return ns, name
    return "", rest


# --- Status errors (k8s.io/apimachinery/pkg/api/errors/errors.go) -------------


class ApiError(Exception):
    """An error the replica answers as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, details: Obj | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details
        self.headers = headers or {}

    def status(self) -> Obj:
        s: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message}
        if self.reason:  # omitempty: an error without a StatusReason (e.g. a GET's unparsable resourceVersion, a 500)
            s["reason"] = self.reason
        if self.details is not None:
            s["details"] = self.details
        s["code"] = self.code
        return s


def _details(name: str, r: Resource | str) -> Obj:
    if isinstance(r, Resource):
        d: Obj = {"name": name}
        if r.group:
            d["group"] = r.group
        d["kind"] = r.plural
        return d
    return {"name": name, "kind": r}


def not_found(r: Resource, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{r.qualified} "{name}" not found', _details(name, r))


def already_exists(r: Resource, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{r.qualified} "{name}" already exists', _details(name, r))


def conflict(qualified: str, name: str, why: str, kind: str | None = None) -> ApiError:
    """NewConflict: ``Operation cannot be fulfilled on QUALIFIED "NAME": WHY``."""
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {qualified} "{name}": {why}',
                    {"name": name, "kind": kind or qualified})


def uid_precondition_failed(r: Resource, key: str, name: str, want: str, have: str) -> ApiError:
    """A UID precondition mismatch as etcd3 storage reports it (storage.NewInvalidObjError, InterpretUpdateError)."""
    why = (f"StorageError: invalid object, Code: 4, Key: {key}, ResourceVersion: 0, "
           f"AdditionalErrorMsg: Precondition failed: UID in precondition: {want}, UID in object meta: {have}")
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {r.qualified} "{name}": {why}', _details(name, r))


def delete_precondition_failed(r: Resource, name: str, what: str, want: str, have: str) -> ApiError:
    """A DELETE's precondition mismatch (rest.BeforeDelete): the conflict is named by the kind, not the resource:
    ``Operation cannot be fulfilled on Pod "x": the UID in the precondition (A) does not match the UID in record
    (B). The object might have been deleted and then recreated`` (or ``ResourceVersion ... modified``)."""
    qualified = f"{r.kind}.{r.group}" if r.group else r.kind
    tail = "deleted and then recreated" if what == "UID" else "modified"
    details: Obj = {k: v for k, v in (("name", name), ("group", r.group), ("kind", r.kind)) if v}
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {qualified} "{name}": the {what} in the '
                    f"precondition ({want}) does not match the {what} in record ({have}). The object might have been {tail}",
                    details)


def modified_conflict(r: Resource, name: str) -> ApiError:
    return ApiError(409, "Conflict",
                    f'Operation cannot be fulfilled on {r.qualified} "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again", _details(name, r))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(r: Resource, name: str, field: str, detail: str, kind_value: str = "Required value") -> ApiError:
    details: Obj = {"name": name, "group": r.group, "kind": r.kind}
    return ApiError(422, "Invalid", f'{r.kind} "{name}" is invalid: {field}: {kind_value}: {detail}',
                    {**{k: v for k, v in details.items() if v},  # name and group are omitempty in StatusDetails
                     "causes": [{"reason": "FieldValueRequired" if kind_value == "Required value" else "FieldValueInvalid",
                                 "message": f"{kind_value}: {detail}", "field": field}]})


def goquote(s: str) -> str:
    """Go's ``%q`` of a string (strconv.Quote), as field errors and NewInvalid print values and names."""
    out = ['"']
    for ch in s:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\a\b\f\n\r\t\v":
            out.append({"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}[ch])
        elif ch.isprintable():
            out.append(ch)
        elif o < 0x80:
            out.append(f"\\x{o:02x}")
        elif o < 0x10000:
            out.append(f"\\u{o:04x}")
        else:
            out.append(f"\\U{o:08x}")
    out.append('"')
    return "".join(out)


@dataclass(frozen=True)
class FieldError:
    """One field.Error: ``FIELD: Invalid value: "VALUE": DETAIL`` (type "Invalid value" / reason FieldValueInvalid)."""
    field: str
    value: str
    detail: str

    def body(self) -> str:
        return f"Invalid value: {goquote(self.value)}: {self.detail}"


def invalid_fields(r: Resource, name: str, errors: list[FieldError]) -> ApiError:
    """errors.NewInvalid: one error as is, several as ``[e1, e2]`` (utilerrors aggregate), a cause per error."""
    texts = [f"{e.field}: {e.body()}" for e in errors]
    agg = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    details: Obj = {k: v for k, v in (("name", name), ("group", r.group), ("kind", r.kind)) if v}
    details["causes"] = [{"reason": "FieldValueInvalid", "message": e.body(), "field": e.field} for e in errors]
    return ApiError(422, "Invalid", f"{r.kind} {goquote(name)} is invalid: {agg}", details)


# k8s.io/apimachinery/pkg/util/validation/validation.go (IsDNS1123Subdomain, IsDNS1123Label, IsDNS1035Label):
# Go's regexp.MatchString("^...$") anchors at the very end, as re.fullmatch does (Python's "$" would also
# match before a final newline).
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = _DNS1123_LABEL + r"(\." + _DNS1123_LABEL + r")*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
                  "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
                  f"'{_DNS1123_SUBDOMAIN}')")
_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
              f"end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '{_DNS1123_LABEL}')")
_DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
                "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
                f"validation is '{_DNS1035_LABEL}')")


def name_errors(r: Resource, name: str) -> list[str]:
    """Why the apiserver refuses ``name`` for ``r`` (ValidateObjectMeta's name function), [] when it takes it:
    namespaces are RFC 1123 labels (ValidateNamespaceName, "must not contain dots" for an otherwise valid
    subdomain), services RFC 1035 labels, every other resource the lab serves RFC 1123 subdomains."""
    if r.kind == "Namespace":
        if re.fullmatch(_DNS1123_SUBDOMAIN, name) and "." in name and len(name) <= 253:
            return ["must not contain dots"]
        limit, regex, msg = 63, _DNS1123_LABEL, _LABEL_MSG
    elif r.kind == "Service":
        limit, regex, msg = 63, _DNS1035_LABEL, _DNS1035_MSG
    else:
        limit, regex, msg = 253, _DNS1123_SUBDOMAIN, _SUBDOMAIN_MSG
    out = [f"must be no more than {limit} characters"] if len(name) > limit else []
    if not re.fullmatch(regex, name):
        out.append(msg)
    return out


def validate_name(r: Resource, name: str) -> None:
    """422 Invalid with the real apiserver's message when ``name`` is not a valid name for ``r``."""
    errs = name_errors(r, name)
    if errs:
        raise invalid_fields(r, name, [FieldError("metadata.name", name, e) for e in errs])


def too_many_requests(message: str = "Too many requests, please try again later.") -> ApiError:
    return ApiError(429, "TooManyRequests", message, {"retryAfterSeconds": 1}, {"Retry-After": "1"})


def internal_error(message: str) -> ApiError:
    return ApiError(500, "InternalError", f"Internal error occurred: {message}",
                    {"causes": [{"message": message}]})


def gone(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def unauthorized() -> ApiError:
    return ApiError(401, "Unauthorized", "Unauthorized")


def method_not_allowed(method: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", f"the server does not allow this method on the requested resource ({method})", {})


def path_not_found() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


# --- field validation (fieldValidation=Strict|Warn|Ignore, KEP-2885) -------------------

FIELD_VALIDATION_DIRECTIVES = ("Ignore", "Warn", "Strict")
# The fields of ObjectMeta (k8s.io/apimachinery/pkg/apis/meta/v1/types.go) and of each kind's top
# level the lab knows; deeper fields are not checked (the lab has no full schema).
_OBJECT_META = frozenset({"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
                          "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
                          "annotations", "ownerReferences", "finalizers", "managedFields"})
_TOP = {"Pod": {"spec", "status"}, "Node": {"spec", "status"}, "Namespace": {"spec", "status"},
        "Service": {"spec", "status"}, "Lease": {"spec"}, "Endpoints": {"subsets"},
        "EndpointSlice": {"addressType", "endpoints", "ports"}}
_EVENT_CORE = {"involvedObject", "reason", "message", "source", "firstTimestamp", "lastTimestamp", "count", "type",
               "eventTime", "series", "action", "related", "reportingComponent", "reportingInstance"}
_EVENT_V1 = {"eventTime", "series", "reportingController", "reportingInstance", "action", "reason", "regarding",
             "related", "note", "type", "deprecatedSource", "deprecatedFirstTimestamp", "deprecatedLastTimestamp",
             "deprecatedCount"}


def unknown_fields(r: Resource, obj: Obj) -> list[str]:
    """Top-level and ``metadata`` fields ``obj`` has that kind ``r`` does not (what a strict decode names)."""
    if not isinstance(obj, dict):
        return []
    known = {"apiVersion", "kind", "metadata"} | (
        (_EVENT_V1 if r.group else _EVENT_CORE) if r.kind == "Event" else _TOP.get(r.kind, set()))
    out = [k for k in obj if k not in known]
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        out += [f"metadata.{k}" for k in meta if k not in _OBJECT_META]
    return out


# --- selectors ------------------------------------------------------------------


def field_value(obj: Obj, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return ""
        cur = cur.get(part)
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    op: str  # "=" or "!="
    value: str

    def matches(self, obj: Obj) -> bool:
        v = field_value(obj, self.field)
        return (v == self.value) if self.op == "=" else (v != self.value)


def _split_terms(selector: str) -> list[str]:
    """fields.splitTerms: split on commas not escaped by a backslash."""
    terms, start, slash = [], 0, False
    for i, ch in enumerate(selector):
        if slash:
            slash = False
        elif ch == "\\":
            slash = True
        elif ch == ",":
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return terms


def _split_term(term: str) -> tuple[str, str, str] | None:
    """fields.splitTerm: the first position where "!=", "==" or "=" starts; no whitespace is trimmed."""
    for i in range(len(term)):
        for op in ("!=", "==", "="):
            if term.startswith(op, i):
                return term[:i], op, term[i + len(op):]
    return None


def _unescape_value(value: str) -> str:
    """fields.UnescapeValue: ``\\\\``, ``\\,`` and ``\\=`` are escapes; any other escape, a lone trailing
    backslash, or an unescaped ``,`` or ``=`` is an error."""
    out, slash = [], False
    for ch in value:
        if slash:
            if ch not in "\\,=":
                raise bad_request(f"invalid field selector: invalid escape sequence: \\{ch}")
            out.append(ch)
            slash = False
        elif ch == "\\":
            slash = True
        elif ch in ",=":
            raise bad_request(f"invalid field selector: unescaped character in value: {ord(ch)}")
        else:
            out.append(ch)
    if slash:
        raise bad_request("invalid field selector: invalid escape sequence: \\")
    return "".join(out)


def parse_field_selector(s: str | None, r: Resource) -> list[FieldRequirement]:
    """fields.ParseSelector (k8s.io/apimachinery/pkg/fields/selector.go) then the resource's field label
    conversion, as the real apiserver does them: terms split on unescaped commas and sorted, empty terms
    skipped, the operator found at its first position ("!=", "==", "="), the value unescaped, and nothing
    trimmed: ``metadata.name = x`` asks for the field label ``"metadata.name "`` (400, not supported) and
    ``metadata.name=x `` for the name ``"x "``."""
    reqs: list[FieldRequirement] = []
    selector = s or ""
    parsed = []
    for term in sorted(_split_terms(selector)) if selector else []:
        if term == "":
            continue
        split = _split_term(term)
        if split is None:
            raise bad_request(f"invalid selector: '{selector}'; can't understand '{term}'")
        field, op, value = split
        parsed.append((field, op, _unescape_value(value)))
    for field, op, value in parsed:
        if field not in r.field_labels:
            raise bad_request(f"field label not supported: {field}")
        reqs.append(FieldRequirement(field, "!=" if op == "!=" else "=", value))
    return reqs


@dataclass(frozen=True)
class LabelRequirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        v = labels.get(self.key)
        if self.op == "=":
            return has and v == self.values[0]
        if self.op == "!=":
            return not has or v != self.values[0]
        if self.op == "in":
            return has and v in self.values
        if self.op == "notin":
            return not has or v not in self.values
        if self.op == "exists":
            return has
        return not has


_LABEL_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"


def _split_top(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    terms = [t.strip() for t in out]
    if terms == [""]:
        return []
    # labels.Parse's lexer skips whitespace but wants an identifier after every comma
    for i, t in enumerate(terms):
        if not t:
            if i == 0:
                raise bad_request("found ',', expected: !, identifier, or 'end of string'")
            found = "" if i == len(terms) - 1 else ","
            raise bad_request(f"found '{found}', expected: identifier after ','")
    return terms


_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
                    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
                    f"regex used for validation is '{_LABEL_VALUE}')")


def _check_label_values(key: str, values: tuple[str, ...]) -> None:
    """labels.NewRequirement's validateLabelValue: at most 63 bytes, the label-value regex."""
    for i, v in enumerate(values):
        errs = ["must be no more than 63 bytes"] if len(v.encode()) > 63 else []
        if not re.fullmatch(_LABEL_VALUE, v):
            errs.append(_LABEL_VALUE_MSG)
        if errs:
            texts = [f"values[{i}][{key}]: Invalid value: {goquote(v)}: {e}" for e in errs]
            raise bad_request("unable to parse requirement: " + (texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"))


def parse_label_selector(s: str | None) -> list[LabelRequirement]:
    """labels.Parse: equality (``=``, ``==``, ``!=``), set (``in``, ``notin``) and existence (``k``, ``!k``)."""
    reqs: list[LabelRequirement] = []
    for term in _split_top(s or ""):
        if m := re.fullmatch(rf"({_LABEL_KEY})\s+(in|notin)\s+\(([^)]*)\)", term):
            vals = tuple(v.strip() for v in m.group(3).split(",") if v.strip())
            _check_label_values(m.group(1), vals)
            reqs.append(LabelRequirement(m.group(1), m.group(2), vals))
        elif m := re.fullmatch(rf"({_LABEL_KEY})\s*(==|!=|=)\s*([-A-Za-z0-9_.]*)", term):
            _check_label_values(m.group(1), (m.group(3),))
            reqs.append(LabelRequirement(m.group(1), "!=" if m.group(2) == "!=" else "=", (m.group(3),)))
        elif m := re.fullmatch(rf"!\s*({_LABEL_KEY})", term):
            reqs.append(LabelRequirement(m.group(1), "!"))
        elif re.fullmatch(_LABEL_KEY, term):
            reqs.append(LabelRequirement(term, "exists"))
        else:
            raise bad_request(f"unable to parse requirement: invalid label selector: {term!r}")
    return reqs


@dataclass(frozen=True)
class Selector:
    namespace: str | None
    fields: tuple[FieldRequirement, ...] = ()
    labels: tuple[LabelRequirement, ...] = ()

    def matches(self, obj: Obj) -> bool:
        meta = obj.get("metadata") or {}
        if self.namespace and meta.get("namespace") != self.namespace:
            return False
        lbls = meta.get("labels") or {}
        return all(f.matches(obj) for f in self.fields) and all(lr.matches(lbls) for lr in self.labels)


# --- patches ----------------------------------------------------------------------


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


# Lists merged by key in a strategic merge patch (patchMergeKey tags in k8s.io/api/core/v1/types.go).
_MERGE_KEYS = {
    "status.conditions": "type",
    "spec.containers": "name",
    "spec.initContainers": "name",
    "spec.tolerations": None,
    "metadata.ownerReferences": "uid",
    "metadata.finalizers": "",  # a set of strings
    "status.containerStatuses": "name",
}


def strategic_merge_patch(target: Any, patch: Any, path: str = "") -> Any:
    """A strategic merge patch for the lists the lab's objects use (merge keys above), else merge-patch rules."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$"):
            continue
        sub = f"{path}.{k}" if path else k
        if v is None:
            out.pop(k, None)
        elif isinstance(v, list) and sub in _MERGE_KEYS and _MERGE_KEYS[sub] is not None and isinstance(out.get(k), list):
            key = _MERGE_KEYS[sub]
            merged = copy.deepcopy(out[k])
            for item in v:
                if key == "":
                    if item not in merged:
                        merged.append(item)
                    continue
                if not isinstance(item, dict):
                    raise bad_request(f"{sub}: list items must be objects")
                if item.get("$patch") == "delete":
                    merged = [m for m in merged if not (isinstance(m, dict) and m.get(key) == item.get(key))]
                    continue
                for i, m in enumerate(merged):
                    if isinstance(m, dict) and m.get(key) == item.get(key):
                        merged[i] = strategic_merge_patch(m, item, sub)
                        break
                else:
                    merged.append(copy.deepcopy(item))
            out[k] = merged
        else:
            out[k] = strategic_merge_patch(out.get(k), v, sub)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f"json patch: invalid path {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json_patch(target: Obj, ops: Any) -> Obj:
    """RFC 6902 JSON patch (add, remove, replace, test, copy, move)."""
    if not isinstance(ops, list):
        raise bad_request("json: cannot unmarshal object into Go value of type []handlers.jsonPatchOp")
    doc = copy.deepcopy(target)

    def parent(parts: list[str]) -> tuple[Any, str]:
        cur: Any = doc
        for p in parts[:-1]:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur, parts[-1]

    def get(parts: list[str]) -> Any:
        cur: Any = doc
        for p in parts:
            cur = cur[int(p)] if isinstance(cur, list) else cur[p]
        return cur

    for op in ops:
        try:
            kind, parts = op["op"], _pointer(op["path"])
            if kind == "test":
                if get(parts) != op.get("value"):
                    raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: testing value {op['path']} failed")
                continue
            if kind in ("add", "replace", "copy", "move"):
                value = copy.deepcopy(op.get("value")) if kind in ("add", "replace") else copy.deepcopy(get(_pointer(op["from"])))
                if kind == "move":
                    fp, fk = parent(_pointer(op["from"]))
                    del fp[int(fk) if isinstance(fp, list) else fk]
                container, last = parent(parts)
                if isinstance(container, list):
                    if last == "-":
                        container.append(value)
                    elif kind == "replace":
                        container[int(last)] = value
                    else:
                        container.insert(int(last), value)
                else:
                    if kind == "replace" and last not in container:
                        raise KeyError(last)
                    container[last] = value
            elif kind == "remove":
                container, last = parent(parts)
                del container[int(last) if isinstance(container, list) else last]
            else:
                raise bad_request(f"json patch: unknown op {kind!r}")
        except ApiError:
            raise
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: {op!r}: {e}") from e
    return doc


def apply_patch(content_type: str, target: Obj, body: bytes) -> Obj:
    ct = content_type.split(";")[0].strip().lower()
    try:
        patch = json.loads(body or b"null")
    except ValueError as e:
        raise bad_request(f"error decoding patch: {e}") from e
    if ct == "application/json-patch+json":
        return json_patch(target, patch)
    if not isinstance(patch, dict):
        raise bad_request("patch body must be a JSON object")
    if ct == "application/merge-patch+json":
        return merge_patch(target, patch)
    if ct == "application/strategic-merge-patch+json":
        return strategic_merge_patch(target, patch)
    raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted media types include: "
                   "application/json-patch+json, application/merge-patch+json, application/strategic-merge-patch+json")


# --- server-side printing (Table) ----------------------------------------------------


def wants_table(accept: str | None) -> bool:
    """kubectl get asks ``application/json;as=Table;v=v1;g=meta.k8s.io, ..., application/json``."""
    return accept is not None and "as=Table" in accept and "g=meta.k8s.io" in accept


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery/pkg/util/duration HumanDuration (the AGE column)."""
    s = int(seconds)
    if s < 0:
        return "<invalid>"
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = s // 3600
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    if h < 24 * 8:
        return f"{h // 24}d{h % 24}h" if h % 24 else f"{h // 24}d"
    if h < 24 * 365 * 2:
        return f"{h // 24}d"
    if h < 24 * 365 * 8:
        return f"{h // 24 // 365}y{(h // 24) % 365}d"
    return f"{h // 24 // 365}y"


def table(r: Resource, items: list[Obj], resource_version: str, now: float) -> Obj:
    """A meta.k8s.io/v1 Table of ``items`` with the resource's printer columns, as apiextensions-apiserver's
    tableconvertor builds it: Name first, a missing value an empty cell, a date column as an age."""
    cols = [{"name": "Name", "type": "string", "format": "name", "description": "Name must be unique within a namespace.",
             "priority": 0}]
    cols += [{"name": n, "type": t, "format": "", "description": "", "priority": 0} for n, t, _ in r.printer_columns]
    rows = []
    for o in items:
        meta = o.get("metadata") or {}
        cells: list[Any] = [meta.get("name", "")]
        for _, typ, path in r.printer_columns:
            v = field_value_raw(o, path.lstrip("."))
            if v is None:
                cells.append(None)
            elif typ == "date":
                try:
                    t = datetime.datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
                    cells.append(human_duration(now - t))
                except ValueError:
                    cells.append(str(v))
            else:
                cells.append(v)
        partial = {k: v for k, v in meta.items() if k != "managedFields"}
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                "metadata": partial}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": cols, "rows": rows}


def field_value_raw(obj: Obj, path: str) -> Any:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


# --- time ------------------------------------------------------------------------


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
