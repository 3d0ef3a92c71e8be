"""guard/core/records.py: the evidence a block records, the checks every audit field passes in both stores, and what a
record derives."""

from __future__ import annotations

import pytest

from guard.core.records import (
    MAX_EVIDENCE_BYTES,
    AuditError,
    AuditRecord,
    IdentityConflictError,
    ReplicaState,
    UnknownGhostError,
    block_evidence,
    check_text,
    check_time,
    evidence_json,
)
from guard.core.verdict import PodRef, QuorumRead, decide


@pytest.mark.parametrize(("value", "error"), [
    pytest.param("web-1", None, id="ok"),
    pytest.param("x" * 10, None, id="at-the-limit"),
    pytest.param("x" * 11, "name must be 1 to 10 characters, got 11", id="too-long"),
    pytest.param("", "name must be 1 to 10 characters, got 0", id="empty"),
    pytest.param(7, "name must be a string, not int", id="not-a-string"),
    pytest.param(None, "name must be a string, not NoneType", id="none"),
    pytest.param("a\nb", "name must not contain control characters", id="newline"),
    pytest.param("a\x7fb", "name must not contain control characters", id="delete"),
    pytest.param("a\x1b[31m", "name must not contain control characters", id="escape"),
])
def test_check_text(value: object, error: str | None) -> None:
    if error is None:
        check_text("name", value, 10)
        return
    with pytest.raises(ValueError) as e:
        check_text("name", value, 10)
    assert str(e.value) == error


@pytest.mark.parametrize(("value", "expected"), [
    pytest.param(0, 0.0, id="epoch"),
    pytest.param(1_780_000_000, 1_780_000_000.0, id="int"),
    pytest.param(1.5, 1.5, id="float"),
    pytest.param(-1.0, None, id="negative"),
    pytest.param(float("nan"), None, id="nan"),
    pytest.param(float("inf"), None, id="inf"),
    pytest.param(True, None, id="bool"),
    pytest.param("1", None, id="string"),
])
def test_check_time(value: object, expected: float | None) -> None:
    if expected is not None:
        assert check_time("at", value) == expected
        return
    with pytest.raises(ValueError) as e:
        check_time("at", value)
    assert str(e.value) == f"at must be a finite, non-negative number of seconds since the epoch, not {value!r}"


def test_evidence_json_is_compact_sorted_and_bounded() -> None:
    evidence = {"reason": "gone", "quorum_get": {"outcome": "not-found", "http_status": 404}}
    assert evidence_json(evidence) == '{"quorum_get":{"http_status":404,"outcome":"not-found"},"reason":"gone"}'
    big = {"big": "x" * MAX_EVIDENCE_BYTES}
    assert evidence_json(big, strict=False) is None
    with pytest.raises(ValueError, match=r"^evidence must be at most 4096 bytes of JSON, got 4106$"):
        evidence_json(big)


@pytest.mark.parametrize(("evidence", "error"), [
    pytest.param(["a"], "evidence must be a JSON object, not list", id="list"),
    pytest.param({"t": float("nan")}, "evidence must be JSON-serialisable: Out of range float values are not JSON "
                                      "compliant", id="nan"),
    pytest.param({"o": object()}, "evidence must be JSON-serialisable: Object of type object is not JSON serializable",
                 id="object"),
])
def test_evidence_json_refuses(evidence: object, error: str) -> None:
    with pytest.raises(ValueError) as e:
        evidence_json(evidence, strict=False)  # not a size problem: refused even when not strict
    assert str(e.value) == error


def state(replica: str, *, serving: float | None, healed: float | None) -> ReplicaState:
    return ReplicaState(replica, serves=None, cache_resource_version=None, error="timeout", last_checked=9.0,
                        first_seen_serving=serving, healed_at=healed)


def test_a_replica_is_stale_from_serving_until_healed_and_a_failed_probe_changes_neither() -> None:
    record = AuditRecord(uid="u", namespace="ns", name="web-1", verdict="ghost-deleted", evidence={}, first_seen=1.0,
                         last_seen=2.0, times_blocked=1, replicas=(
                             state("c", serving=3.0, healed=None), state("a", serving=None, healed=None),
                             state("b", serving=3.0, healed=5.0), state("d", serving=4.0, healed=None)))
    assert record.stale_replicas == ["c", "d"]
    assert [r.observation().serves_ghost for r in record.replicas] == [None] * 4  # the newest probe failed


def test_the_store_errors_are_audit_errors() -> None:
    assert issubclass(UnknownGhostError, AuditError) and issubclass(UnknownGhostError, LookupError)
    assert issubclass(IdentityConflictError, AuditError)


GHOST = PodRef("default", "web-1", "uid-a")
NONE = {"uid": None, "node_name": None, "deletion_timestamp": None, "resource_version": None}


@pytest.mark.parametrize(("read", "quorum_get"), [
    pytest.param(QuorumRead.not_found(), {"outcome": "not-found", "http_status": 404, **NONE}, id="deleted"),
    pytest.param(QuorumRead.found("uid-b", resource_version="77"),
                 {"outcome": "found", "http_status": 200, **NONE, "uid": "uid-b", "resource_version": "77"},
                 id="replaced"),
    pytest.param(QuorumRead.found("uid-a", node_name="node-a", resource_version="78"),
                 {"outcome": "found", "http_status": 200, **NONE, "uid": "uid-a", "node_name": "node-a",
                  "resource_version": "78"}, id="already-bound"),
    pytest.param(QuorumRead.found("uid-a", deletion_timestamp="2026-12-01T00:00:00Z", resource_version="79"),
                 {"outcome": "found", "http_status": 200, **NONE, "uid": "uid-a",
                  "deletion_timestamp": "2026-12-01T00:00:00Z", "resource_version": "79"}, id="terminating"),
    pytest.param(QuorumRead.failed("HTTP 429 TooManyRequests", 429),
                 {"outcome": "error", "http_status": 429, **NONE}, id="unknown"),
])
def test_block_evidence_keeps_the_reason_and_what_the_quorum_get_answered(read: QuorumRead, quorum_get: dict) -> None:
    decision = decide(GHOST, read)
    evidence = block_evidence(decision, read)
    assert evidence == {"reason": decision.reason, "quorum_get": quorum_get}
    assert evidence_json(evidence) is not None  # storable as it is
    # a later sighting carries the reason only (the store keeps the first read's quorum_get)
    assert block_evidence(decision, None) == {"reason": decision.reason}
