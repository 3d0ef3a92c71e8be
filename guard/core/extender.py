"""The kube-scheduler extender wire protocol (k8s.io/kube-scheduler/extender/v1).

Pure: bytes in, bytes out, no I/O. The Go structs carry no JSON tags, so the
keys are the Go field names; the embedded Pod and Nodes have no
``apiVersion``/``kind``. A filter reply must use the request's own mode
(``NodeNames`` when the scheduler sent names, ``Nodes`` when it sent a
NodeList): a reply in the wrong field means zero feasible nodes for *every* pod.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import orjson

from guard.core.names import pod_identity_problem
from guard.core.node_verdict import ghost_candidates
from guard.core.verdict import PodRef, Verdict

Mode = Literal["names", "nodes"]


class ExtenderFilterResult(TypedDict):
    Nodes: dict[str, Any] | None
    NodeNames: list[str] | None
    FailedNodes: dict[str, str]
    FailedAndUnresolvableNodes: dict[str, str]
    Error: str


class ExtenderPreemptionResult(TypedDict):
    NodeNameToMetaVictims: dict[str, Any]


class ProtocolError(ValueError):
    """The request is not a well-formed extender request; the reason says why (HTTP ``status``)."""

    status = 400


class TooLarge(ProtocolError):
    """The request is well formed but beyond a size limit (``--max-nodes``): 413 with the reason."""

    status = 413


@dataclass(slots=True)
class FilterArgs:
    pod: PodRef
    mode: Mode
    node_names: list[Any] | None  # as sent (names mode), unless kept as bytes in names_json
    nodes: dict[str, Any] | None  # the NodeList as sent (nodes mode)
    names_json: bytes | None = None  # names mode from kube-scheduler: the NodeNames array's bytes, not decoded

    def names(self) -> list[Any]:
        if self.node_names is None and self.names_json is not None:
            self.node_names = orjson.loads(self.names_json)
        return self.node_names or []


@dataclass(slots=True)
class PreemptArgs:
    pod: PodRef
    meta_victims: dict[str, Any]  # node -> {"Pods": [{"UID": ...}], "NumPDBViolations": n}


# Memory per request: decoding JSON builds Python objects, about 4-15x the bytes for what schedulers and
# apiservers send (one-character strings: ~15x), but up to ~50x for documents made of empty objects or
# arrays (``[[[]]]``: 2 bytes each, ~80 bytes as a list). At one per 8 bytes they cost no more than
# strings do. A document past DENSE_FLOOR_BYTES may hold at most one ``{`` or ``[``
# per BYTES_PER_CONTAINER bytes on average (a v1.Node or v1.Pod has about one per 50-100), counted
# without decoding (quotes included, which only makes the count larger).
DENSE_FLOOR_BYTES = 64 * 1024
BYTES_PER_CONTAINER = 8


def decode(data: bytes) -> Any:
    """``orjson.loads`` of a request body (or part), refusing one shaped to amplify memory (413)."""
    if len(data) > DENSE_FLOOR_BYTES:
        containers = data.count(b"{") + data.count(b"[")
        if containers * BYTES_PER_CONTAINER > len(data):
            raise TooLarge(f"request body has {containers} JSON objects or arrays in {len(data)} bytes, more than "
                           f"one per {BYTES_PER_CONTAINER} bytes; no scheduler or apiserver request is shaped so")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"request body is not valid JSON: {e}") from e


def _load_object(body: bytes) -> dict[str, Any]:
    doc = decode(body)
    if not isinstance(doc, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(doc).__name__}")
    return doc


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def pod_ref(pod: Any, field: str = "Pod") -> PodRef:
    """The namespace/name/uid of an embedded v1.Pod (no apiVersion/kind required), validated as the
    apiserver validates them (guard.core.names): else ProtocolError (400) with the reason."""
    if not isinstance(pod, dict):
        raise ProtocolError(f"missing {field}: expected a v1.Pod object, got {_short(pod)}")
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        raise ProtocolError(f"{field}.metadata is missing or not an object")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{field}.metadata.name is missing or not a non-empty string")
    namespace = meta.get("namespace", "default")
    if not isinstance(namespace, str) or not namespace:
        raise ProtocolError(f"{field}.metadata.namespace is not a non-empty string")
    uid = meta.get("uid", "")
    if uid is None:
        uid = ""
    if not isinstance(uid, str):
        raise ProtocolError(f"{field}.metadata.uid is not a string")
    # As the apiserver validates them (guard.core.names): every read, selector, record and Event the guard
    # builds from this pod uses these values, so nothing else may come through.
    problem = pod_identity_problem(namespace, name, uid)
    if problem is not None:
        raise ProtocolError(f"{field}.metadata: {problem}")
    return PodRef(namespace=namespace, name=name, uid=uid)


# kube-scheduler's body in names mode (nodeCacheCapable: true): Go's encoding/json writes the
# struct fields in order, so it is {"Pod":{...},"Nodes":null,"NodeNames":["n1",...]}.
_GO_HEAD = b'{"Pod":'
_GO_NAMES = b',"Nodes":null,"NodeNames":'
# Bytes a plain node name may hold, besides the quotes: printable ASCII except the backslash (node
# names are DNS subdomains), so no escapes, no control characters, no non-ASCII. Else it is decoded.
_PLAIN = bytes(b for b in range(0x20, 0x7F) if b not in (0x5C, 0x22))


def _plain_names_array(data: bytes) -> bool:
    """Whether ``data`` is a JSON array of plain strings, checked without decoding it.

    With no backslash every quote delimits a string, so the array is well formed
    exactly when it is ``["`` ... ``"]`` and every quote inside belongs to a
    ``","`` separator.
    """
    if data == b"[]":
        return True
    if len(data) < 4 or not data.startswith(b'["') or not data.endswith(b'"]'):
        return False
    inner = data[2:-2]
    quotes = inner.translate(None, _PLAIN)  # what is left must be quotes only
    return not quotes.strip(b'"') and len(quotes) == 2 * inner.count(b'","')


def _split_names_mode(body: bytes) -> tuple[bytes, bytes] | None:
    """(Pod bytes, NodeNames bytes) of a kube-scheduler-shaped names-mode body, else None.

    The node list is located from the end and checked by a strict shape; the
    rest must decode as one JSON value. Together that is exactly a valid
    ``{"Pod": P, "Nodes": null, "NodeNames": [...]}`` (JSON parses one way), so
    the node list can be copied through without decoding or re-encoding it.
    """
    if not body.startswith(_GO_HEAD):
        return None
    end = len(body.rstrip(b" \t\r\n"))
    if end == 0 or body[end - 1] != 0x7D:  # "}"
        return None
    split = body.rfind(_GO_NAMES, len(_GO_HEAD), end)
    if split < 0:
        return None
    names = body[split + len(_GO_NAMES):end - 1]
    if not _plain_names_array(names):
        return None
    return body[len(_GO_HEAD):split], names


def parse_filter(body: bytes, max_nodes: int | None = None) -> FilterArgs:
    """Parse ``ExtenderArgs``: ``{"Pod", "Nodes", "NodeNames"}``, exactly one of the last two set.

    kube-scheduler's own names-mode body takes a fast path: only the Pod is
    decoded, the node names stay bytes for :func:`filter_pass` to copy through.
    Every other body (and any the fast path cannot prove well-formed) is decoded
    whole, which also gives the reason for a bad one.

    ``max_nodes`` caps the nodes of either mode (``NodeNames``, or ``Nodes.items``:
    whole v1.Node objects): more raise :class:`TooLarge` before any node is looked
    at or any reply built (names kept as bytes are counted without decoding them).
    The decoded document itself is bounded by the body limit (``--max-body-bytes``).
    """
    parts = _split_names_mode(body)
    if parts is not None and max_nodes is not None:
        count = 0 if parts[1] == b"[]" else parts[1].count(b'","') + 1
        if count > max_nodes:
            raise TooLarge(_too_many("NodeNames", count, max_nodes))
    if parts is not None:
        try:
            pod = decode(parts[0])
        except TooLarge:
            raise
        except ProtocolError:
            pass  # decoded whole below, for the reason
        else:
            return FilterArgs(pod_ref(pod), "names", None, None, parts[1])
    doc = _load_object(body)
    pod = pod_ref(doc.get("Pod"))
    names = doc.get("NodeNames")
    nodes = doc.get("Nodes")
    if names is not None and nodes is not None:
        raise ProtocolError("both Nodes and NodeNames are set; the scheduler sends exactly one")
    if names is not None:
        if not isinstance(names, list):
            raise ProtocolError("NodeNames must be a list of node names")
        if max_nodes is not None and len(names) > max_nodes:
            raise TooLarge(_too_many("NodeNames", len(names), max_nodes))
        return FilterArgs(pod, "names", names, None)
    if nodes is not None:
        if not isinstance(nodes, dict) or not isinstance(nodes.get("items", []), list):
            raise ProtocolError("Nodes must be a v1.NodeList object with an items list")
        items = nodes.get("items") or []
        if max_nodes is not None and len(items) > max_nodes:
            raise TooLarge(_too_many("Nodes.items", len(items), max_nodes))
        return FilterArgs(pod, "nodes", None, nodes)
    raise ProtocolError("neither Nodes nor NodeNames is set; the scheduler sends exactly one")


def _too_many(field: str, count: int, limit: int) -> str:
    return (f"{field} has {count} nodes, more than the limit of {limit} (--max-nodes); a Kubernetes cluster has at "
            "most 5,000 nodes")


def node_reason(verdict: Verdict) -> str:
    """What every node of a blocked pod says (kube-scheduler shows it in the pod's FailedScheduling event,
    counted per reason): the verdict, short. The pod's identity and the whole reason are in the guard's
    log and its audit record, once, not repeated per node (a reply grows by this per node name)."""
    if verdict.is_ghost:
        return f"ghost pod: {verdict} (see kube-ghost-guard log/record)"
    return f"{verdict}: failing closed (see kube-ghost-guard log)"


def node_names(args: FilterArgs) -> list[str]:
    """Every node name in the request, validated (only needed when rejecting)."""
    if args.mode == "names":
        names = args.names()
        for n in names:
            if not isinstance(n, str):
                raise ProtocolError(f"NodeNames must hold strings, got {_short(n)}")
        return names
    out = []
    for item in (args.nodes or {}).get("items") or []:
        meta = item.get("metadata") if isinstance(item, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            raise ProtocolError("every Nodes.items[] entry needs metadata.name")
        out.append(name)
    return out


_PASS_TAIL = b',"FailedNodes":{},"FailedAndUnresolvableNodes":{},"Error":""}'


def filter_pass(args: FilterArgs) -> bytes:
    """Every node passes, in the request's own mode (names kept as bytes are copied through)."""
    if args.names_json is not None:
        return b'{"Nodes":null,"NodeNames":' + args.names_json + _PASS_TAIL
    result: dict[str, Any]
    if args.mode == "names":
        result = {"Nodes": None, "NodeNames": args.node_names, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""}
    else:
        result = {"Nodes": args.nodes, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": ""}
    return orjson.dumps(result)


def filter_reject(args: FilterArgs, reason: str) -> bytes:
    """Every node fails as *unresolvable* (preemption skips them), in the request's own mode, each with
    ``reason`` (:func:`node_reason`: short, it is repeated per node)."""
    failed = dict.fromkeys(node_names(args), reason)
    result: dict[str, Any]
    if args.mode == "names":
        result = {"Nodes": None, "NodeNames": [], "FailedNodes": {}, "FailedAndUnresolvableNodes": failed, "Error": ""}
    else:
        nodes = {k: v for k, v in (args.nodes or {}).items() if k != "items"}
        nodes["items"] = []
        result = {"Nodes": nodes, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": failed, "Error": ""}
    return orjson.dumps(result)


def _pdb(value: Any, node: str) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"NumPDBViolations of node {node!r} must be an integer")
    return value


def parse_preempt(body: bytes) -> PreemptArgs:
    """Parse ``ExtenderPreemptionArgs``; full victims are reduced to meta victims (UIDs)."""
    doc = _load_object(body)
    pod = pod_ref(doc.get("Pod"))
    full = doc.get("NodeNameToVictims")
    meta = doc.get("NodeNameToMetaVictims")
    if full is not None and meta is not None:
        raise ProtocolError("both NodeNameToVictims and NodeNameToMetaVictims are set; the scheduler sends one")
    out: dict[str, Any] = {}
    source, field = (meta, "NodeNameToMetaVictims") if meta is not None else (full, "NodeNameToVictims")
    if source is None:
        return PreemptArgs(pod, out)
    if not isinstance(source, dict):
        raise ProtocolError(f"{field} must be an object of node name -> victims")
    for node, victims in source.items():
        if not isinstance(victims, dict):
            raise ProtocolError(f"{field}[{node!r}] must be an object with Pods and NumPDBViolations")
        pods = victims.get("Pods") or []
        if not isinstance(pods, list):
            raise ProtocolError(f"{field}[{node!r}].Pods must be a list")
        uids = []
        for p in pods:
            if meta is not None:
                uid = p.get("UID") if isinstance(p, dict) else None
            else:
                m = p.get("metadata") if isinstance(p, dict) else None
                uid = m.get("uid") if isinstance(m, dict) else None
            if not isinstance(uid, str):
                raise ProtocolError(f"{field}[{node!r}].Pods[] entry has no UID")
            uids.append({"UID": uid})
        out[node] = {"Pods": uids, "NumPDBViolations": _pdb(victims.get("NumPDBViolations"), node)}
    return PreemptArgs(pod, out)


def preempt_allow(args: PreemptArgs) -> bytes:
    """Every candidate unchanged, as meta victims."""
    return orjson.dumps({"NodeNameToMetaVictims": args.meta_victims})


def preempt_veto() -> bytes:
    """No node may lose a pod for this one."""
    return b'{"NodeNameToMetaVictims":{}}'


# --- ghost Nodes (guard/core/node_verdict.py): a live pod's candidates etcd lacks --------------------------


def candidate_names(args: FilterArgs) -> list[str]:
    """The candidate node names of a filter call that are strings (others are left to pass as sent)."""
    if args.mode == "names":
        return [n for n in args.names() if isinstance(n, str)]
    out = []
    for item in (args.nodes or {}).get("items") or []:
        meta = item.get("metadata") if isinstance(item, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        if isinstance(name, str):
            out.append(name)
    return out


def filter_some(args: FilterArgs, failed: dict[str, str]) -> bytes:
    """The candidates in ``failed`` fail as *unresolvable* (each with its reason), the rest pass, in the
    request's own mode. With nothing failed, :func:`filter_pass`."""
    if not failed:
        return filter_pass(args)
    result: dict[str, Any]
    if args.mode == "names":
        kept = [n for n in args.names() if not (isinstance(n, str) and n in failed)]
        result = {"Nodes": None, "NodeNames": kept, "FailedNodes": {}, "FailedAndUnresolvableNodes": failed, "Error": ""}
    else:
        nodes = {k: v for k, v in (args.nodes or {}).items() if k != "items"}
        nodes["items"] = [item for item in (args.nodes or {}).get("items") or []
                          if _item_name(item) not in failed]
        result = {"Nodes": nodes, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": failed, "Error": ""}
    return orjson.dumps(result)


def _item_name(item: Any) -> Any:
    meta = item.get("metadata") if isinstance(item, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else None


def preempt_without(args: PreemptArgs, nodes: set[str] | frozenset[str]) -> bytes:
    """Every candidate except those on ``nodes``, as meta victims."""
    return orjson.dumps({"NodeNameToMetaVictims": {n: v for n, v in args.meta_victims.items() if n not in nodes}})


# --- one verb call's bytes, both ends (guard.http.filter in the worker, guard.serving.offload in a helper) ----


def parse_verb(path: str, body: bytes, max_nodes: int | None) -> FilterArgs | PreemptArgs:
    """The arguments of a ``/filter`` or ``/preempt`` body. Raises ProtocolError."""
    return parse_filter(body, max_nodes) if path == "/filter" else parse_preempt(body)


def verb_reply(args: FilterArgs | PreemptArgs, block_reason: str | None,
               ghosts: Mapping[str, object]) -> tuple[bytes, int]:
    """(the verb's answer, candidates dropped as ghost Nodes). ``block_reason``: the pod is blocked
    (:func:`node_reason`: every node fails with it, a preemptor is vetoed); None: allowed, every
    candidate but the ghost Nodes in ``ghosts`` (guard/core/node_verdict.py; with none known that is
    one test, no work per node name). Raises ProtocolError (a node name that is not a string)."""
    if isinstance(args, FilterArgs):
        if block_reason is not None:
            return filter_reject(args, block_reason), 0
        if not ghosts:
            return filter_pass(args), 0
        failed = ghost_candidates(candidate_names(args), ghosts)
        return filter_some(args, failed), len(failed)
    if block_reason is not None:
        return preempt_veto(), 0
    if not ghosts:
        return preempt_allow(args), 0
    dropped = {n for n in args.meta_victims if n in ghosts}
    return preempt_without(args, dropped), len(dropped)
