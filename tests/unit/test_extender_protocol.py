"""Table tests for guard.extender: both protocol modes, exact keys, garbage input."""

import orjson
import pytest

from guard import extender
from guard.extender import ProtocolError

# As kube-scheduler sends it: no apiVersion/kind on the embedded Pod.
POD = {"metadata": {"name": "web-1", "namespace": "default", "uid": "uid-1"}, "spec": {}, "status": {"phase": "Pending"}}
NODE_LIST = {"metadata": {}, "items": [{"metadata": {"name": "n1"}}, {"metadata": {"name": "n2"}}]}
FILTER_KEYS = ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"]


def body(**kw) -> bytes:
    return orjson.dumps(kw)


@pytest.mark.parametrize("req,expected", [
    pytest.param(body(Pod=POD, Nodes=None, NodeNames=["n1", "n2"]),
                 {"Nodes": None, "NodeNames": ["n1", "n2"], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""},
                 id="names-mode"),
    pytest.param(body(Pod=POD, Nodes=NODE_LIST, NodeNames=None),
                 {"Nodes": NODE_LIST, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""},
                 id="nodes-mode"),
    pytest.param(body(Pod=POD, NodeNames=[]),
                 {"Nodes": None, "NodeNames": [], "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""},
                 id="names-mode-empty"),
])
def test_filter_pass_keeps_the_request_mode(req, expected):
    out = orjson.loads(extender.filter_pass(extender.parse_filter(req)))
    assert list(out) == FILTER_KEYS
    assert out == expected


@pytest.mark.parametrize("req,expected", [
    pytest.param(body(Pod=POD, Nodes=None, NodeNames=["n1", "n2"]),
                 {"Nodes": None, "NodeNames": [], "FailedNodes": {},
                  "FailedAndUnresolvableNodes": {"n1": "why", "n2": "why"}, "Error": ""}, id="names-mode"),
    pytest.param(body(Pod=POD, Nodes=NODE_LIST, NodeNames=None),
                 {"Nodes": {"metadata": {}, "items": []}, "NodeNames": None, "FailedNodes": {},
                  "FailedAndUnresolvableNodes": {"n1": "why", "n2": "why"}, "Error": ""}, id="nodes-mode"),
])
def test_filter_reject_marks_every_node_unresolvable(req, expected):
    out = orjson.loads(extender.filter_reject(extender.parse_filter(req), "why"))
    assert list(out) == FILTER_KEYS
    assert out == expected


@pytest.mark.parametrize("req,reason", [
    pytest.param(b"", "request body is not valid JSON", id="empty"),
    pytest.param(b"{", "request body is not valid JSON", id="truncated"),
    pytest.param(b"[1]", "request body must be a JSON object, got list", id="array"),
    pytest.param(body(Nodes=None, NodeNames=["n"]), "missing Pod: expected a v1.Pod object, got None", id="no-pod"),
    pytest.param(body(Pod="x", NodeNames=["n"]), "missing Pod: expected a v1.Pod object, got 'x'", id="pod-string"),
    pytest.param(body(Pod={}, NodeNames=["n"]), "Pod.metadata is missing or not an object", id="no-metadata"),
    pytest.param(body(Pod={"metadata": {"namespace": "d"}}, NodeNames=["n"]),
                 "Pod.metadata.name is missing or not a non-empty string", id="no-name"),
    pytest.param(body(Pod={"metadata": {"name": "a", "uid": 5}}, NodeNames=["n"]), "Pod.metadata.uid is not a string",
                 id="uid-int"),
    pytest.param(body(Pod=POD, Nodes=NODE_LIST, NodeNames=["n1"]),
                 "both Nodes and NodeNames are set; the scheduler sends exactly one", id="both"),
    pytest.param(body(Pod=POD, Nodes=None, NodeNames=None),
                 "neither Nodes nor NodeNames is set; the scheduler sends exactly one", id="neither"),
    pytest.param(body(Pod=POD, NodeNames="n1"), "NodeNames must be a list of node names", id="names-string"),
    pytest.param(body(Pod=POD, Nodes=[1]), "Nodes must be a v1.NodeList object with an items list", id="nodes-list"),
    pytest.param(body(Pod={"metadata": {"name": "a" * 300}}, NodeNames=[]),
                 "Pod.metadata name/namespace/uid too long for a Kubernetes object", id="long-name"),
])
def test_filter_garbage_is_a_protocol_error(req, reason):
    with pytest.raises(ProtocolError) as e:
        extender.parse_filter(req)
    assert str(e.value).startswith(reason)


def test_pod_without_namespace_defaults_like_the_apiserver():
    assert extender.parse_filter(body(Pod={"metadata": {"name": "a"}}, NodeNames=[])).pod.namespace == "default"


@pytest.mark.parametrize("req,reason", [
    pytest.param(body(Pod=POD, NodeNames=["n1", 7]), "NodeNames must hold strings, got 7", id="names-int"),
    pytest.param(body(Pod=POD, Nodes={"items": [{"metadata": {}}]}), "every Nodes.items[] entry needs metadata.name",
                 id="node-without-name"),
])
def test_reject_validates_node_names(req, reason):
    with pytest.raises(ProtocolError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        extender.filter_reject(extender.parse_filter(req), "why")


VICTIM = {"metadata": {"name": "low", "namespace": "default", "uid": "v-1"}}


@pytest.mark.parametrize("req,meta", [
    pytest.param(body(Pod=POD, NodeNameToVictims={"n1": {"Pods": [VICTIM], "NumPDBViolations": 1}},
                      NodeNameToMetaVictims=None),
                 {"n1": {"Pods": [{"UID": "v-1"}], "NumPDBViolations": 1}}, id="full-victims"),
    pytest.param(body(Pod=POD, NodeNameToVictims=None,
                      NodeNameToMetaVictims={"n1": {"Pods": [{"UID": "v-1"}], "NumPDBViolations": 0},
                                             "n2": {"Pods": [], "NumPDBViolations": 0}}),
                 {"n1": {"Pods": [{"UID": "v-1"}], "NumPDBViolations": 0}, "n2": {"Pods": [], "NumPDBViolations": 0}},
                 id="meta-victims"),
    pytest.param(body(Pod=POD, NodeNameToVictims=None, NodeNameToMetaVictims=None), {}, id="no-candidates"),
])
def test_preempt_allow_echoes_candidates_as_meta_victims(req, meta):
    args = extender.parse_preempt(req)
    assert orjson.loads(extender.preempt_allow(args)) == {"NodeNameToMetaVictims": meta}
    assert orjson.loads(extender.preempt_veto()) == {"NodeNameToMetaVictims": {}}


@pytest.mark.parametrize("req,reason", [
    pytest.param(body(Pod=POD, NodeNameToVictims={}, NodeNameToMetaVictims={}),
                 "both NodeNameToVictims and NodeNameToMetaVictims are set", id="both"),
    pytest.param(body(Pod=POD, NodeNameToVictims=[1]), "NodeNameToVictims must be an object", id="victims-list"),
    pytest.param(body(Pod=POD, NodeNameToMetaVictims={"n1": {"Pods": [{"uid": "x"}]}}),
                 "NodeNameToMetaVictims['n1'].Pods[] entry has no UID", id="meta-without-UID"),
    pytest.param(body(Pod=POD, NodeNameToMetaVictims={"n1": {"Pods": [], "NumPDBViolations": "2"}}),
                 "NumPDBViolations of node 'n1' must be an integer", id="pdb-string"),
    pytest.param(body(NodeNameToMetaVictims={}), "missing Pod", id="no-pod"),
])
def test_preempt_garbage_is_a_protocol_error(req, reason):
    with pytest.raises(ProtocolError) as e:
        extender.parse_preempt(req)
    assert str(e.value).startswith(reason)
