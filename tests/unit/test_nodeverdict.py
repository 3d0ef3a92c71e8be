"""The ghost-Node decision (guard/core/node_verdict.py): pure, a fake clock, every interleaving of a Node
added, deleted, a lost delete, and a quorum read that lands before or after a change, or fails."""

from __future__ import annotations

import itertools

import pytest

from guard.core.node_verdict import GHOST_NODE_REASON, NodeKnowledge, ghost_candidates
from guard.core.verdict import QuorumRead

GONE = QuorumRead.not_found()
THERE = QuorumRead.found("uid-1")
FAILED = QuorumRead.failed("timeout after 1s")


def two(names=("a", "b", "n1")) -> NodeKnowledge:
    k = NodeKnowledge(settle=2.0, recheck=30.0, retry=5.0)
    k.listed("A", names, 0.0)
    k.listed("B", names, 0.0)
    return k


def lost_delete(k: NodeKnowledge, name: str = "n1", at: float = 10.0) -> None:
    """etcd deleted ``name``; replica A saw it, replica B's watch lost it."""
    k.deleted("A", name, at)


def test_agreeing_replicas_cost_no_read():
    k = two()
    assert k.due(100.0) == []
    k.added("A", "c", 101.0)
    k.added("B", "c", 101.01)  # a normal add: both replicas within the settle time
    k.deleted("A", "a", 102.0)
    k.deleted("B", "a", 102.01)
    assert k.due(200.0) == [] and k.ghosts == {}


def test_lost_delete_is_read_once_after_settle_then_a_ghost():
    k = two()
    lost_delete(k)
    assert k.due(11.0) == []  # within the settle time
    [(name, changes)] = k.due(12.5)
    assert name == "n1"
    assert k.due(12.6) == []  # in flight: not read twice
    assert k.landed(name, changes, GONE, 13.0) == "ghost"
    assert set(k.ghosts) == {"n1"} and k.ghosts["n1"].replicas == ("B",)
    assert ghost_candidates(["a", "n1", "zzz"], k.ghosts) == {"n1": GHOST_NODE_REASON}
    assert k.due(20.0) == []  # no read per call or per tick while it stays a ghost ...
    assert [n for n, _ in k.due(43.1)] == ["n1"]  # ... only a recheck every 30 s


def test_found_by_quorum_read_is_never_a_ghost_and_not_read_again():
    k = two()
    k.added("B", "late", 10.0)  # A lost the creation: A lacks a Node etcd has
    [(name, changes)] = k.due(13.0)
    assert k.landed(name, changes, THERE, 13.1) == "real"
    assert k.ghosts == {} and ghost_candidates(["late"], k.ghosts) == {}
    assert k.due(1000.0) == []


def test_failed_read_fails_open_and_retries():
    k = two()
    lost_delete(k)
    [(name, changes)] = k.due(13.0)
    assert k.landed(name, changes, FAILED, 13.1) == "error"
    assert ghost_candidates(["n1"], k.ghosts) == {}
    assert k.due(15.0) == []
    [(name, changes)] = k.due(18.2)
    assert k.landed(name, changes, GONE, 18.3) == "ghost"


def test_failed_recheck_keeps_the_ghost():
    k = two()
    lost_delete(k)
    [(n, c)] = k.due(13.0)
    k.landed(n, c, GONE, 13.0)
    [(n, c)] = k.due(44.0)
    assert k.landed(n, c, FAILED, 44.0) == "error"
    assert "n1" in k.ghosts


def test_recreated_node_is_released_at_once():
    k = two()
    lost_delete(k)
    [(n, c)] = k.due(13.0)
    k.landed(n, c, GONE, 13.0)
    k.added("A", "n1", 20.0)  # the Node is created again: A's watch delivers it
    assert k.ghosts == {}
    assert k.due(100.0) == []  # both serve it: nothing to read


def test_healed_cache_forgets_the_ghost():
    k = two()
    lost_delete(k)
    [(n, c)] = k.due(13.0)
    k.landed(n, c, GONE, 13.0)
    k.deleted("B", "n1", 20.0)  # the heal's write reached B's cache
    assert k.ghosts == {} and k.due(100.0) == []


def test_unknown_name_passes_and_empty_set_does_no_work():
    class Boom:
        def __iter__(self):
            raise AssertionError("names looked at with no ghost Node")

    assert ghost_candidates(Boom(), {}) == {}
    k = two()
    assert ghost_candidates(["never-seen"], {"x": object()}) == {}


def test_single_replica_or_unsynced_replica_never_suspects():
    k = NodeKnowledge()
    k.listed("A", ["a", "b"], 0.0)
    k.deleted("A", "a", 1.0)
    assert k.due(100.0) == []
    k.listed("B", ["a", "b"], 101.0)  # B lists a Node A lacks
    [(n, c)] = k.due(104.0)
    assert n == "a"


def test_forgotten_replica_withdraws_its_ghosts():
    k = two()
    lost_delete(k)
    [(n, c)] = k.due(13.0)
    k.landed(n, c, GONE, 13.0)
    k.forget("B", 20.0)
    assert k.ghosts == {} and k.due(100.0) == []


def test_relist_of_stale_replica_that_still_serves_it_reads_again():
    k = two()
    lost_delete(k)
    [(n, c)] = k.due(13.0)
    k.landed(n, c, GONE, 13.0)
    k.listed("B", ["a", "b", "n1"], 20.0)  # B re-listed (watch expired): same names, nothing changed
    assert "n1" in k.ghosts


# Every interleaving of the events around one quorum read: a read only condemns when it began after
# the last change of the name and the replicas still disagree when it lands; a Node etcd has is never
# a ghost.
EVENTS = ("delete-A", "delete-B", "add-A", "add-B", "land")


@pytest.mark.parametrize("order", list(itertools.permutations(EVENTS)))
@pytest.mark.parametrize("read", ["gone", "there", "failed"])
def test_every_interleaving(order, read):
    k = two()
    lost_delete(k, at=0.5)  # replicas disagree: A lacks n1
    [(n, c)] = k.due(3.0)
    result = {"gone": GONE, "there": THERE, "failed": FAILED}[read]
    changed = False
    t = 4.0
    for ev in order:
        t += 0.1
        if ev == "land":
            outcome = k.landed(n, c, result, t)
            differ = ("n1" in k.served["A"]) != ("n1" in k.served["B"])
            if changed or not differ:
                assert outcome == "stale" and "n1" not in k.ghosts  # a read from before a change says nothing
            else:
                assert outcome == {"gone": "ghost", "there": "real", "failed": "error"}[read]
                assert ("n1" in k.ghosts) == (read == "gone")
        else:
            kind, replica = ev.split("-")
            before = "n1" in k.served[replica]
            (k.deleted if kind == "delete" else k.added)(replica, "n1", t)
            changed = changed or before != ("n1" in k.served[replica])  # a delete of what it lacks is no change
            if before != ("n1" in k.served[replica]):
                assert "n1" not in k.ghosts  # any change of the name withdraws a ghost at once
    if changed:
        assert "n1" not in k.ghosts
    both = "n1" in k.served["A"] and "n1" in k.served["B"]
    if both or not ("n1" in k.served["A"] or "n1" in k.served["B"]):
        assert k.due(t + 100) == []  # replicas agree: nothing to read
    else:
        assert [name for name, _ in k.due(t + 100)] == ["n1"]  # still disagree: one new read


# --- the reply (guard/core/extender.py): only the ghost Nodes fail, in the request's own mode -------------

import orjson  # noqa: E402

from guard.core import extender  # noqa: E402

POD = {"metadata": {"name": "web-1", "namespace": "default", "uid": "u1"}}


def test_filter_some_in_names_mode_from_kube_schedulers_own_bytes():
    body = b'{"Pod":' + orjson.dumps(POD) + b',"Nodes":null,"NodeNames":["a","ghost","b"]}'
    args = extender.parse_filter(body)
    assert args.names_json is not None  # the fast path: names kept as bytes
    failed = ghost_candidates(extender.candidate_names(args), {"ghost": object()})
    out = orjson.loads(extender.filter_some(args, failed))
    assert out == {"Nodes": None, "NodeNames": ["a", "b"], "FailedNodes": {},
                   "FailedAndUnresolvableNodes": {"ghost": GHOST_NODE_REASON}, "Error": ""}


def test_filter_some_in_nodes_mode_keeps_the_list_metadata():
    items = [{"metadata": {"name": n}, "status": {}} for n in ("a", "ghost")]
    args = extender.parse_filter(orjson.dumps({"Pod": POD, "Nodes": {"metadata": {"resourceVersion": "7"},
                                                                     "items": items}}))
    failed = ghost_candidates(extender.candidate_names(args), {"ghost": object()})
    out = orjson.loads(extender.filter_some(args, failed))
    assert out["Nodes"] == {"metadata": {"resourceVersion": "7"}, "items": [items[0]]}
    assert out["FailedAndUnresolvableNodes"] == {"ghost": GHOST_NODE_REASON} and out["NodeNames"] is None


def test_filter_some_with_nothing_failed_is_the_pass_reply():
    body = b'{"Pod":' + orjson.dumps(POD) + b',"Nodes":null,"NodeNames":["a"]}'
    args = extender.parse_filter(body)
    assert extender.filter_some(args, {}) == extender.filter_pass(args)


def test_preempt_without_drops_only_the_ghost_node():
    victims = {n: {"Pods": [{"UID": "v"}], "NumPDBViolations": 0} for n in ("a", "ghost")}
    args = extender.parse_preempt(orjson.dumps({"Pod": POD, "NodeNameToMetaVictims": victims}))
    assert orjson.loads(extender.preempt_without(args, {"ghost"})) == {"NodeNameToMetaVictims": {"a": victims["a"]}}


def test_suspects_are_the_undecided_names_the_replicas_disagree_on():
    k = two()
    assert k.suspects() == {}
    lost_delete(k, "n1")
    k.added("B", "late", 10.0)  # A lost its creation
    assert k.suspects() == {"late": ("B",), "n1": ("B",)}  # within the settle time
    reads = dict(k.due(12.5))
    assert k.suspects() == {"late": ("B",), "n1": ("B",)}  # being read
    assert k.landed("n1", reads["n1"], GONE, 13.0) == "ghost"
    assert k.landed("late", reads["late"], FAILED, 13.0) == "error"
    assert k.suspects() == {"late": ("B",)}  # the ghost is decided; the failed read is not
    assert k.suspects(limit=0) == {}
    [(name, changes)] = k.due(18.1)
    assert k.landed(name, changes, THERE, 18.2) == "real"
    assert k.suspects() == {}
