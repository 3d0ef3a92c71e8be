"""guard.core.heal_plan: what a heal writes and when it worked, from etcd's answer and each replica's cache."""

from __future__ import annotations

import json

import pytest

from guard.core import heal_plan
from guard.core.heal_plan import Action, CacheView, Copy, HealResult, Outcome, ReplicaResult
from guard.core.verdict import QuorumRead

GHOST, LIVE = "uid-ghost", "uid-live"


def view(replica: str, *copies: Copy, rev: int | None = 100, error: str | None = None) -> CacheView:
    return CacheView(replica, tuple(copies), None if error else rev, error)


def pending(uid: str, rv: int = 50) -> Copy:
    return Copy(uid, rv)


def bound(uid: str, rv: int = 50) -> Copy:
    return Copy(uid, rv, node_name="node-a")


def deleting(uid: str, rv: int = 50) -> Copy:
    return Copy(uid, rv, deleting=True)


GONE = QuorumRead.not_found()
LIVE_PENDING = QuorumRead.found(LIVE, resource_version="60")
GHOST_BOUND = QuorumRead.found(GHOST, node_name="node-a", resource_version="60")
GHOST_TERMINATING = QuorumRead.found(GHOST, deletion_timestamp="2026-01-01T00:00:00Z", resource_version="60")
FAILED = QuorumRead.failed("timeout after 1s")


@pytest.mark.parametrize("read, views, action, outcome, stale", [
    pytest.param(GONE, [view("a"), view("b", pending(GHOST))], Action.PLACEHOLDER, None, ("b",), id="deleted-ghost"),
    pytest.param(GONE, [view("a"), view("b")], Action.NONE, Outcome.HEALED, (), id="deleted-and-no-replica-serves-it"),
    pytest.param(LIVE_PENDING, [view("a", pending(LIVE)), view("b", pending(GHOST))], Action.ANNOTATE, None, ("b",),
                 id="replaced-ghost"),
    pytest.param(GHOST_BOUND, [view("a", bound(GHOST)), view("b", pending(GHOST))], Action.ANNOTATE, None, ("b",),
                 id="already-bound"),
    pytest.param(GHOST_TERMINATING, [view("a", deleting(GHOST)), view("b", pending(GHOST))], Action.ANNOTATE, None,
                 ("b",), id="terminating"),
    pytest.param(LIVE_PENDING, [view("a", pending(LIVE)), view("b", pending(LIVE))], Action.NONE, Outcome.ALIVE, (),
                 id="alive-never-touched"),
    pytest.param(LIVE_PENDING, [view("a", pending(LIVE)), view("b", rev=100)], Action.ANNOTATE, None, ("b",),
                 id="missing-past-the-pods-revision"),
    pytest.param(LIVE_PENDING, [view("a", pending(LIVE)), view("b", rev=55)], Action.NONE, Outcome.ALIVE, (),
                 id="absent-but-behind-is-lag-not-missing"),
    pytest.param(GHOST_BOUND, [view("a", bound(GHOST)), view("b", bound(GHOST))], Action.NONE, Outcome.HEALED, (),
                 id="bound-and-consistent"),
    pytest.param(GONE, [view("a", error="timeout"), view("b")], Action.NONE, Outcome.HEALED, (),
                 id="unreadable-replica-is-not-blamed"),
    pytest.param(FAILED, [view("b", pending(GHOST))], Action.NONE, Outcome.FAILED, (), id="etcd-unreadable-writes-nothing"),
])
def test_plan(read, views, action, outcome, stale):
    p = heal_plan.plan(read, views)
    assert (p.action, p.outcome, p.stale) == (action, outcome, stale)


def test_plan_names_the_ghost_uids():
    p = heal_plan.plan(LIVE_PENDING, [view("a", pending(LIVE)), view("b", pending(GHOST)), view("c", pending("uid-older"))])
    assert p.ghosts == ("uid-ghost", "uid-older")


def test_the_placeholder_is_gated_restricted_and_tiny():
    pod = heal_plan.placeholder_pod("web-0", [GHOST], at="2026-12-01T10:00:00Z")
    spec, meta = pod["spec"], pod["metadata"]
    assert meta["name"] == "web-0" and "namespace" not in meta
    assert spec["schedulingGates"] == [{"name": "kube-ghost-guard.io/placeholder"}]
    assert meta["labels"]["kube-ghost-guard.io/ghost-uid"] == GHOST
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "ghost-guard"
    assert meta["annotations"]["kube-ghost-guard.io/ghost-uid"] == GHOST
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = spec["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["requests"] == c["resources"]["limits"] == {"cpu": "1m", "memory": "8Mi"}
    assert not any(k in spec for k in ("hostNetwork", "hostPID", "hostIPC", "volumes", "nodeName"))


def test_the_placeholder_passes_the_pod_schema():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    pod = heal_plan.placeholder_pod("web-0", [GHOST], at="2026-12-01T10:00:00Z")
    pod["metadata"]["namespace"] = "default"
    kubernetes_validate.validate(pod, "1.30", strict=True)


def test_the_annotation_patch_is_one_annotation_at_one_resource_version():
    patch = heal_plan.annotation_patch("60", [GHOST], at="2026-12-01T10:00:00Z")
    assert list(patch) == ["metadata"]
    assert patch["metadata"]["resourceVersion"] == "60"
    assert list(patch["metadata"]["annotations"]) == ["kube-ghost-guard.io/cache-heal"]


@pytest.mark.parametrize("v, expected", [
    pytest.param(view("a", pending(LIVE, 70)), True, id="at-the-write"),
    pytest.param(view("a", pending(LIVE, 60)), False, id="before-the-write"),
    pytest.param(view("a", pending(LIVE, 70), pending(GHOST, 10)), False, id="ghost-still-beside-it"),
    pytest.param(view("a", rev=80), False, id="absent"),
    pytest.param(view("a", error="timeout"), False, id="unreadable"),
])
def test_shows_live(v, expected):
    assert heal_plan.shows_live(v, QuorumRead.found(LIVE, resource_version="70"), 70) is expected


@pytest.mark.parametrize("v, expected", [
    pytest.param(view("a", rev=69), True, id="below-the-write"),
    pytest.param(view("a", rev=70), False, id="at-the-write"),
    pytest.param(view("a", error="x"), False, id="unreadable-is-not-frozen"),
])
def test_behind(v, expected):
    assert heal_plan.behind(v, 70) is expected


def _result(outcome: Outcome, action: Action = Action.PLACEHOLDER, dry_run: bool = False) -> HealResult:
    return HealResult("default", "web-0", action, outcome, "detail", 0.25, 2, (GHOST,), "no pod under this name (404)",
                      (ReplicaResult("10.0.0.2:6443", "uid-ghost pending", "absent", True, 0.05),), "", dry_run)


@pytest.mark.parametrize("result, ok", [
    pytest.param(_result(Outcome.HEALED), True, id="healed"),
    pytest.param(_result(Outcome.ALIVE, Action.NONE), True, id="alive"),
    pytest.param(_result(Outcome.FROZEN), False, id="frozen"),
    pytest.param(_result(Outcome.REFUSED), False, id="refused"),
    pytest.param(_result(Outcome.TIMEOUT), False, id="timeout"),
    pytest.param(_result(Outcome.FAILED, Action.NONE, dry_run=True), False, id="dry-run-failed"),
    pytest.param(_result(Outcome.FAILED, dry_run=True), False, id="dry-run-with-work-to-do"),
    pytest.param(_result(Outcome.HEALED, Action.NONE, dry_run=True), True, id="dry-run-nothing-to-do"),
])
def test_ok_only_when_every_replica_agrees(result, ok):
    assert result.ok is ok


def test_render_json_and_table():
    r = _result(Outcome.HEALED)
    doc = json.loads(heal_plan.render([r], "json"))
    assert doc["ok"] is True
    assert doc["results"][0]["replicas"][0] == {"replica": "10.0.0.2:6443", "before": "uid-ghost pending",
                                                "after": "absent", "agrees": True, "seconds": 0.05, "frozen": False}
    text = heal_plan.render([r], "table")
    assert text.startswith("default/web-0: healed (action placeholder, 2 write(s), 0.25s)\n")
    assert "10.0.0.2:6443  yes     0.050     uid-ghost pending -> absent" in text
    assert heal_plan.render([], "table") == "nothing to heal: no replica serves a ghost\n"
    with pytest.raises(ValueError):
        heal_plan.render([r], "yaml")


@pytest.mark.parametrize("kwargs, message", [
    pytest.param({"heal_rate": 0}, "--heal-rate must be between 0 and 100 heals per second, got 0", id="rate-zero"),
    pytest.param({"heal_burst": 0}, "--heal-burst must be between 1 and 100, got 0", id="burst-zero"),
    pytest.param({"heal_timeout": 0}, "--heal-timeout must be between 0 and 300 seconds, got 0", id="timeout-zero"),
    pytest.param({"heal_timeout": 301}, "--heal-timeout must be between 0 and 300 seconds, got 301", id="timeout-long"),
])
def test_heal_settings_are_validated(kwargs, message):
    from guard.core.settings import Settings, SettingsError

    with pytest.raises(SettingsError) as e:
        Settings(insecure_http=True, bind="127.0.0.1:8443", **kwargs).validate()
    assert str(e.value) == message


def test_heal_is_off_by_default():
    from guard.core.settings import Settings

    assert Settings().heal is False
