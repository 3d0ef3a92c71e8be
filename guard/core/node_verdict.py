"""Ghost Nodes: which candidate Nodes of a scheduling call etcd no longer has. Pure: no I/O, no clock.

A Node deleted in etcd but kept by one replica's stale watch cache attracts pods: the
scheduler binds to it (binding does not check the Node), PodGC deletes the pods as orphans,
the ReplicaSet recreates them, for as long as the cache keeps the Node (issue 27).

:class:`NodeKnowledge` keeps, per apiserver replica, the names of the Nodes its watch cache
serves (a LIST and a WATCH of Nodes per replica, fed in by guard.engine.ghost_nodes), and what quorum
reads (a GET with no resourceVersion, served by etcd) said about the names the replicas
disagree on. The rules:

- A name every synced replica serves, or none does, is never read: with no ghost Node and no
  lost event, knowing the Nodes costs no request at all, and none per pod.
- A name some synced replica serves and another synced replica does not, for ``settle``
  seconds (longer than a watch event takes to reach every replica), is a *suspect*: one quorum
  read of it (:meth:`NodeKnowledge.due`). At most one read per change of the name, plus one
  every ``recheck`` seconds while it stays a ghost, and a failed read is retried after
  ``retry`` seconds.
- Only a read that **began after the last change** of the name in any replica's view counts
  (each read carries the name's change count, :meth:`NodeKnowledge.landed` drops a stale one).
  ``not-found`` makes the name a ghost Node, attributed to the replicas serving it; ``found``
  makes it real (never rejected); a failed read leaves it unknown (it passes: fail open, and
  the caller counts it).
- Any later change of the name (a replica adds or deletes it: the Node recreated, a cache
  healed) withdraws the ghost at once; the name is read again if the replicas still disagree.
  A name no replica serves is forgotten.

:func:`ghost_candidates` is the per-call decision: the candidates that are ghost Nodes, with a
short reason each. With no ghost Node (the normal case) it does no work per name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from guard.core.verdict import QuorumRead, ReadStatus

#: A ghost Node's reason in /filter's FailedAndUnresolvableNodes (short: one per failed candidate).
GHOST_NODE_REASON = "ghost node: not in etcd (quorum read); a stale apiserver cache serves it"

#: Seconds a name may differ between replicas before it is read (a watch event's usual lag is ms).
SETTLE_SECONDS = 2.0
#: Seconds between reads of a name that stays a ghost (a Node recreated under it is then seen
#: even if no replica's watch told the guard).
RECHECK_SECONDS = 30.0
#: Seconds before a failed read is tried again.
RETRY_SECONDS = 5.0


@dataclass(slots=True)
class _Name:
    changes: int = 0  # the knowledge's change sequence at the last change of the name (never reused)
    since: float = 0.0  # when the replicas last began to disagree on it (or it last changed)
    verdict: str = ""  # "" (not read since the last change), "ghost", "real", "error"
    next_read: float = 0.0  # earliest next read
    in_flight: bool = False


@dataclass(frozen=True, slots=True)
class GhostNode:
    name: str
    replicas: tuple[str, ...]  # the replicas whose caches serve it
    since: float  # when the quorum read that condemned it landed


@dataclass(slots=True)
class NodeKnowledge:
    settle: float = SETTLE_SECONDS
    recheck: float = RECHECK_SECONDS
    retry: float = RETRY_SECONDS
    #: replica -> the Node names its cache serves; a replica is here only once its LIST landed.
    served: dict[str, set[str]] = field(default_factory=dict)
    _names: dict[str, _Name] = field(default_factory=dict)
    _seq: int = 0  # every change of any name takes the next number: a forgotten name never reuses one
    _watch: set[str] = field(default_factory=set)  # names that may need a read (changed, ghost, failed)
    #: name -> the ghost Node; replaced whole on every change, so a reader needs no lock.
    ghosts: Mapping[str, GhostNode] = field(default_factory=dict)

    # --- what the replicas serve -------------------------------------------------------------------

    def listed(self, replica: str, names: Iterable[str], now: float) -> None:
        """A replica's LIST (or re-LIST after its watch expired) landed: it serves exactly ``names``."""
        new = set(names)
        old = self.served.get(replica)
        self.served[replica] = new
        changed = (new ^ old) if old is not None else new
        for name in changed:
            self._changed(name, now)
        if old is None:  # a replica newly synced: every name it lacks now differs
            for name in self._all_names() - new:
                self._changed(name, now)
        self._settle_views(now)

    def added(self, replica: str, name: str, now: float) -> None:
        """A replica's watch delivered the Node ``name`` (ADDED, or MODIFIED of one it did not have)."""
        names = self.served.get(replica)
        if names is None or name in names:
            return
        names.add(name)
        self._changed(name, now)

    def deleted(self, replica: str, name: str, now: float) -> None:
        """A replica's watch delivered the deletion of the Node ``name``."""
        names = self.served.get(replica)
        if names is None or name not in names:
            return
        names.discard(name)
        self._changed(name, now)
        if not any(name in n for n in self.served.values()):
            self._forget_name(name)

    def forget(self, replica: str, now: float) -> None:
        """A replica is no longer known (removed, or its watch broke): its view says nothing."""
        old = self.served.pop(replica, None)
        if old is not None:
            for name in old:
                self._changed(name, now)
            self._settle_views(now)

    # --- the quorum reads --------------------------------------------------------------------------

    def due(self, now: float, limit: int | None = None) -> list[tuple[str, int]]:
        """(name, change number) of every name to read now (at most ``limit``); each is marked in
        flight until :meth:`landed` is called with that number."""
        out: list[tuple[str, int]] = []
        for name in list(self._watch):
            if limit is not None and len(out) >= limit:
                break
            state = self._names.get(name)
            if state is None or state.verdict == "real" or not self._differs(name):
                self._watch.discard(name)  # back here on its next change
                continue
            if state.in_flight or now < state.next_read:
                continue
            if state.verdict == "" and now - state.since < self.settle:
                continue
            state.in_flight = True
            out.append((name, state.changes))
        return out

    def landed(self, name: str, changes: int, read: QuorumRead, now: float) -> str:
        """A quorum read of the Node ``name`` that began at change number ``changes`` landed. Returns
        what it made of the name: "ghost", "real", "error", or "stale" (the name changed since the
        read began, or it is no longer a suspect: the read says nothing)."""
        state = self._names.get(name)
        if state is None:
            return "stale"
        if state.changes != changes:  # changed since the read began (_changed cleared in_flight)
            return "stale"
        state.in_flight = False
        if not self._differs(name):
            return "stale"
        if read.status is ReadStatus.NOT_FOUND:
            state.verdict, state.next_read = "ghost", now + self.recheck
            self._set_ghost(GhostNode(name, tuple(sorted(r for r, n in self.served.items() if name in n)), now))
        elif read.status is ReadStatus.FOUND:
            state.verdict = "real"
            self._drop_ghost(name)
        else:
            state.verdict, state.next_read = "error", now + self.retry
            # a ghost whose recheck failed stays a ghost: etcd said 404 and nothing changed since
        return state.verdict

    def suspects(self, limit: int = 20) -> dict[str, tuple[str, ...]]:
        """Names the replicas disagree on that are not decided yet (within the settle time, being read, or
        their read failed): each with the replicas serving it, at most ``limit``, by name."""
        names = sorted(n for n in self._watch if n in self._names and self._names[n].verdict in ("", "error")
                       and self._differs(n))[:limit]
        return {n: tuple(sorted(r for r, served in self.served.items() if n in served)) for n in names}

    # --- internals ---------------------------------------------------------------------------------

    def _all_names(self) -> set[str]:
        out: set[str] = set()
        for names in self.served.values():
            out |= names
        return out

    def _differs(self, name: str) -> bool:
        has = [name in names for names in self.served.values()]
        return any(has) and not all(has)

    def _changed(self, name: str, now: float) -> None:
        state = self._names.get(name)
        if state is None:
            state = self._names[name] = _Name()
        self._seq += 1
        state.changes = self._seq
        state.since = now
        state.verdict = ""
        state.next_read = 0.0
        state.in_flight = False  # a read in flight began before this change: landed() drops it
        self._watch.add(name)
        self._drop_ghost(name)

    def _forget_name(self, name: str) -> None:
        self._names.pop(name, None)
        self._watch.discard(name)

    def _settle_views(self, now: float) -> None:
        """Forget names no replica serves (nothing to decide about them)."""
        served = self._all_names()
        for name in [n for n in self._names if n not in served]:
            self._forget_name(name)

    def _set_ghost(self, ghost: GhostNode) -> None:
        ghosts = dict(self.ghosts)
        ghosts[ghost.name] = ghost
        self.ghosts = ghosts

    def _drop_ghost(self, name: str) -> None:
        if name in self.ghosts:
            ghosts = dict(self.ghosts)
            del ghosts[name]
            self.ghosts = ghosts


def ghost_candidates(names: Iterable[str], ghosts: Mapping[str, object]) -> dict[str, str]:
    """The candidate Nodes of one scheduling call that are ghost Nodes, each with its reason.

    Only names in ``ghosts`` (confirmed by a quorum read) fail; an unknown name passes. With no
    ghost Node at all, no name is looked at."""
    if not ghosts:
        return {}
    return {n: GHOST_NODE_REASON for n in names if n in ghosts}
