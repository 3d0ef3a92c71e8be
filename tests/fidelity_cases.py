"""Requests whose answers the Python lab must give exactly as a real kube-apiserver does (docs/LAB.md, "Lab
fidelity"). Every expected status and message below was recorded from a real v1.36.2 kube-apiserver; the lab runs
them in tests/lab/test_lab_fidelity.py, the real apiserver in tests/real/test_lab_fidelity_real.py.

Errors are compared whole: the Status body but ``kind``, ``apiVersion`` and ``metadata`` (message, reason,
details with their causes, code). ``run(base_url, token, ca_path, namespace)`` sets up three pods in ``namespace`` (which must exist, with a
``default`` ServiceAccount on a real apiserver) and answers ``(case, got)`` pairs; ``expected(case)`` is what to
compare ``got`` with.
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import urllib3

# k8s.io/apimachinery/pkg/util/validation: IsDNS1123Subdomain's message
SUBDOMAIN = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
             "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
             "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
LABEL_VALUE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
               "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
               "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")

PODS = {"web-0": {"app": "web", "tier": "a"}, "web-1": {"app": "web"}, "a.b": {}}


def pod(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"automountServiceAccountToken": False, "containers": [{"name": "c", "image": "pause"}]}}


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    path: str  # after /api/v1/namespaces/{ns}
    status: int
    error: dict[str, Any] | None = None  # the whole Status body but kind/apiVersion/metadata ({ns} filled in)
    names: tuple[str, ...] | None = None  # a list's item names, sorted
    pages: tuple[tuple[str, ...], ...] | None = None  # following `continue` to the end: each page's names
    body: dict[str, Any] | None = field(default=None, compare=False)


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"status": "Failure", "message": message}
    if reason:
        out["reason"] = reason
    if details is not None:
        out["details"] = details
    out["code"] = code
    return out


def _bad(message: str) -> dict[str, Any]:
    return _status(400, "BadRequest", message)


def _invalid_name(name: str, why: str) -> dict[str, Any]:
    q = json.dumps(name)
    return _status(422, "Invalid", f"Pod {q} is invalid: metadata.name: Invalid value: {q}: {why}",
                   {"name": name, "kind": "Pod",
                    "causes": [{"reason": "FieldValueInvalid", "message": f"Invalid value: {q}: {why}", "field": "metadata.name"}]})


def _not_found(name: str) -> dict[str, Any]:
    return _status(404, "NotFound", f'pods "{name}" not found', {"name": name, "kind": "pods"})


def _list_options(reason: str, kind: str, detail: str) -> dict[str, Any]:
    return _status(422, "Invalid", f'ListOptions.meta.k8s.io "" is invalid: resourceVersionMatch: {kind}: {detail}',
                   {"group": "meta.k8s.io", "kind": "ListOptions",
                    "causes": [{"reason": reason, "message": f"{kind}: {detail}", "field": "resourceVersionMatch"}]})


def _fs(selector: str, extra: str = "") -> str:
    return "/pods?fieldSelector=" + urllib.parse.quote(selector, safe="") + extra


def _ls(selector: str) -> str:
    return "/pods?labelSelector=" + urllib.parse.quote(selector, safe="")


CASES: list[Case] = [
    # names: DNS-1123 subdomains, at most 253 characters (ValidateObjectMeta; the lab took all of these)
    Case("name-with-comma", "POST", "/pods", 422, _invalid_name("web-0,metadata.namespace=default", SUBDOMAIN),
         body=pod("web-0,metadata.namespace=default")),
    Case("name-uppercase", "POST", "/pods", 422, _invalid_name("Web-0", SUBDOMAIN), body=pod("Web-0")),
    Case("name-underscore", "POST", "/pods", 422, _invalid_name("a_b", SUBDOMAIN), body=pod("a_b")),
    Case("name-leading-dash", "POST", "/pods", 422, _invalid_name("-ab", SUBDOMAIN), body=pod("-ab")),
    Case("name-empty-label", "POST", "/pods", 422, _invalid_name("a..b", SUBDOMAIN), body=pod("a..b")),
    Case("name-254", "POST", "/pods", 422, _invalid_name("a" * 254, "must be no more than 253 characters"),
         body=pod("a" * 254)),
    Case("name-missing", "POST", "/pods", 422, _status(
        422, "Invalid", 'Pod "" is invalid: metadata.name: Required value: name or generateName is required',
        {"kind": "Pod", "causes": [{"reason": "FieldValueRequired", "message": "Required value: name or generateName is required",
                                    "field": "metadata.name"}]}), body=pod("")),
    Case("name-253-ok", "POST", "/pods", 201, body=pod("b" * 253)),
    Case("already-exists", "POST", "/pods", 409, _status(409, "AlreadyExists", 'pods "web-0" already exists',
                                                          {"name": "web-0", "kind": "pods"}), body=pod("web-0")),
    Case("get-404", "GET", "/pods/nope", 404, _not_found("nope")),
    Case("get-404-cache", "GET", "/pods/nope?resourceVersion=0", 404, _not_found("nope")),
    Case("delete-404", "DELETE", "/pods/nope", 404, _not_found("nope")),
    # a DELETE's precondition conflict (rest.BeforeDelete; {uid:NAME}/{rv:NAME}: that pod's, filled in by run)
    Case("delete-uid-conflict", "DELETE", "/pods/web-1", 409, _status(
        409, "Conflict", 'Operation cannot be fulfilled on Pod "web-1": the UID in the precondition '
        "(00000000-0000-0000-0000-000000000000) does not match the UID in record ({uid:web-1}). The object might have "
        "been deleted and then recreated", {"name": "web-1", "kind": "Pod"}),
        body={"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": "00000000-0000-0000-0000-000000000000"}}),
    Case("delete-rv-conflict", "DELETE", "/pods/web-1", 409, _status(
        409, "Conflict", 'Operation cannot be fulfilled on Pod "web-1": the ResourceVersion in the precondition (1) '
        "does not match the ResourceVersion in record ({rv:web-1}). The object might have been modified",
        {"name": "web-1", "kind": "Pod"}),
        body={"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": "1"}}),
    # field selectors (fields.ParseSelector): nothing trimmed, escapes, operators found at their first position
    Case("fs-name", "GET", _fs("metadata.name=web-0"), 200, names=("web-0",)),
    Case("fs-name-cache", "GET", _fs("metadata.name=web-0", "&resourceVersion=0"), 200, names=("web-0",)),
    Case("fs-double-equals", "GET", _fs("metadata.name==web-0"), 200, names=("web-0",)),
    Case("fs-not-equal", "GET", _fs("metadata.name!=web-0"), 200, names=("a.b", "b" * 253, "web-1")),
    Case("fs-space-around-op", "GET", _fs("metadata.name = web-0"), 400, _bad("field label not supported: metadata.name ")),
    Case("fs-space-after-comma", "GET", _fs("metadata.name=web-0, metadata.namespace={ns}"), 400,
         _bad("field label not supported:  metadata.namespace")),
    Case("fs-space-after-comma-cache", "GET", _fs("metadata.name=web-0, metadata.namespace={ns}", "&resourceVersion=0"),
         400, _bad("field label not supported:  metadata.namespace")),
    Case("fs-leading-space", "GET", _fs(" metadata.name=web-0"), 400, _bad("field label not supported:  metadata.name")),
    Case("fs-trailing-space-is-value", "GET", _fs("metadata.name=web-0 "), 200, names=()),
    Case("fs-two-terms", "GET", _fs("metadata.name=web-0,metadata.namespace={ns}"), 200, names=("web-0",)),
    Case("fs-empty-terms", "GET", _fs(",metadata.name=web-0,,"), 200, names=("web-0",)),
    Case("fs-escaped-comma", "GET", _fs("metadata.name=a\\,b"), 200, names=()),
    Case("fs-unescaped-equals", "GET", _fs("metadata.name=a=b"), 400,
         _bad("invalid field selector: unescaped character in value: 61")),
    Case("fs-bad-escape", "GET", _fs("metadata.name=web\\-0"), 400, _bad("invalid field selector: invalid escape sequence: \\-")),
    Case("fs-trailing-backslash", "GET", _fs("metadata.name=a\\"), 400, _bad("invalid field selector: invalid escape sequence: \\")),
    Case("fs-no-operator", "GET", _fs("metadata.name"), 400, _bad("invalid selector: 'metadata.name'; can't understand 'metadata.name'")),
    Case("fs-unknown-label", "GET", _fs("metadata.name=web-0,foo=bar"), 400, _bad("field label not supported: foo")),
    # label selectors (labels.Parse): whitespace between tokens is fine, an empty term is not, values are validated
    Case("ls-equals", "GET", _ls("app=web"), 200, names=("web-0", "web-1")),
    Case("ls-spaces", "GET", _ls("app = web, tier"), 200, names=("web-0",)),
    Case("ls-notin", "GET", _ls("app notin (web)"), 200, names=("a.b", "b" * 253)),
    Case("ls-not-exists", "GET", _ls("!tier"), 200, names=("a.b", "b" * 253, "web-1")),
    Case("ls-trailing-comma", "GET", _ls("app=web,"), 400, _bad("found '', expected: identifier after ','")),
    Case("ls-double-comma", "GET", _ls("app=web,,tier"), 400, _bad("found ',', expected: identifier after ','")),
    Case("ls-leading-comma", "GET", _ls(",app"), 400, _bad("found ',', expected: !, identifier, or 'end of string'")),
    Case("ls-bad-value", "GET", _ls("app=-web"), 400,
         _bad(f'unable to parse requirement: values[0][app]: Invalid value: "-web": {LABEL_VALUE}')),
    Case("ls-long-value", "GET", _ls("app=" + "a" * 64), 400,
         _bad(f'unable to parse requirement: values[0][app]: Invalid value: "{"a" * 64}": must be no more than 63 bytes')),
    # resourceVersion and resourceVersionMatch
    Case("list-rv-invalid", "GET", "/pods?resourceVersion=abc", 400,
         _bad('invalid resource version: resourceVersion: Invalid value: "abc": strconv.ParseUint: parsing "abc": invalid syntax')),
    Case("get-rv-invalid-is-500", "GET", "/pods/web-0?resourceVersion=abc", 500,
         _status(500, "", 'resourceVersion: Invalid value: "abc": strconv.ParseUint: parsing "abc": invalid syntax')),
    Case("watch-rv-invalid-is-500", "GET", "/pods?watch=1&resourceVersion=abc", 500,
         _status(500, "", 'resourceVersion: Invalid value: "abc": strconv.ParseUint: parsing "abc": invalid syntax')),
    Case("get-quorum", "GET", "/pods/web-0", 200),
    Case("get-cache", "GET", "/pods/web-0?resourceVersion=0", 200),
    Case("rvmatch-exact-0", "GET", "/pods?resourceVersion=0&resourceVersionMatch=Exact", 422,
         _list_options("FieldValueForbidden", "Forbidden", 'resourceVersionMatch "exact" is forbidden for resourceVersion "0"')),
    Case("rvmatch-without-rv", "GET", "/pods?resourceVersionMatch=NotOlderThan", 422,
         _list_options("FieldValueForbidden", "Forbidden", "resourceVersionMatch is forbidden unless resourceVersion is provided")),
    Case("rvmatch-unknown", "GET", "/pods?resourceVersion=1&resourceVersionMatch=Bogus", 422,
         _list_options("FieldValueNotSupported", "Unsupported value", '"Bogus": supported values: "Exact", "NotOlderThan", ""')),
    # limit / continue: a quorum list is paged, a resourceVersion=0 list is served whole
    Case("pages-of-1", "GET", "/pods?limit=1", 200, pages=(("a.b",), ("b" * 253,), ("web-0",), ("web-1",))),
    Case("pages-of-3-selected", "GET", "/pods?limit=1&labelSelector=app%3Dweb", 200, pages=(("web-0",), ("web-1",))),
    Case("limit-ignored-at-rv-0", "GET", "/pods?limit=1&resourceVersion=0", 200,
         pages=(("a.b", "b" * 253, "web-0", "web-1"),)),
    Case("limit-invalid", "GET", "/pods?limit=abc", 400, _bad('strconv.ParseInt: parsing "abc": invalid syntax')),
    Case("continue-with-rv", "GET", "/pods?continue=eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MSwic3RhcnQiOiJhIn0"
         "&resourceVersion=1", 400, _bad("specifying resource version is not allowed when using continue")),
]


def expected(case: Case, namespace: str) -> tuple[Any, ...]:
    """What ``run`` must answer for ``case`` (its Status with ``{ns}`` filled in, or the names listed)."""
    if case.pages is not None:
        return case.status, case.pages
    if case.names is not None:
        return case.status, case.names
    if case.error is None:
        return case.status, None
    return case.status, json.loads(json.dumps(case.error).replace("{ns}", namespace))


def _request(http: urllib3.PoolManager, base: str, token: str, method: str, path: str,
             body: dict[str, Any] | None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    r = http.request(method, base + path, body=data, headers=headers, timeout=urllib3.Timeout(total=15), retries=False)
    try:
        return r.status, json.loads(r.data)
    except ValueError:
        return r.status, r.data.decode(errors="replace")


def _answer(case: Case, status: int, doc: Any) -> tuple[Any, ...]:
    if case.names is not None:
        items = doc.get("items", []) if isinstance(doc, dict) else []
        return status, tuple(sorted(i["metadata"]["name"] for i in items)) if status == 200 else doc
    if case.error is None:
        return status, None if status < 300 else doc
    if not isinstance(doc, dict):
        return status, doc
    return status, {k: v for k, v in doc.items() if k not in ("kind", "apiVersion", "metadata")}


def run(base: str, token: str, ca_path: str, namespace: str) -> list[tuple[Case, tuple[Any, ...]]]:
    http = urllib3.PoolManager(ca_certs=ca_path, cert_reqs="CERT_REQUIRED")
    prefix = f"/api/v1/namespaces/{namespace}"
    created: dict[str, dict[str, Any]] = {}
    for name, labels in PODS.items():
        status, doc = _request(http, base, token, "POST", prefix + "/pods", pod(name, labels))
        assert status == 201, (status, doc)
        created[name] = doc["metadata"]

    def named(answer: tuple[Any, ...]) -> tuple[Any, ...]:
        """The created pods' UIDs and resourceVersions as {uid:NAME} and {rv:NAME}, as the cases spell them."""
        text = json.dumps(answer)
        for name, meta in created.items():
            text = text.replace(meta["uid"], f"{{uid:{name}}}").replace(f"in record ({meta['resourceVersion']})",
                                                                           f"in record ({{rv:{name}}})")
        return tuple(json.loads(text))
    out = []
    for case in CASES:
        path = prefix + case.path.replace("{ns}", namespace).replace("%7Bns%7D", urllib.parse.quote(namespace))
        if case.pages is not None:
            pages, cont, status = [], "", 0
            for _ in range(len(case.pages) + 2):
                status, doc = _request(http, base, token, "GET", path + (f"&continue={cont}" if cont else ""), None)
                if status != 200:
                    break
                pages.append(tuple(sorted(i["metadata"]["name"] for i in doc.get("items", []))))
                cont = (doc.get("metadata") or {}).get("continue") or ""
                if not cont:
                    break
            out.append((case, (status, tuple(pages))))
            continue
        status, doc = _request(http, base, token, case.method, path, case.body)
        answer = _answer(case, status, doc)
        out.append((case, named(answer) if case.error is not None else answer))
    return out
