"""guard/core/rendering.py: audit, report and diagnose output, table-driven where it is a table."""

from __future__ import annotations

import json
import shlex
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.core.attribution import ReplicaObservation
from guard.core.names import hidden, pastable, shell_line, visible
from guard.core.records import AuditRecord, HealAttempt, ReplicaState
from guard.core.rendering import (
    build_report,
    format_time,
    heal_advice,
    new_ghost_line,
    parse_since,
    render_diagnosis,
    render_records,
    remediation_commands,
    render_report,
)

T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z
A, B, C = "https://127.0.0.1:6443", "https://127.0.0.2:6443", "https://127.0.0.3:6443"


def state(replica: str, serves: bool | None, *, at: float, rv: str | None = "100", error: str | None = None,
          serving: float | None = None, healed_at: float | None = None) -> ReplicaState:
    return ReplicaState(replica=replica, serves=serves, cache_resource_version=rv, error=error, last_checked=at,
                        first_seen_serving=serving, healed_at=healed_at)


WEB = AuditRecord(
    uid="11111111-aaaa", namespace="default", name="web-1", verdict="ghost-deleted",
    evidence={"quorum_get": {"http_status": 404}, "reason": "NotFound"}, first_seen=T0, last_seen=T0 + 65, times_blocked=7,
    replicas=(
        state(A, False, at=T0 + 1, rv="120"),
        state(B, True, at=T0 + 1, rv="100", serving=T0 + 1),
        state(C, None, at=T0 + 1, rv=None, error="HTTP 429: Too Many Requests"),
    ),
)
API = AuditRecord(
    uid="22222222-bbbb", namespace="prod", name="api-0", verdict="ghost-replaced",
    evidence={"quorum_get": {"http_status": 200, "uid": "33333333-cccc"}}, first_seen=T0 + 10, last_seen=T0 + 10, times_blocked=1,
    replicas=(
        state(B, None, at=T0 + 30, rv=None, error="timeout: after 0.5s", serving=T0 + 12),
        state(C, True, at=T0 + 30, rv="130", serving=T0 + 11),
    ),
)
OLD = AuditRecord(
    uid="44444444-dddd", namespace="prod", name="job-9", verdict="ghost-deleted",
    evidence={"quorum_get": {"http_status": 404}}, first_seen=T0 - 3600, last_seen=T0 - 3000, times_blocked=3,
    replicas=(state(A, False, at=T0 - 3000, rv="90", serving=T0 - 3600, healed_at=T0 - 3000),),
)


# -- small pieces ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(None, "-", id="none"),
        pytest.param(T0, "2026-05-28T20:26:40Z", id="utc-seconds"),
        pytest.param(T0 + 0.999, "2026-05-28T20:26:40Z", id="fraction-truncated"),
        pytest.param(0.0, "1970-01-01T00:00:00Z", id="epoch"),
    ],
)
def test_format_time(value: float | None, expected: str) -> None:
    assert format_time(value) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("90s", T0 - 90, id="seconds"),
        pytest.param("30m", T0 - 1800, id="minutes"),
        pytest.param("1h", T0 - 3600, id="hours"),
        pytest.param("2d", T0 - 2 * 86400, id="days"),
        pytest.param("1w", T0 - 7 * 86400, id="weeks"),
        pytest.param(" 1h ", T0 - 3600, id="padded"),
        pytest.param("0s", T0, id="zero"),
        pytest.param("2026-05-28T20:26:40Z", T0, id="iso-z"),
        pytest.param("2026-05-28T20:26:40", T0, id="iso-naive-is-utc"),
        pytest.param("2026-05-28T22:26:40+02:00", T0, id="iso-offset"),
        pytest.param("2026-05-28", T0 - (20 * 3600 + 26 * 60 + 40), id="iso-date"),
        pytest.param("999999999w", 0.0, id="before-epoch-clamped"),
    ],
)
def test_parse_since(text: str, expected: float) -> None:
    assert parse_since(text, now=T0) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("yesterday", "--since 'yesterday' is neither a duration (like 30m, 1h, 2d) nor an ISO-8601 time (like 2026-06-02T10:00:00Z)", id="word"),
        pytest.param("1y", "--since '1y' is neither a duration (like 30m, 1h, 2d) nor an ISO-8601 time (like 2026-06-02T10:00:00Z)", id="unknown-unit"),
        pytest.param("-1h", "--since '-1h' is neither a duration (like 30m, 1h, 2d) nor an ISO-8601 time (like 2026-06-02T10:00:00Z)", id="negative"),
        pytest.param("1.5h", "--since '1.5h' is neither a duration (like 30m, 1h, 2d) nor an ISO-8601 time (like 2026-06-02T10:00:00Z)", id="fraction"),
        pytest.param("", "--since must be a duration like 30m, 1h, 2d or an ISO-8601 time", id="empty"),
        pytest.param("'; DROP TABLE ghosts; --", "--since \"'; DROP TABLE ghosts; --\" is neither a duration (like 30m, 1h, 2d) nor an ISO-8601 time (like 2026-06-02T10:00:00Z)", id="sql"),
    ],
)
def test_parse_since_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_since(text, now=T0)
    assert str(e.value) == message


def test_new_ghost_line_is_one_json_object() -> None:
    line = new_ghost_line(AuditRecord(uid="u-1", namespace="default", name="web-1", verdict="ghost-deleted",
                                      evidence={"quorum_get": {"outcome": "not-found", "http_status": 404}},
                                      first_seen=T0, last_seen=T0 + 9, times_blocked=3))
    assert "\n" not in line
    assert json.loads(line) == {
        "event": "ghost-blocked", "namespace": "default", "name": "web-1", "uid": "u-1",
        "verdict": "ghost-deleted", "evidence": {"quorum_get": {"outcome": "not-found", "http_status": 404}},
        "first_seen": "2026-05-28T20:26:40Z",
    }


@pytest.mark.parametrize("render", [render_records, render_report], ids=["audit", "report"])
def test_unknown_output_is_refused(render) -> None:
    with pytest.raises(ValueError) as e:
        render([WEB], "yaml")
    assert str(e.value).startswith("output must be one of table, json")


# -- ghost-guard audit ---------------------------------------------------------------


def test_audit_table_columns_are_aligned() -> None:
    assert render_records([WEB, API], "table").splitlines() == [
        "LAST SEEN             NAMESPACE  NAME   VERDICT         BLOCKED  FIRST SEEN            STALE REPLICAS                                 UID",
        "2026-05-28T20:27:45Z  default    web-1  ghost-deleted   7        2026-05-28T20:26:40Z  https://127.0.0.2:6443                         11111111-aaaa",
        "2026-05-28T20:26:50Z  prod       api-0  ghost-replaced  1        2026-05-28T20:26:50Z  https://127.0.0.2:6443,https://127.0.0.3:6443  22222222-bbbb",
    ]


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        pytest.param("table", "no audit records match\n", id="table"),
        pytest.param("json", "[]\n", id="json"),
        pytest.param("jsonl", "", id="jsonl"),
    ],
)
def test_audit_empty(output: str, expected: str) -> None:
    assert render_records([], output) == expected


def test_audit_json_record_shape() -> None:
    (web,) = json.loads(render_records([WEB], "json"))
    assert web == {
        "namespace": "default",
        "name": "web-1",
        "uid": "11111111-aaaa",
        "verdict": "ghost-deleted",
        "evidence": {"quorum_get": {"http_status": 404}, "reason": "NotFound"},
        "first_seen": "2026-05-28T20:26:40Z",
        "last_seen": "2026-05-28T20:27:45Z",
        "times_blocked": 7,
        "retracted_at": None,
        "stale_replicas": [B],
        "heals": [],
        "replicas": [
            {"replica": A, "state": "consistent", "serves": False, "cache_resource_version": "120", "error": None,
             "last_checked": "2026-05-28T20:26:41Z", "first_seen_serving": None, "healed_at": None},
            {"replica": B, "state": "stale", "serves": True, "cache_resource_version": "100", "error": None,
             "last_checked": "2026-05-28T20:26:41Z", "first_seen_serving": "2026-05-28T20:26:41Z", "healed_at": None},
            {"replica": C, "state": "not-ready", "serves": None, "cache_resource_version": None,
             "error": "HTTP 429: Too Many Requests", "last_checked": "2026-05-28T20:26:41Z",
             "first_seen_serving": None, "healed_at": None},
        ],
    }


def test_audit_jsonl_is_one_record_per_line() -> None:
    lines = render_records([WEB, API, OLD], "jsonl").splitlines()
    assert [json.loads(line)["uid"] for line in lines] == ["11111111-aaaa", "22222222-bbbb", "44444444-dddd"]
    assert json.loads(lines[1])["stale_replicas"] == [B, C]  # B timed out: not seen healed, still stale


def test_table_cells_cannot_break_lines_or_inject_escapes() -> None:
    evil = AuditRecord(uid="u\x1b[31m", namespace="ns", name="a\nb", verdict="unknown", evidence={},
                       first_seen=T0, last_seen=T0, times_blocked=1, replicas=())
    out = render_records([evil], "table")
    assert "\x1b" not in out
    # escaped, so what the table shows is what the record holds (guard.core.names.visible)
    assert out.splitlines()[1] == ("2026-05-28T20:26:40Z  ns         a b   unknown  1        2026-05-28T20:26:40Z  -"
                                   "               u\\x1b[31m")


# -- ghost-guard report ----------------------------------------------------------------


def test_report_table_per_replica_then_remediation() -> None:
    assert render_report([WEB, API, OLD], "table").splitlines() == [
        f"Replica {B} serves 2 ghost pods since 2026-05-28T20:26:41Z",
        "  POD            UID            SERVING SINCE         LAST CHECKED          LAST PROBE   CACHE RV",
        "  default/web-1  11111111-aaaa  2026-05-28T20:26:41Z  2026-05-28T20:26:41Z  stale        100",
        "  prod/api-0     22222222-bbbb  2026-05-28T20:26:52Z  2026-05-28T20:27:10Z  unreachable  -",
        "",
        f"Replica {C} serves 1 ghost pod since 2026-05-28T20:26:51Z",
        "  POD         UID            SERVING SINCE         LAST CHECKED          LAST PROBE  CACHE RV",
        "  prod/api-0  22222222-bbbb  2026-05-28T20:26:51Z  2026-05-28T20:27:10Z  stale       130",
        "",
        "Healed replicas (served a ghost, no longer do):",
        "  REPLICA                 HEALED AT",
        f"  {A}  2026-05-28T19:36:40Z",
        "",
        "Blocked ghosts no replica is known to serve now:",
        "  POD         UID            VERDICT        LAST SEEN             HEALED REPLICAS",
        f"  prod/job-9  44444444-dddd  ghost-deleted  2026-05-28T19:36:40Z  {A}",
        "",
        "Newest cache probe of each replica:",
        "  REPLICA                 LAST PROBE   AT                    ERROR",
        f"  {A}  consistent   2026-05-28T20:26:41Z  -",
        f"  {B}  unreachable  2026-05-28T20:27:10Z  timeout: after 0.5s",
        f"  {C}  stale        2026-05-28T20:27:10Z  -",
        "",
        "Remediation, in order:",
        "  1. Heal without restarting anything: ghost-guard heal default/web-1 prod/api-0 (a placeholder created and deleted "
        "under a deleted ghost's name, or one annotation on the pod etcd has, replaces the stale copy in every watch cache "
        "that still follows etcd, and in kube-scheduler's informer with it; exit 0 when every replica agrees with etcd).",
        "  2. Confirm no cache serves the ghost any more: ghost-guard diagnose default/web-1; ghost-guard diagnose prod/api-0 (expect 'verdict: consistent').",
        f"  3. Only if heal reports a replica frozen (its cache revision no longer moves; among {B}, {C}): restart that "
        "apiserver replica alone (its watch cache is rebuilt from etcd), run ghost-guard heal again, and restart "
        "kube-scheduler only if it still tries to bind the ghost afterwards (kubernetes#123072).",
    ]


def test_report_json_shape() -> None:
    report = json.loads(render_report([WEB], "json"))
    assert report == {
        "stale_replicas": [
            {"replica": B, "since": "2026-05-28T20:26:41Z", "ghosts": [
                {"namespace": "default", "name": "web-1", "uid": "11111111-aaaa", "verdict": "ghost-deleted",
                 "serving_since": "2026-05-28T20:26:41Z", "last_checked": "2026-05-28T20:26:41Z",
                 "last_result": "stale", "cache_resource_version": "100"},
            ]},
        ],
        "healed_replicas": [],
        "unattributed_ghosts": [],
        "replica_probes": [
            {"replica": A, "last_probe": "consistent", "last_checked": "2026-05-28T20:26:41Z", "error": None},
            {"replica": B, "last_probe": "stale", "last_checked": "2026-05-28T20:26:41Z", "error": None},
            {"replica": C, "last_probe": "not-ready", "last_checked": "2026-05-28T20:26:41Z",
             "error": "HTTP 429: Too Many Requests"},
        ],
        "remediation": [
            "Heal without restarting anything: ghost-guard heal default/web-1 (a placeholder created and deleted under a "
            "deleted ghost's name, or one annotation on the pod etcd has, replaces the stale copy in every watch cache that "
            "still follows etcd, and in kube-scheduler's informer with it; exit 0 when every replica agrees with etcd).",
            "Confirm no cache serves the ghost any more: ghost-guard diagnose default/web-1 (expect 'verdict: consistent').",
            f"Only if heal reports a replica frozen (its cache revision no longer moves; among {B}): restart that apiserver "
            "replica alone (its watch cache is rebuilt from etcd), run ghost-guard heal again, and restart kube-scheduler "
            "only if it still tries to bind the ghost afterwards (kubernetes#123072).",
        ],
    }


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        pytest.param([], ["No apiserver replica is known to serve a ghost.", "Nothing to do."], id="empty-store"),
        pytest.param([OLD], [
            "No apiserver replica is known to serve a ghost.",
            "Healed replicas (served a ghost, no longer do):",
            "  REPLICA                 HEALED AT",
            f"  {A}  2026-05-28T19:36:40Z",
            "",
            "Blocked ghosts no replica is known to serve now:",
            "  POD         UID            VERDICT        LAST SEEN             HEALED REPLICAS",
            f"  prod/job-9  44444444-dddd  ghost-deleted  2026-05-28T19:36:40Z  {A}",
            "",
            "Newest cache probe of each replica:",
            "  REPLICA                 LAST PROBE  AT                    ERROR",
            f"  {A}  consistent  2026-05-28T19:36:40Z  -",
            "",
            "Remediation, in order:",
            "  1. No replica is known to serve these ghosts now. Check: ghost-guard diagnose prod/job-9. If a replica serves "
            "one, heal it: ghost-guard heal prod/job-9 (restart a replica only if heal reports it frozen).",
            "  2. If the scheduler still tries to bind them, ghost-guard heal makes its informer drop them too; restart "
            "kube-scheduler only if it still does afterwards (kubernetes#123072).",
        ], id="all-healed"),
    ],
)
def test_report_without_stale_replicas(records: list[AuditRecord], expected: list[str]) -> None:
    assert render_report(records, "table").splitlines() == expected


def test_report_refuses_jsonl() -> None:
    with pytest.raises(ValueError) as e:
        render_report([], "jsonl")
    assert str(e.value) == "output must be one of table, json; not 'jsonl'"


# -- ghost-guard diagnose ------------------------------------------------------------------


def probe(replica: str, serves: bool | None, rv: str | None = None, error: str | None = None) -> ReplicaObservation:
    return ReplicaObservation(replica=replica, serves_ghost=serves, cache_resource_version=rv, error=error, checked_at=T0)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        pytest.param(
            {"quorum_status": 404, "quorum_detail": "NotFound",
             "observations": [probe(A, False, "120"), probe(B, False, "120"), probe(C, False, "121")]},
            [
                "Pod default/web-1",
                "SOURCE       SERVED-BY                  RESULT",
                "quorum GET   etcd (no resourceVersion)  404 NotFound",
                f"watch cache  {A}     does not serve it (list resourceVersion 120)",
                f"watch cache  {B}     does not serve it (list resourceVersion 120)",
                f"watch cache  {C}     does not serve it (list resourceVersion 121)",
                "verdict: consistent",
            ],
            id="consistent",
        ),
        pytest.param(
            {"quorum_status": 404, "quorum_detail": "NotFound", "etcd_detail": "absent",
             "observations": [probe(C, True, "100"), probe(A, False, "120"), probe(B, True, "99")]},
            [
                "Pod default/web-1",
                "SOURCE       SERVED-BY                     RESULT",
                "quorum GET   etcd (no resourceVersion)     404 NotFound",
                "etcd         /registry/pods/default/web-1  absent",
                f"watch cache  {A}        does not serve it (list resourceVersion 120)",
                f"watch cache  {B}        serves the ghost (list resourceVersion 99)",
                f"watch cache  {C}        serves the ghost (list resourceVersion 100)",
                f"verdict: stale replicas {B}, {C}",
                "next: ghost-guard heal default/web-1 (no restart; restart a replica only if heal reports it frozen)",
            ],
            id="two-stale-with-etcd",
        ),
        pytest.param(
            {"quorum_status": None, "quorum_detail": "timeout after 1.0s",
             "observations": [probe(A, None, error="HTTP 429: Too Many Requests"), probe(B, None, error="timeout: after 0.5s"),
                              probe(C, None, error="HTTP 500")]},
            [
                "Pod default/web-1",
                "SOURCE       SERVED-BY                  RESULT",
                "quorum GET   etcd (no resourceVersion)  no answer: timeout after 1.0s",
                f"watch cache  {A}     cache not ready: HTTP 429: Too Many Requests",
                f"watch cache  {B}     unreachable: timeout: after 0.5s",
                f"watch cache  {C}     error: HTTP 500",
                "verdict: consistent",
                f"unchecked: {A} (not-ready), {B} (unreachable), {C} (error)",
            ],
            id="nothing-answered",
        ),
        pytest.param(
            {"quorum_status": 404, "quorum_detail": "NotFound",
             "observations": [probe(A, None, error="\x1b[2J evil\nsecond line")]},
            [
                "Pod default/web-1",
                "SOURCE       SERVED-BY                  RESULT",
                "quorum GET   etcd (no resourceVersion)  404 NotFound",
                f"watch cache  {A}     error: \\x1b[2J evil second line",
                "verdict: consistent",
                f"unchecked: {A} (error)",
            ],
            id="garbage-error-flattened",
        ),
    ],
)
def test_render_diagnosis_table(kwargs: dict, expected: list[str]) -> None:
    assert render_diagnosis(namespace="default", name="web-1", **kwargs).splitlines() == expected


def test_render_diagnosis_json() -> None:
    out = json.loads(render_diagnosis(
        namespace="default", name="web-1", quorum_status=404, quorum_detail="NotFound", etcd_detail=None,
        observations=[probe(A, False, "120"), probe(B, True, "99"), probe(C, None, error="HTTP 429")], output="json"))
    assert out == {
        "pod": "default/web-1",
        "rows": [
            {"source": "quorum GET", "served_by": "etcd (no resourceVersion)", "result": "404 NotFound"},
            {"source": "watch cache", "served_by": A, "result": "does not serve it (list resourceVersion 120)"},
            {"source": "watch cache", "served_by": B, "result": "serves the ghost (list resourceVersion 99)"},
            {"source": "watch cache", "served_by": C, "result": "cache not ready: HTTP 429"},
        ],
        "verdict": f"stale replicas {B}",
        "stale_replicas": [B],
        "unchecked": [{"replica": C, "state": "not-ready"}],
        "next": "ghost-guard heal default/web-1 (no restart; restart a replica only if heal reports it frozen)",
    }


# --- report --live: the replica-cache section ------------------------------------------------------------

def _cache(replica, **kw):
    base = {"replica": replica, "cache_revision": 120, "etcd_revision": 120, "seconds_behind": 0.0, "frozen": False,
            "answered": True, "pending_listed": True, "missing": []}
    return {**base, **kw}


def test_replica_caches_section_names_missing_pods_and_frozen_replicas_with_the_steps():
    from guard.core.rendering import render_replica_caches

    caches = [_cache("10.0.0.1:6443"),
              _cache("10.0.0.2:6443", missing=[{"namespace": "default", "name": "lost", "uid": "u1",
                                                 "resource_version": "110", "cache_resource_version": 120}]),
              _cache("10.0.0.3:6443", cache_revision=90, seconds_behind=5.0, frozen=True)]
    out = render_replica_caches(caches, window=5.0)
    assert out.splitlines()[0] == "Replica caches, checked now (revisions read 5s apart):"
    assert "  10.0.0.2:6443  default/lost  u1   110     120" in out
    assert out.splitlines()[-2:] == [
        "  1. `ghost-guard heal default/lost`: one write to each pod reaches every cache whose watch flows",
        "  2. restart kube-apiserver 10.0.0.3:6443: its watch is frozen (writes cannot heal it), then kube-scheduler "
        "if it read from that replica"]


@pytest.mark.parametrize("caches, last", [
    pytest.param([_cache("a"), _cache("b")], "Every replica's cache keeps up with etcd and misses no pending pod.",
                 id="all-well"),
    pytest.param([_cache("a"), _cache("b", answered=False, cache_revision=None)],
                 "No replica cache problem found among the replicas that answered.", id="one-did-not-answer"),
])
def test_replica_caches_section_when_nothing_is_wrong(caches, last):
    from guard.core.rendering import render_replica_caches

    assert render_replica_caches(caches).splitlines()[-1] == last


def test_replica_caches_section_json_is_the_list():
    import json

    from guard.core.rendering import render_replica_caches

    assert json.loads(render_replica_caches([_cache("a")], "json")) == [_cache("a")]
# -- heal attempts (serve --heal) ---------------------------------------------------------


def test_audit_and_report_show_heal_attempts_newest_first() -> None:
    import dataclasses

    healed = dataclasses.replace(WEB, heals=(HealAttempt(T0 + 5, "placeholder", "frozen", "replica B frozen"),
                                             HealAttempt(T0 + 65, "placeholder", "healed", "every replica agrees")))
    table = render_records([healed], "table").splitlines()
    assert table[-4:] == [
        "Heal attempts (ghost-guard serve --heal), newest first:",
        "  POD            UID            AT                    ACTION       OUTCOME  DETAIL",
        "  default/web-1  11111111-aaaa  2026-05-28T20:27:45Z  placeholder  healed   every replica agrees",
        "  default/web-1  11111111-aaaa  2026-05-28T20:26:45Z  placeholder  frozen   replica B frozen",
    ]
    assert json.loads(render_records([healed], "json"))[0]["heals"] == [
        {"at": "2026-05-28T20:26:45Z", "action": "placeholder", "outcome": "frozen", "detail": "replica B frozen"},
        {"at": "2026-05-28T20:27:45Z", "action": "placeholder", "outcome": "healed", "detail": "every replica agrees"}]
    assert "Heal attempts (ghost-guard serve --heal), newest first:" in render_report([healed], "table")
    assert "Heal attempts" not in render_records([WEB], "table") + render_report([WEB], "table")


# -- what operators paste (issue 25, hole 7) -----------------------------------------------------

_label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?", fullmatch=True)
api_names = st.lists(_label, min_size=1, max_size=3).map(".".join)  # every name the API allows is such a subdomain
hostile = st.sampled_from(["x$(touch${IFS}/tmp/PWNED)", "`id`", "a;rm -rf ~", "'", '"', "a b", "-rf", "$HOME", "*",
                           "a\u202eb", "\u2066x\u2069", "a\u200eb", "\u061c", "a\nb", "a\x1b[31m", "a\x00", "\\", "#",
                           "a\u2028b", "\ufeff"])
any_names = api_names | hostile | st.text(min_size=1, max_size=20)


def _no_hidden(text: str) -> bool:
    return all(c == "\n" or not hidden(c) for c in text)


@settings(max_examples=300, deadline=None, database=None)
@given(namespace=any_names, name=any_names)
def test_remediation_lines_are_safe_to_paste(namespace: str, name: str) -> None:
    """Every command in ``report`` and ``diagnose`` output shlex.splits back to exactly the intended argv
    (nothing else runs when it is pasted) and no output holds a bidirectional or control character; a
    name that cannot be pasted safely is left out of the commands and shown escaped."""
    pod = f"{namespace}/{name}"
    for rec in (replace(WEB, namespace=namespace, name=name), replace(OLD, namespace=namespace, name=name)):
        report = build_report([rec])
        steps = report["remediation"]
        assert steps and all(_no_hidden(s) for s in steps), steps
        assert _no_hidden(render_report([rec], "table"))
        commands = remediation_commands(report["stale_replicas"], report["unattributed_ghosts"])
        if pastable(pod):
            assert ["ghost-guard", "heal", pod] in commands and ["ghost-guard", "diagnose", pod] in commands
        else:
            assert all(pod not in argv for argv in commands)
            assert any(visible(pod) in s for s in steps), steps
        for argv in commands:
            line = shell_line(argv)
            assert shlex.split(line) == argv
            assert any(line in s for s in steps), (line, steps)
    advice = heal_advice(namespace, name)
    assert _no_hidden(advice)
    if pastable(pod):
        assert advice.startswith(shell_line(["ghost-guard", "heal", pod]) + " (")
        assert shlex.split(advice.split(" (", 1)[0] if "'" not in advice else advice[:len(shell_line(
            ["ghost-guard", "heal", pod]))]) == ["ghost-guard", "heal", pod]
    obs = [ReplicaObservation(B, True, "100", None, T0)]
    out = render_diagnosis(namespace=namespace, name=name, quorum_status=404, quorum_detail="NotFound",
                           observations=obs)
    assert _no_hidden(out)


def test_a_name_built_to_run_code_is_quoted() -> None:
    rec = replace(WEB, name="x$(touch${IFS}/tmp/PWNED)")
    steps = build_report([rec])["remediation"]
    assert "ghost-guard heal 'default/x$(touch${IFS}/tmp/PWNED)' (" in steps[0]
    assert "ghost-guard diagnose 'default/x$(touch${IFS}/tmp/PWNED)' (" in steps[1]
    bidi = replace(WEB, name="a\u202eb")
    steps = build_report([bidi])["remediation"]
    assert "\u202e" not in "".join(steps) and "default/a\\u202eb" in steps[0]
