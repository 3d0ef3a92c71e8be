"""``render_scheduler_config``: the product's KubeSchedulerConfiguration as the real lab hands it to
kube-scheduler. The extender's verbs are the caller's: a filter-only registration has no preempt verb."""

from __future__ import annotations

from guard.lab.real.controlplane import PRODUCT_SCHEDULER_CONFIG, render_scheduler_config
from guard.lab.scheduler.config import ExtenderConfig, TLSConfig

TLS = TLSConfig(ca_file="/c/ca.crt", cert_file="/c/client.crt", key_file="/c/client.key")


def _extender(**kw: object) -> ExtenderConfig:
    return ExtenderConfig(url_prefix="https://127.0.0.1:8443", enable_https=True, tls_config=TLS, **kw)  # type: ignore[arg-type]


def test_the_product_verbs_when_both_are_asked() -> None:
    cfg = render_scheduler_config("/k", _extender(filter_verb="filter", preempt_verb="preempt"))
    (entry,) = cfg["extenders"]
    assert (entry["filterVerb"], entry["preemptVerb"]) == ("filter", "preempt")
    assert entry["urlPrefix"] == "https://127.0.0.1:8443"
    assert entry["tlsConfig"] == {"caFile": "/c/ca.crt", "certFile": "/c/client.crt", "keyFile": "/c/client.key",
                                  "serverName": "ghost-guard.ghost-guard.svc"}
    assert cfg["clientConnection"]["kubeconfig"] == "/k" and cfg["leaderElection"] == {"leaderElect": False}


def test_a_filter_only_extender_has_no_preempt_verb() -> None:
    (entry,) = render_scheduler_config("/k", _extender(filter_verb="filter"))["extenders"]
    assert entry["filterVerb"] == "filter"
    assert "preemptVerb" not in entry


def test_the_verbs_are_the_callers_not_the_shipped_ones() -> None:
    (entry,) = render_scheduler_config("/k", _extender(filter_verb="f2", preempt_verb="p2"))["extenders"]
    assert (entry["filterVerb"], entry["preemptVerb"]) == ("f2", "p2")
    (entry,) = render_scheduler_config("/k", _extender(preempt_verb="preempt"))["extenders"]
    assert "filterVerb" not in entry and entry["preemptVerb"] == "preempt"


def test_the_guard_process_extender_without_preempt() -> None:
    from guard.lab.harness import GuardProcess

    # GuardProcess.extender() reads only the process's address and TLS files: no process needed
    g = GuardProcess.__new__(GuardProcess)
    g.scheme, g.base, g.tls = "http", "http://127.0.0.1:1", {}
    (entry,) = render_scheduler_config("/k", g.extender(preempt=False))["extenders"]
    assert entry["filterVerb"] == "filter" and "preemptVerb" not in entry
    (entry,) = render_scheduler_config("/k", g.extender())["extenders"]
    assert entry["preemptVerb"] == "preempt"


def test_no_extender_drops_the_entry() -> None:
    assert "extenders" not in render_scheduler_config("/k", None, source=PRODUCT_SCHEDULER_CONFIG)
