"""Table tests for guard.core.verdict: decide (every verdict, word for word), and the two meanings of
"is this copy stale?": etcd's copy makes an identity a ghost (verdict_for, pending_in_etcd), a
replica's cached copy still shows a ghost as pending (is_pending, shows_pending, serves_ghost)."""

import itertools

import pytest

from guard.core.verdict import (
    GHOST_VERDICTS,
    PodRef,
    QuorumRead,
    Verdict,
    decide,
    is_pending,
    pending_in_etcd,
    serves_ghost,
    shows_pending,
    verdict_for,
)

POD = PodRef("default", "web-1", "uid-1")

CASES = [
    pytest.param(POD, QuorumRead.found("uid-1", resource_version="42"), Verdict.ALIVE,
                 "pod default/web-1 uid uid-1 confirmed pending by quorum read", id="alive"),
    pytest.param(POD, QuorumRead.not_found(), Verdict.GHOST_DELETED,
                 "ghost pod: default/web-1 uid uid-1 not found by quorum read (etcd); scheduler cache is stale",
                 id="ghost-deleted"),
    pytest.param(POD, QuorumRead.found("uid-2"), Verdict.GHOST_REPLACED,
                 "ghost pod: default/web-1 uid uid-1 was replaced by uid uid-2 (quorum read, etcd); "
                 "scheduler cache is stale", id="ghost-replaced"),
    pytest.param(POD, QuorumRead.found("uid-1", node_name="node-3"), Verdict.ALREADY_BOUND,
                 "ghost pod: default/web-1 uid uid-1 is already bound to node node-3 (quorum read, etcd); "
                 "scheduler cache is stale", id="already-bound"),
    pytest.param(POD, QuorumRead.found("uid-1", deletion_timestamp="2026-11-29T10:00:00Z"), Verdict.TERMINATING,
                 "ghost pod: default/web-1 uid uid-1 is terminating since 2026-11-29T10:00:00Z (quorum read, etcd); "
                 "scheduler cache is stale", id="terminating"),
    pytest.param(POD, QuorumRead.failed("timeout after 1s"), Verdict.UNKNOWN,
                 "quorum read of pod default/web-1 uid uid-1 failed: timeout after 1s", id="unknown-timeout"),
    pytest.param(POD, QuorumRead.failed("HTTP 429 TooManyRequests", 429), Verdict.UNKNOWN,
                 "quorum read of pod default/web-1 uid uid-1 failed: HTTP 429 TooManyRequests", id="unknown-429"),
    # replaced AND bound: the replacement is what matters (the scheduler's UID is gone)
    pytest.param(POD, QuorumRead.found("uid-2", node_name="n"), Verdict.GHOST_REPLACED, None, id="replaced-wins"),
    # no UID from the scheduler: cannot tell a replacement, still sees binding
    pytest.param(PodRef("ns", "p"), QuorumRead.found("uid-9"), Verdict.ALIVE, None, id="no-uid-alive"),
    pytest.param(PodRef("ns", "p"), QuorumRead.found("uid-9", node_name="n1"), Verdict.ALREADY_BOUND, None,
                 id="no-uid-bound"),
]


@pytest.mark.parametrize("pod,read,verdict,reason", CASES)
def test_decide(pod, read, verdict, reason):
    decision = decide(pod, read)
    assert decision.verdict is verdict
    if reason is not None:
        assert decision.reason == reason


def test_ghost_verdicts_are_exactly_the_four_permanent_ones():
    assert {v.value for v in GHOST_VERDICTS} == {"ghost-deleted", "ghost-replaced", "already-bound", "terminating"}
    assert not Verdict.ALIVE.is_ghost and not Verdict.UNKNOWN.is_ghost


# --- 1. etcd's copy --------------------------------------------------------------------------------

@pytest.mark.parametrize("pod,read,verdict,reason", CASES)
def test_verdict_for_is_decides_rule(pod, read, verdict, reason):
    assert verdict_for(pod.uid, read) is verdict


@pytest.mark.parametrize("read,uid,expected", [
    pytest.param(QuorumRead.found("u1"), "u1", True, id="found-same-uid-pending"),
    pytest.param(QuorumRead.found("u2"), "u1", False, id="replaced"),
    pytest.param(QuorumRead.not_found(), "u1", False, id="deleted"),
    pytest.param(QuorumRead.found("u1", node_name="n1"), "u1", False, id="bound"),
    pytest.param(QuorumRead.found("u1", deletion_timestamp="2026-11-29T10:00:00Z"), "u1", False, id="terminating"),
    pytest.param(QuorumRead.failed("timeout after 1s"), "u1", False, id="failed-read-says-nothing"),
    pytest.param(QuorumRead.found("u1"), "", False, id="no-uid-no-identity"),
    pytest.param(QuorumRead.found(""), "u1", False, id="read-without-uid-is-not-that-identity"),
])
def test_pending_in_etcd(read, uid, expected):
    assert pending_in_etcd(read, uid) is expected


# --- 2. a replica's cached copies ------------------------------------------------------------------

def _item(uid: str, node: str = "", deleting: bool = False) -> dict:
    meta = {"name": "web-1", "namespace": "default", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T10:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}}


@pytest.mark.parametrize("obj,expected", [
    pytest.param(_item("u1"), True, id="unbound"),
    pytest.param(_item("u1", node="n1"), False, id="bound"),
    pytest.param(_item("u1", deleting=True), False, id="terminating"),
    pytest.param({}, True, id="empty-object-has-nothing-that-excludes-it"),
    pytest.param({"metadata": None, "spec": None}, True, id="null-fields"),
])
def test_is_pending(obj, expected):
    assert is_pending(obj) is expected


@pytest.mark.parametrize("items,uid,expected", [
    pytest.param([_item("u1")], "u1", True, id="deleted-or-bound-ghost-still-listed-pending"),
    pytest.param([], "u1", False, id="not-listed"),
    pytest.param([_item("u2")], "u1", False, id="only-the-replacement-listed"),
    pytest.param([_item("u1"), _item("u2")], "u1", True, id="old-uid-listed-beside-the-replacement"),
    pytest.param([_item("u1", node="n1")], "u1", False, id="listed-bound-is-consistent"),
    pytest.param([_item("u1", deleting=True)], "u1", False, id="listed-terminating-is-consistent"),
    pytest.param([_item("u9")], "", True, id="no-uid-any-pending-copy"),
])
def test_shows_pending(items, uid, expected):
    assert shows_pending(items, uid) is expected


TERMINATING = "2026-11-29T10:00:00Z"


@pytest.mark.parametrize("items,read,uid,expected", [
    # etcd deleted the pod
    pytest.param([_item("u1")], QuorumRead.not_found(), "", True, id="deleted-still-listed-pending"),
    pytest.param([_item("u1", node="n1")], QuorumRead.not_found(), "", False, id="deleted-listed-bound-schedules-nothing"),
    pytest.param([_item("u1", deleting=True)], QuorumRead.not_found(), "", False, id="deleted-listed-terminating"),
    pytest.param([], QuorumRead.not_found(), "", False, id="deleted-not-listed"),
    # etcd has a replacement under the name
    pytest.param([_item("u1")], QuorumRead.found("u2"), "", True, id="replaced-old-uid-listed"),
    pytest.param([_item("u2")], QuorumRead.found("u2"), "", False, id="replaced-new-uid-listed-is-the-truth"),
    pytest.param([_item("u1"), _item("u2")], QuorumRead.found("u2"), "", True, id="replaced-both-listed"),
    pytest.param([_item("u1"), _item("u2")], QuorumRead.found("u2"), "u2", False, id="asked-for-the-live-uid-only"),
    pytest.param([_item("u1"), _item("u2")], QuorumRead.found("u2"), "u1", True, id="asked-for-the-ghost-uid"),
    # etcd has the same identity bound or terminating
    pytest.param([_item("u1")], QuorumRead.found("u1", node_name="n1"), "", True, id="bound-listed-unbound"),
    pytest.param([_item("u1", node="n1")], QuorumRead.found("u1", node_name="n1"), "", False, id="bound-listed-bound"),
    pytest.param([_item("u1")], QuorumRead.found("u1", deletion_timestamp=TERMINATING), "", True,
                 id="terminating-listed-not-terminating"),
    # etcd has it pending: a cache that lists it pending serves the truth
    pytest.param([_item("u1")], QuorumRead.found("u1"), "u1", False, id="alive-listed-pending"),
    pytest.param([], QuorumRead.found("u1"), "", False, id="alive-missing-is-not-a-ghost"),
    # etcd could not answer: no claim
    pytest.param([_item("u1")], QuorumRead.failed("timeout after 1s"), "", False, id="failed-read"),
])
def test_serves_ghost(items, read, uid, expected):
    assert serves_ghost(items, read, uid) is expected


READS = {
    "deleted": QuorumRead.not_found(),
    "replaced": QuorumRead.found("u2"),
    "alive": QuorumRead.found("u1"),
    "bound": QuorumRead.found("u1", node_name="n1"),
    "terminating": QuorumRead.found("u1", deletion_timestamp=TERMINATING),
}
COPIES = {
    "none": [],
    "pending": [_item("u1")],
    "bound": [_item("u1", node="n1")],
    "terminating": [_item("u1", deleting=True)],
    "other-uid": [_item("u2")],
    "both": [_item("u1"), _item("u2")],
}


@pytest.mark.parametrize("read_name,copies_name", list(itertools.product(READS, COPIES)))
def test_the_incident_recorders_two_halves_are_serves_ghost(read_name, copies_name):
    """The running guard asks etcd first (pending_in_etcd), then each cache (shows_pending): for a
    read that answered, that is serves_ghost for the ghost's UID, so `diagnose` and the incident
    recorder name the same replicas."""
    read, items = READS[read_name], COPIES[copies_name]
    assert (not pending_in_etcd(read, "u1") and shows_pending(items, "u1")) is serves_ghost(items, read, "u1")


def test_a_heal_placeholder_is_never_a_replacement():
    """issue 26, finding 1: the quorum read finds ghost-guard's own heal placeholder under the ghost's name
    (heal keeps it while it waits on a frozen replica): the ghost is deleted, and the placeholder's UID is
    never named as its replacement."""
    from guard.core.heal_plan import is_placeholder, placeholder_pod
    from guard.core.records import block_evidence

    meta = placeholder_pod("web-5", ["uid-ghost"], at="2026-01-01T00:00:00Z")["metadata"]
    assert is_placeholder(meta) and not is_placeholder({"labels": {"app": "web"}}) and not is_placeholder(None)
    read = QuorumRead.found("uid-holder", resource_version="9", placeholder=True)
    assert verdict_for("uid-ghost", read) is Verdict.GHOST_DELETED
    decision = decide(PodRef("default", "web-5", "uid-ghost"), read)
    assert decision.is_ghost and "placeholder" in decision.reason and "uid-holder" not in decision.reason
    assert "replaced" not in decision.reason
    assert block_evidence(decision, read)["quorum_get"]["heal_placeholder"] is True
    # a real pod under the name is still a replacement, and the placeholder itself is what etcd has
    assert verdict_for("uid-ghost", QuorumRead.found("uid-other")) is Verdict.GHOST_REPLACED
    assert "heal_placeholder" not in block_evidence(decision, QuorumRead.found("uid-other"))["quorum_get"]
