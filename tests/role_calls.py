"""One call per route of the guard and the certificate role that owns it (``ghost-guard certs`` file
stems): shared by the tests of caller identity (tests/integration/test_caller_identity.py) and of path
spellings (tests/integration/test_route_spellings.py)."""

from __future__ import annotations

import orjson

FILTER = orjson.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"}}, "NodeNames": ["n1"]})
PREEMPT = orjson.dumps({"Pod": {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1"}},
                        "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "v-1"}]}}})
REVIEW = orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
    "uid": "rev-1", "kind": {"group": "", "version": "v1", "kind": "Binding"},
    "resource": {"group": "", "version": "v1", "resource": "pods"}, "subResource": "binding",
    "name": "p", "namespace": "ns", "operation": "CREATE",
    "object": {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p", "namespace": "ns", "uid": "u-1"},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"}}}})
CALLS = {"/filter": FILTER, "/preempt": PREEMPT, "/validate/binding": REVIEW, "/metrics": None, "/healthz": None,
         "/readyz": None}
OWNER = {"/filter": "client", "/preempt": "client", "/validate/binding": "apiserver", "/metrics": "monitoring",
         "/healthz": "monitoring", "/readyz": "monitoring"}
