"""Table tests for guard.verdict.decide: every verdict, word for word."""

import pytest

from guard.verdict import GHOST_VERDICTS, PodRef, QuorumRead, Verdict, decide

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
