"""Ghost Nodes, kept current in the background: each replica's Node names, and the quorum reads.

One LIST and one WATCH of Nodes per apiserver replica (metadata only where the apiserver
offers it; a re-LIST only when a watch expires), fed into :class:`guard.core.node_verdict.NodeKnowledge`.
Once a second the names the replicas disagree on (rare: a lost Node event) get one quorum
read each (``Kube.read_node``, served by etcd). With no lost event this makes no request at
all beyond the watches, and none per pod; the scheduling path only reads ``ghosts`` (a
mapping replaced whole on each change: no lock, no work when it is empty).

A confirmed ghost Node is attributed to the replicas serving it: a log line,
``ghost_guard_ghost_nodes{replica}``, ``ghost_guard_ghost_node_detections_total{replica}``,
a ``GhostNode`` Warning Event on the Node, and the audit store's record of the ghost Node
(``record_node``: its name and UID, as a serving replica's cache has it, and those replicas; once per
identity, each replica marked healed when it no longer serves it). A read that fails leaves the Node passing
(fail open), counted in ``ghost_guard_node_reads_total{outcome="error"}``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from guard import metrics
from guard.audit.backend import GuardAudit
from guard.kube.reads import Kube
from guard.kube.watch import ReplicaClient, WatchExpired
from guard.kube.writes import emit_node_event
from guard.core.node_verdict import GhostNode, NodeKnowledge
from guard.engine.background import Background
from guard.engine.replicas import ReplicaPool

log = logging.getLogger("guard.ghostnodes")

# Most quorum reads of Nodes per tick (a second): a flood of lost Node events stays bounded.
MAX_READS_PER_TICK = 20
# Seconds between attempts to re-list a replica whose list or watch failed.
RETRY_SECONDS = 2.0


class GhostNodes:
    """The ghost Nodes every apiserver replica serves, for ``/filter`` and ``/preempt``."""

    def __init__(self, kube: Kube, pool: ReplicaPool, *, knowledge: NodeKnowledge | None = None,
                 clock: Callable[[], float] = time.monotonic, events: bool = True,
                 audit: GuardAudit | None = None) -> None:
        self.kube = kube
        self.pool = pool
        self.knowledge = knowledge or NodeKnowledge()
        self._clock = clock
        self._events = events
        self._lock = threading.Lock()
        self._bg = Background(log)
        self._stop = self._bg.stop
        self._watchers: dict[str, tuple[ReplicaClient, threading.Thread, threading.Event]] = {}
        self._up: dict[str, bool] = {}
        self._reported: set[tuple[str, str]] = set()  # (name, replica) whose detection was counted
        self._audit = audit
        self._uids: dict[str, str] = {}  # ghost Node name -> the UID its record was written under
        self._checked: float | None = None  # when the last round of the check ended

    @property
    def ghosts(self) -> Mapping[str, GhostNode]:
        """Name -> ghost Node; empty in the normal case. Read without a lock (replaced whole)."""
        return self.knowledge.ghosts

    def start(self) -> None:
        self._bg.loop("ghost-nodes", self.tick, 1.0, what="ghost-Node check")

    def close(self) -> None:
        self._bg.close()
        with self._lock:
            for _, _, stop in self._watchers.values():
                stop.set()

    # --- the manager: one watcher per replica, the reads ------------------------------------------

    def tick(self) -> None:
        clients = {c.replica.address: c for c in self.pool.clients()}
        with self._lock:
            for address, (client, _, stop) in list(self._watchers.items()):
                if clients.get(address) is not client:
                    stop.set()
                    del self._watchers[address]
                    self._up.pop(address, None)
                    self.knowledge.forget(address, self._clock())
            for address, client in clients.items():
                if address not in self._watchers:
                    stop = threading.Event()
                    thread = self._bg.thread(f"ghost-nodes-{address}", self._watch_loop, client, stop)
                    self._watchers[address] = (client, thread, stop)
            due = self.knowledge.due(self._clock(), MAX_READS_PER_TICK)
        for name, changes in due:
            with self._lock:
                serving = sorted(r for r, names in self.knowledge.served.items() if name in names)
                recheck = name in self.knowledge.ghosts
            if not recheck:
                log.info("Node %s: served by replica(s) %s only; reading it from etcd", name, ", ".join(serving))
            read = self.kube.read_node(name)
            with self._lock:
                outcome = self.knowledge.landed(name, changes, read, self._clock())
                ghost = self.knowledge.ghosts.get(name)
            metrics.labelled(metrics.NODE_READS, outcome).inc()
            if outcome == "error":
                log.warning("quorum read of Node %s failed (%s): it passes (fail open)", name, read.error)
            elif outcome == "ghost" and ghost is not None:
                self._attribute(ghost)
        self._export(clients)
        self._checked = self._clock()

    def _attribute(self, ghost: GhostNode) -> None:
        fresh = [r for r in ghost.replicas if (ghost.name, r) not in self._reported]
        if not fresh:
            return
        self._reported.update((ghost.name, r) for r in fresh)
        log.warning("ghost Node %s: not in etcd (quorum read), still served by apiserver replica(s) %s; "
                    "its candidates are refused (FailedAndUnresolvableNodes); heal: ghost-guard heal node/%s",
                    ghost.name, ", ".join(ghost.replicas), ghost.name)
        for replica in fresh:
            metrics.GHOST_NODE_DETECTIONS.labels(replica).inc()
        self._record(ghost)
        if self._events:
            try:
                emit_node_event(self.kube, ghost.name, "GhostNode",
                           f"Node {ghost.name} is deleted in etcd (quorum read) but apiserver replica(s) "
                           f"{', '.join(ghost.replicas)} still serve it from a stale watch cache; ghost-guard "
                           f"refuses it as a candidate. Heal: ghost-guard heal node/{ghost.name}")
            except Exception as e:  # an Event is information: never a reason to fail
                log.warning("could not record a GhostNode Event for %s: %s", ghost.name, str(e)[:200])

    def _record(self, ghost: GhostNode) -> None:
        """The audit record of a confirmed ghost Node: its UID from a replica serving it (the etcd read said 404:
        only a stale cache still knows it), the replicas serving it."""
        if self._audit is None:
            return
        uid = self._uids.get(ghost.name)
        if uid is None:
            clients = {c.replica.address: c for c in self.pool.clients()}
            for replica in ghost.replicas:
                client = clients.get(replica)
                got = client.node_uid(ghost.name) if client is not None else None
                if got:
                    uid = got
                    break
            uid = uid or ""  # no replica told it (it healed meanwhile, or did not answer): the name's record
            if len(self._uids) > 10_000:
                self._uids.clear()
            self._uids[ghost.name] = uid
        name, replicas = ghost.name, list(ghost.replicas)
        self._audit.write("node", f"ghost Node {name}", lambda store: store.record_node(
            name=name, uid=uid, serving=replicas, at=time.time(),
            evidence={"quorum_get": {"outcome": "not-found"}, "served_by": replicas}))

    def _export(self, clients: Mapping[str, ReplicaClient]) -> None:
        ghosts = self.knowledge.ghosts
        for address in clients:
            served = sum(1 for g in ghosts.values() if address in g.replicas)
            metrics.GHOST_NODES.labels(address).set(served)
            metrics.NODE_WATCH_UP.labels(address).set(1 if self._up.get(address) else 0)
        healed: dict[str, list[str]] = {}  # a replica that served a ghost Node and no longer does
        for n, r in self._reported:
            if n not in ghosts or r not in ghosts[n].replicas:
                healed.setdefault(n, []).append(r)
        self._reported = {(n, r) for n, r in self._reported if n in ghosts and r in ghosts[n].replicas}
        for name, replicas in healed.items():
            uid = self._uids.get(name, "") if name in ghosts else self._uids.pop(name, "")
            log.info("ghost Node %s is no longer served by %s", name, ", ".join(sorted(replicas)))
            self._record_healed(name, uid, sorted(replicas))

    def _record_healed(self, name: str, uid: str, replicas: list[str]) -> None:
        if self._audit is not None:
            self._audit.write("node", f"ghost Node {name}", lambda store: store.record_node(
                name=name, uid=uid, serving=[], healed=replicas, at=time.time()))

    # --- one replica's Nodes ----------------------------------------------------------------------

    def _watch_loop(self, client: ReplicaClient, stop: threading.Event) -> None:
        address = client.replica.address
        while not stop.is_set() and not self._stop.is_set():
            try:
                rv, names = client.list_node_names()
                with self._lock:
                    if stop.is_set():
                        return
                    self.knowledge.listed(address, names, self._clock())
                    was_up, self._up[address] = self._up.get(address), True
                if not was_up:  # the first listing, or the first since a failure (re-lists after a 410 are silent)
                    log.info("Nodes of replica %s: %d listed (resourceVersion %s); watching", address, len(names), rv)
                while not stop.is_set():
                    for event in client.watch_nodes(rv):
                        if stop.is_set():
                            return
                        rv = self._apply(address, event) or rv
            except WatchExpired:
                continue  # re-list at once
            except Exception as e:
                log.info("Node watch on replica %s failed (%s: %s); re-listing in %gs", address,
                         type(e).__name__, str(e)[:200], RETRY_SECONDS)
                with self._lock:
                    self._up[address] = False
                    self.knowledge.forget(address, self._clock())  # its view says nothing until re-listed
                stop.wait(RETRY_SECONDS)

    def _apply(self, address: str, event: dict) -> str | None:
        """One watch event; returns its resourceVersion (to resume from)."""
        obj = event.get("object") or {}
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        if not isinstance(meta, dict):
            return None
        rv = str(meta.get("resourceVersion") or "") or None
        kind = event.get("type")
        name = meta.get("name")
        if kind == "BOOKMARK" or not isinstance(name, str) or not name:
            return rv
        with self._lock:
            if kind == "DELETED":
                self.knowledge.deleted(address, name, self._clock())
            elif kind in ("ADDED", "MODIFIED"):
                self.knowledge.added(address, name, self._clock())
        return rv

    def status(self) -> dict[str, object]:
        """/readyz detail: the ghost Nodes and which replicas serve them; the replicas whose Nodes are watched;
        the names the replicas disagree on that are not ghost Nodes (about to be read, or real); how long ago
        the check's last round ended (None before the first)."""
        with self._lock:
            suspects = self.knowledge.suspects()
            watched = {a: bool(up) for a, up in sorted(self._up.items())}
        checked = self._checked
        return {"ghost_nodes": {n: list(g.replicas) for n, g in sorted(self.knowledge.ghosts.items())[:20]},
                "watched": watched,
                "disagreed": {n: list(r) for n, r in suspects.items()},
                "last_round_seconds_ago": None if checked is None else round(self._clock() - checked, 1)}


def check_nodes_now(kube: Kube, clients: list[ReplicaClient]) -> tuple[list[dict[str, object]], list[str]]:
    """``report --live``: the ghost Nodes now. Every replica's Node names (one LIST each), one quorum read
    of each name they disagree on, then the replicas listed again: a Node etcd lacks (404, a read begun
    after the first listing) that a replica still serves after the read is a ghost Node. Returns
    (ghost Nodes: ``{"node", "replicas"}``, errors: replicas whose Nodes could not be listed, and reads
    that failed). Rules: :class:`guard.core.node_verdict.NodeKnowledge`, with no settle time."""
    knowledge = NodeKnowledge(settle=0.0)
    errors: list[str] = []

    def listing() -> dict[str, set[str]]:
        out = {}
        for c in clients:
            try:
                out[c.replica.address] = set(c.list_node_names()[1])
            except Exception as e:
                errors.append(f"{c.replica.address}: Nodes not listed ({type(e).__name__})")
        return out

    for address, names in listing().items():
        knowledge.listed(address, names, 0.0)
    for name, changes in knowledge.due(0.0, MAX_READS_PER_TICK * 5):
        read = kube.read_node(name)
        if knowledge.landed(name, changes, read, 0.0) == "error":
            errors.append(f"Node {name}: quorum read failed ({read.error})")
    again = listing()
    ghosts: list[dict[str, object]] = []
    for name, ghost in sorted(knowledge.ghosts.items()):
        serving = [r for r in ghost.replicas if name in again.get(r, ())]
        if serving:
            ghosts.append({"node": name, "replicas": serving})
    return ghosts, errors
