"""The pure parts of the GhostPod store (guard/audit/ghostpods.py): object names, the operations applied to a
status (the same rules as the SQLite store), the merge patch, and the record read back."""

from __future__ import annotations

import re

import pytest

from guard.audit.ghostpods import apply_ops, from_time, object_name, record_status, status_patch, to_record, to_time
from guard.core.records import AuditRecord, ReplicaState

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@pytest.mark.parametrize("name", ["web-0", "a" * 253, "Web_0", "x.y.z", "-.-", "..a..", "ä", "a.-b", "0"],
                         ids=["plain", "longest", "upper-underscore", "dots", "only-punctuation", "empty-labels",
                              "non-ascii", "dot-dash", "digit"])
def test_object_name_is_a_dns_subdomain_and_depends_on_the_whole_identity(name):
    n = object_name("ns", name, "uid-1")
    assert DNS_SUBDOMAIN.match(n) and len(n) <= 63, n
    assert n == object_name("ns", name, "uid-1")  # every replica computes the same
    assert len({n, object_name("ns", name, "uid-2"), object_name("other", name, "uid-1"),
                object_name("ns", name + "x", "uid-1")}) == 4


def test_times_round_trip_to_the_microsecond():
    assert to_time(1796121829.942619) == "2026-12-01T10:43:49.942619Z"
    assert from_time(to_time(1796121829.942619)) == pytest.approx(1796121829.942619, abs=1e-6)
    assert from_time("2026-12-01T10:43:49Z") == 1796121829.0
    assert from_time("garbage") is None and from_time(None) is None


def block(first, last=None, count=1):
    return {"op": "block", "count": count, "first": first, "last": first if last is None else last}


def probe(replica, serves, at, rv="1"):
    return {"op": "probe", "replica": replica, "serves": serves, "rv": rv, "error": None, "at": at}


@pytest.mark.parametrize("ops,expect", [
    pytest.param([block(10), block(5), block(20, count=3)], {"timesBlocked": 5, "firstSeen": to_time(5),
                                                             "lastSeen": to_time(20), "staleReplicas": ""}, id="blocks-accumulate"),
    pytest.param([block(1), probe("r1", True, 2)], {"staleReplicas": "r1"}, id="serving-is-stale"),
    pytest.param([block(1), probe("r1", True, 2), probe("r1", False, 3)], {"staleReplicas": ""}, id="healed"),
    pytest.param([block(1), probe("r1", True, 3), probe("r1", False, 2)], {"staleReplicas": "r1"}, id="older-probe-ignored"),
    pytest.param([block(1), probe("r1", True, 2), probe("r1", None, 3)], {"staleReplicas": "r1"}, id="failed-probe-changes-nothing"),
    pytest.param([block(1), probe("r1", True, 2), {"op": "retract", "at": 3}],
                 {"staleReplicas": "", "replicas": [], "retractedAt": to_time(3)}, id="retract-forgets-probes"),
    pytest.param([block(1), {"op": "retract", "at": 3}, probe("r1", True, 4)],
                 {"staleReplicas": "", "replicas": [], "retractedAt": to_time(3)}, id="probe-after-retract-ignored"),
    pytest.param([block(1), {"op": "retract", "at": 3}, block(5), probe("r1", True, 6)],
                 {"staleReplicas": "r1", "timesBlocked": 2}, id="a-new-block-clears-the-retraction"),
])
def test_apply_ops(ops, expect):
    out = apply_ops({}, ops)
    for key, value in expect.items():
        assert out.get(key) == value, (key, out)
    if "retractedAt" not in expect:
        assert "retractedAt" not in out


def test_heals_are_kept_once_and_bounded():
    heal = lambda at: {"op": "heal", "action": "restart", "outcome": "ok", "detail": "d", "at": at}  # noqa: E731
    out = apply_ops({}, [heal(i) for i in range(30)] + [heal(29)])
    assert [from_time(h["at"]) for h in out["heals"]] == [float(i) for i in range(10, 30)]


def test_status_patch_deletes_what_is_gone_and_pins_the_version():
    assert status_patch({"retractedAt": "x", "timesBlocked": 1}, {"timesBlocked": 2}, "7") == {
        "metadata": {"resourceVersion": "7"}, "status": {"timesBlocked": 2, "retractedAt": None}}


def test_a_record_round_trips_through_the_object():
    rec = AuditRecord(uid="u", namespace="ns", name="web-0", verdict="ghost-deleted", evidence={"reason": "r"},
                      first_seen=100.5, last_seen=200.25, times_blocked=4,
                      replicas=(ReplicaState("r1", True, "5", None, 150.0, 150.0, None),
                                ReplicaState("r2", False, "9", None, 160.0, 120.0, 160.0)), retracted_at=None)
    obj = {"metadata": {"namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"podName": "web-0", "podUID": "u", "verdict": "ghost-deleted", "evidence": {"reason": "r"}},
           "status": record_status(rec)}
    assert to_record(obj) == rec
    assert obj["status"]["staleReplicas"] == "r1"
    assert to_record({"metadata": {}, "spec": {}}) is None  # not one of ours
