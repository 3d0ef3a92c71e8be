"""Table tests for guard.core.extender: both protocol modes, exact keys, garbage input."""

import orjson
import pytest

from guard.core import extender
from guard.core.extender import ProtocolError

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
                 "Pod.metadata: name is 300 characters, more than 253", id="long-name"),
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


# --- kube-scheduler's names-mode body: node names copied through as bytes --------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def decoded_whole(req: bytes):
    """What parse_filter + filter_pass give when the body is decoded whole (the reference)."""
    doc = orjson.loads(req)
    args = extender.FilterArgs(extender.pod_ref(doc.get("Pod")), "names", doc["NodeNames"], None)
    return args.pod, orjson.loads(extender.filter_pass(args))


def test_scheduler_shaped_body_keeps_node_names_as_bytes():
    req = body(Pod=POD, Nodes=None, NodeNames=["n1", "n2"])
    args = extender.parse_filter(req)
    assert args.names_json == b'["n1","n2"]'  # the fast path was taken, nothing decoded
    assert args.node_names is None
    assert extender.filter_pass(args) == (b'{"Nodes":null,"NodeNames":["n1","n2"],"FailedNodes":{},'
                                          b'"FailedAndUnresolvableNodes":{},"Error":""}')
    assert extender.node_names(args) == ["n1", "n2"]  # decoded when a ghost needs every name


@pytest.mark.parametrize("names", [["a\\b"], ['a"b'], ["ノード"], ["a\nb"], ["\u007f"]])
def test_names_that_need_decoding_take_the_whole_path(names):
    req = body(Pod=POD, Nodes=None, NodeNames=names)
    args = extender.parse_filter(req)
    assert args.names_json is None
    assert orjson.loads(extender.filter_pass(args))["NodeNames"] == names


@pytest.mark.parametrize("tail", [
    b'["a",,"b"]}',
    b'["a""b"]}',
    b'["a",x"b"]}',
    b'["a"x,"b"]}',
    b'["a","b"}',
    b'["]}',
    b'[""]]}',
    b'["a","b"]} x',
])
def test_malformed_node_names_are_refused_not_echoed(tail):
    req = b'{"Pod":' + orjson.dumps(POD) + b',"Nodes":null,"NodeNames":' + tail
    with pytest.raises(ProtocolError, match="^request body is not valid JSON"):
        extender.parse_filter(req)


def test_a_pod_that_fools_the_split_is_decoded_whole():
    """A label key ``NodeNames`` inside the Pod: the split from the end still finds the real one."""
    pod = {"metadata": {"name": "p", "labels": {"Nodes": "null", "NodeNames": "x"}}, "spec": {}}
    req = b'{"Pod":' + orjson.dumps(pod) + b',"Nodes":null,"NodeNames":["n1"]}'
    args = extender.parse_filter(req)
    assert args.pod.name == "p" and args.names_json == b'["n1"]'
    broken = b'{"Pod":{"metadata":{"name":"p"},"Nodes":null,"NodeNames":["n1"]}'  # Pod never closed
    with pytest.raises(ProtocolError, match="request body is not valid JSON"):
        extender.parse_filter(broken)


plain_names = st.lists(st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12), max_size=20)
any_names = st.lists(st.text(max_size=8), max_size=8)


@settings(max_examples=300, deadline=None, database=None)
@given(names=plain_names | any_names, name=st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,18}[a-z0-9])?", fullmatch=True).filter(lambda n: ".." not in n and ".-" not in n and "-." not in n))
def test_fast_path_agrees_with_decoding_whole(names, name):
    pod = {"metadata": {"name": name, "namespace": "ns", "uid": "u"}, "spec": {"x": names}}
    req = b'{"Pod":' + orjson.dumps(pod) + b',"Nodes":null,"NodeNames":' + orjson.dumps(names) + b"}"
    args = extender.parse_filter(req)
    assert (args.pod, orjson.loads(extender.filter_pass(args))) == decoded_whole(req)


@settings(max_examples=500, deadline=None, database=None)
@given(names=plain_names, cut=st.integers(0, 400), junk=st.sampled_from([b'"', b",", b"\\", b"]", b"[", b"}", b"x", b""]))
def test_corrupted_bodies_are_refused_or_read_exactly(names, cut, junk):
    """One byte inserted anywhere: invalid JSON is a ProtocolError, valid JSON reads as it decodes whole."""
    req = body(Pod=POD, Nodes=None, NodeNames=names)
    cut = min(cut, len(req))
    bad = req[:cut] + junk + req[cut:]
    try:
        doc = orjson.loads(bad)
    except orjson.JSONDecodeError:
        with pytest.raises(ProtocolError, match="request body is not valid JSON"):
            extender.parse_filter(bad)
        return
    def outcome(read):
        try:
            return read(bad)
        except ProtocolError as e:
            return str(e)

    # The inserted byte landed inside a string (or made another valid document): same answer either way.
    fast = outcome(lambda b: (lambda a: (a.pod, orjson.loads(extender.filter_pass(a))))(extender.parse_filter(b)))
    whole = outcome(decoded_whole) if isinstance(doc, dict) and isinstance(doc.get("NodeNames"), list) else fast
    assert fast == whole


# --- hostile bodies against the splice (issue 29): each is read exactly as decoding it whole reads it ---

P = orjson.dumps(POD)
GO_TAIL = b',"Nodes":null,"NodeNames":'


@pytest.mark.parametrize("req,spliced,expected", [
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a","b"]}', True, ["a", "b"], id="kube-scheduler"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["",""]}', True, ["", ""], id="empty-names"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a"]}' + b" \r\n\t" * 30000, True, ["a"], id="huge-trailing-space"),
    pytest.param(b" " * 1000 + b'{"Pod":' + P + GO_TAIL + b'["a"]}', False, ["a"], id="leading-space"),
    pytest.param(b'{"Pod" : ' + P + b' , "Nodes" : null , "NodeNames" : [ "a" , "b" ] }', False, ["a", "b"],
                 id="spaces-everywhere"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a", "b"]}', False, ["a", "b"], id="space-in-names"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a"] }', False, ["a"], id="space-before-brace"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a"],"NodeNames":["b"]}', False, ["b"], id="duplicate-names-key"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a"]' + GO_TAIL + b'["b"]}', False, ["b"], id="duplicate-tail"),
    pytest.param(b'{"Pod":{"metadata":{"name":"other"}},"Pod":' + P + GO_TAIL + b'["a"]}', False, ["a"],
                 id="duplicate-pod-key"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a\\u0062","c\\"d","e\\\\f"]}', False, ["ab", 'c"d', "e\\f"],
                 id="escapes"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a\\",\\"b"]}', False, ['a","b'], id="escaped-separator"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + '["nœud"]}'.encode(), False, ["nœud"], id="non-ascii"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a",["b"],"c"]}', False, ["a", ["b"], "c"], id="nested-array"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a",{"b":"c"}]}', False, ["a", {"b": "c"}], id="object-in-names"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'[1,null,true,"a"]}', False, [1, None, True, "a"], id="non-strings"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'[[[[[]]]]]}', False, [[[[[]]]]], id="deep-arrays"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a\x00b"]}', None, 400, id="raw-control-character"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a","b"]}}', None, 400, id="extra-brace"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a"]]}', None, 400, id="extra-bracket"),
    pytest.param(b'{"Pod":' + P + GO_TAIL + b'["a""b"]}', None, 400, id="missing-comma"),
    pytest.param(b'\xef\xbb\xbf{"Pod":' + P + GO_TAIL + b'["a"]}', None, 400, id="byte-order-mark"),
    pytest.param(b'{"Pod":null' + GO_TAIL + b'["a"]}', None, 400, id="null-pod"),
    pytest.param(b'{"Pod":' + P + b',"Nodes":{"items":[]}' + b',"NodeNames":["a"]}', None, 400, id="both-modes"),
])
def test_hostile_names_mode_bodies_read_as_decoding_whole(req, spliced, expected):
    """The splice is taken only where it is exact; everywhere else the body is decoded whole and gives
    that answer (last duplicate key wins, escapes decoded, non-string names passed back as sent) or a 400."""
    if isinstance(expected, int):
        with pytest.raises(ProtocolError) as e:
            extender.parse_filter(req)
        assert e.value.status == expected
        return
    args = extender.parse_filter(req)
    assert (args.names_json is not None) is spliced
    out = extender.filter_pass(args)
    assert list(orjson.loads(out)) == FILTER_KEYS
    assert orjson.loads(out)["NodeNames"] == expected
    if spliced:  # the request's own bytes, not re-encoded
        assert args.names_json in req and args.names_json in out


def test_the_splice_counts_names_against_max_nodes_without_decoding():
    req = b'{"Pod":' + P + GO_TAIL + orjson.dumps([f"n{i}" for i in range(101)]) + b"}"
    with pytest.raises(extender.TooLarge, match="NodeNames has 101 nodes, more than the limit of 100"):
        extender.parse_filter(req, max_nodes=100)
    assert extender.parse_filter(req, max_nodes=101).names_json is not None
