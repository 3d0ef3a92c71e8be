"""guard.core.identity: which client certificate may call which endpoint (pure, no sockets)."""

from __future__ import annotations

import pytest

from guard.core.identity import ROLE_OF_ENDPOINT, ROLE_OF_PATH, RolePolicy, certificate_names, exact_route
from guard.core.settings import Settings, SettingsError


def peer(cn: str | None = None, dns: tuple[str, ...] = ()) -> dict:
    """A certificate as ssl.SSLSocket.getpeercert() reports it."""
    cert: dict = {"subject": ((("organizationName", "kube-ghost-guard"),),) + (((("commonName", cn),),) if cn else ())}
    if dns:
        cert["subjectAltName"] = tuple(("DNS", d) for d in dns) + (("IP Address", "10.0.0.1"),)
    return cert


def test_names_are_the_cns_then_the_dns_sans():
    assert certificate_names(peer("a", ("b.example", "a"))) == ("a", "b.example")
    assert certificate_names(peer(None, ("only.dns",))) == ("only.dns",)
    assert certificate_names(None) == () and certificate_names({}) == ()


@pytest.mark.parametrize("path,allowed", [
    ("/filter", "system:kube-scheduler"), ("/preempt", "system:kube-scheduler"),
    ("/validate/binding", "kube-apiserver-ghost-guard-client"),
    ("/metrics", "ghost-guard-monitoring"), ("/healthz", "ghost-guard-monitoring"), ("/readyz", "ghost-guard-monitoring"),
])
def test_each_endpoint_answers_only_its_role_by_default(path, allowed):
    policy = RolePolicy.from_settings(Settings())
    for cn in ("system:kube-scheduler", "kube-apiserver-ghost-guard-client", "ghost-guard-monitoring", "someone"):
        refused = policy.refuse(path, peer(cn))
        if cn == allowed:
            assert refused is None, (path, cn)
        else:
            role, reason = refused
            assert role == ROLE_OF_PATH[path]
            assert cn in reason and path in reason and f"--{role}-identities" in reason


def test_a_dns_san_matches_and_identities_are_configurable():
    policy = RolePolicy.from_settings(Settings(scheduler_identities="sched-a, sched.example.com"))
    assert policy.refuse("/filter", peer("x", ("sched.example.com",))) is None
    assert policy.refuse("/filter", peer("sched-a")) is None
    assert policy.refuse("/filter", peer("system:kube-scheduler")) is not None  # replaced, not added
    assert policy.refuse("/filter", None)[1].startswith("client certificate (no CN or DNS name)")


def test_a_path_that_is_no_route_is_refused_whatever_the_certificate():
    policy = RolePolicy.from_settings(Settings())
    for path in ("/nope", "//filter", "/filter/", "/FILTER"):
        for cn in ("system:kube-scheduler", "ghost-guard-monitoring", "anyone"):
            assert policy.refuse(path, peer(cn)) is not None, (path, cn)


@pytest.mark.parametrize("raw", ["//filter", "///filter", "/%66ilter", "/%2Ffilter", "/./filter", "/a/../filter",
                                 "/FILTER", "/filter/", "/filter;x", "/filter%00", "/filter#x",
                                 "https://h/filter", "/filter%20"])
def test_exact_route_refuses_every_other_spelling(raw):
    # whatever the server decoded the target to, including the route itself
    for decoded in ("/filter", raw.partition("?")[0]):
        assert exact_route(raw, "", decoded) is None, (raw, decoded)


def test_exact_route_takes_the_route_with_or_without_a_query():
    for path in ROLE_OF_PATH:
        assert exact_route(path, "", path) == path
        assert exact_route(path + "?a=b&c", "", path) == path
        assert exact_route(None, "", path) == path  # a server without RAW_URI: the decoded path decides
        assert exact_route(path, "/prefix", path) is None  # a SCRIPT_NAME: not the route as declared
    assert exact_route("/nope", "", "/nope") is None


def test_every_route_has_the_role_of_its_endpoint():
    assert set(ROLE_OF_ENDPOINT.values()) == set(ROLE_OF_PATH.values())


@pytest.mark.parametrize("field", ["scheduler_identities", "apiserver_identities", "monitoring_identities"])
def test_an_empty_role_is_refused_by_validation(field):
    with pytest.raises(SettingsError, match=field.replace("_", "-")):
        Settings(insecure_http=True, bind="127.0.0.1:1", **{field: " , "}).validate()


def test_the_refusal_reads_as_english():
    """issue 26, finding 10: "it needs an apiserver identity", not "a apiserver"."""
    policy = RolePolicy.from_settings(Settings())
    _, reason = policy.refuse("/validate/binding", peer("someone"))
    assert "needs an apiserver identity" in reason
    _, reason = policy.refuse("/filter", peer("someone"))
    assert "needs a scheduler identity" in reason
