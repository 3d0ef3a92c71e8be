"""``ghost-guard heal node/NAME``: drop a ghost Node from every stale watch cache, restarting nothing.

A replica whose etcd watch lost a Node's DELETE keeps serving the Node (issue 27). One write under
the name reaches every cache whose watch still flows: a placeholder Node is created and deleted at
once (UID precondition), and the DELETE the stale cache then receives removes the Node from it, and
from kube-scheduler's informer with it.

1. every replica's cache for the name (LIST ``resourceVersion=0``, ``metadata.name`` field selector),
   then the quorum GET (begun after the replicas were read);
2. only when etcd has no such Node (404) and some replica serves it: the placeholder, of one fixed
   shape (unschedulable, tainted NoSchedule and NoExecute by ``kube-ghost-guard.io/placeholder``,
   heal's labels: what manifests/heal's ``ghost-guard-heal-nodes`` policy allows), created, then
   deleted in a ``finally`` with a UID precondition (a create with no answer, or interrupted before its answer,
   is looked up under the name and deleted if it has heal's labels); a Node etcd has is never touched;
3. polling each replica's cache until none serves the name, or ``timeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import orjson

from guard.kube.reads import Kube

from guard.kube.watch import ReplicaClient

from guard.kube.writes import KubeWriteError
from guard.core.names import pod_name_problem, visible
from guard.core.verdict import ReadStatus

PLACEHOLDER_LABELS = {"app.kubernetes.io/managed-by": "ghost-guard", "app.kubernetes.io/component": "node-placeholder"}
TAINT_KEY = "kube-ghost-guard.io/placeholder"


def placeholder(name: str) -> dict:
    """The Node heal creates under a ghost Node's name: nothing can be scheduled or run on it."""
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": dict(PLACEHOLDER_LABELS)},
            "spec": {"unschedulable": True,
                     "taints": [{"key": TAINT_KEY, "effect": "NoSchedule"}, {"key": TAINT_KEY, "effect": "NoExecute"}]}}


@dataclass
class NodeHealResult:
    node: str
    outcome: str  # healed, consistent, etcd-has-it, needs-heal (dry run), refused, failed, timeout, unreadable
    serving_before: list[str] = field(default_factory=list)
    serving_after: list[str] = field(default_factory=list)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome in ("healed", "consistent", "etcd-has-it")

    def as_dict(self) -> dict:
        return {"node": self.node, "outcome": self.outcome, "ok": self.ok, "serving_before": self.serving_before,
                "serving_after": self.serving_after, "detail": self.detail}


def heal_node(kube: Kube, replicas: Callable[[], Sequence[ReplicaClient]], name: str, *, timeout: float = 10.0,
              dry_run: bool = False, interval: float = 0.2) -> NodeHealResult:
    problem = pod_name_problem(name)  # Node names are DNS-1123 subdomains, as pod names
    if problem is not None:
        return NodeHealResult(name, "refused", detail=f"invalid Node name: {problem}")
    clients = list(replicas())
    views = {c.replica.address: c.serves_node(name) for c in clients}
    serving = sorted(a for a, s in views.items() if s)
    unanswered = sorted(a for a, s in views.items() if s is None)
    read = kube.read_node(name)  # after the caches were read
    if read.status is ReadStatus.ERROR:
        return NodeHealResult(name, "unreadable", serving, serving, f"quorum read failed: {read.error}")
    if read.status is ReadStatus.FOUND:
        return NodeHealResult(name, "etcd-has-it", serving, serving,
                              "etcd has this Node: nothing is written (a Node etcd has is never touched)")
    if not serving:
        if unanswered:
            return NodeHealResult(name, "unreadable", [], [], f"no answer from {', '.join(unanswered)}")
        return NodeHealResult(name, "consistent", [], [], "no replica serves it")
    if dry_run:
        return NodeHealResult(name, "needs-heal", serving, serving, "dry run: nothing written")
    deadline = time.monotonic() + timeout
    uid, maybe_created = "", True  # until the create answers, it may have happened: find the placeholder by its labels
    try:  # from the create on, whatever happens (Ctrl-C included, its answer still on the way), no placeholder stays
        try:
            created = kube.create_node(placeholder(name))
        except KubeWriteError as e:
            maybe_created = e.status == 0  # an answer: nothing was created
            if e.status == 409:
                return NodeHealResult(name, "etcd-has-it", serving, serving, "a Node was created under this name meanwhile")
            outcome = "refused" if e.status in (400, 403, 422) else "failed"
            return NodeHealResult(name, outcome, serving, serving, f"placeholder create: HTTP {e.status} {e.reason}: "
                                  f"{visible(e.message)[:300]}")
        uid = str((created.get("metadata") or {}).get("uid") or "")
        maybe_created = not uid
    finally:
        delete_error = _delete_placeholder(kube, name, uid) if uid else None
        if maybe_created:
            _remove_unanswered(kube, name)
    if delete_error is not None:
        return NodeHealResult(name, "failed", serving, serving, f"placeholder delete: {delete_error} (uid {uid}: delete "
                              "it by hand)")
    while True:
        still = sorted(c.replica.address for c in clients if c.serves_node(name) is not False)
        if not still:
            return NodeHealResult(name, "healed", serving, [], "placeholder created and deleted; no replica serves it")
        if time.monotonic() >= deadline:
            return NodeHealResult(name, "timeout", serving, still,
                                  "still served after the write: that replica's watch may be frozen (restart it)")
        time.sleep(interval)


def _delete_placeholder(kube: Kube, name: str, uid: str) -> str | None:
    """Delete our placeholder Node by UID (precondition): None when it is gone, else what the apiserver said."""
    try:
        kube.delete_node(name, uid)
    except KubeWriteError as e:
        if e.status != 404:
            return f"HTTP {e.status} {e.reason}: {visible(e.message)[:300]}"
    return None


def _remove_unanswered(kube: Kube, name: str) -> None:
    """After a create that got no answer (or was interrupted): delete the Node under the name if it is a
    placeholder, by its labels (a real Node never has them) and its UID."""
    try:
        node = kube.read_node_object(name)
    except KubeWriteError:
        return  # 404: nothing was created; anything else: nothing more can be done here
    meta = node.get("metadata") or {}
    if all((meta.get("labels") or {}).get(k) == v for k, v in PLACEHOLDER_LABELS.items()) and meta.get("uid"):
        _delete_placeholder(kube, name, str(meta["uid"]))


def render(results: Sequence[NodeHealResult], output: str = "table") -> str:
    if output == "json":
        return orjson.dumps([r.as_dict() for r in results], option=orjson.OPT_INDENT_2).decode() + "\n"
    lines = []
    for r in results:
        lines.append(f"node/{visible(r.node)}: {r.outcome} (served before by {', '.join(r.serving_before) or 'none'}; "
                     f"after by {', '.join(r.serving_after) or 'none'}) {visible(r.detail)}")
    return "\n".join(lines) + "\n"
