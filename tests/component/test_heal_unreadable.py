"""guard.engine.healer.Healer on the lab: a replica whose cache read fails in the wait after the placeholder's
delete is read again. One failed read (a timeout under load; seen in a loaded run, where `serve --heal` counted a
heal that every replica had followed as failed: "every readable replica agrees, but ... could not be read") does
not fail the heal; a replica that keeps failing is given up on after ``UNREADABLE_READS`` reads in a row, and the
heal says it could not be read. Real etcd and replicas; the failed reads are lab faults on replica 2 (healthy)."""

from __future__ import annotations

import pytest

from guard.core.settings import Settings
from guard.engine.healer import UNREADABLE_READS, Healer
from guard.engine.replicas import ReplicaPool
from guard.kube.config import load_configuration
from guard.kube.reads import Kube
from guard.lab.harness import eventually, make_ghost

PODS = "/api/v1/namespaces/default/pods"


def heal_with_replica_2_failing(lab, count: int | None):
    """Heal a ghost of replica 1; once replicas 0 and 1 have dropped it after the placeholder's delete, replica 2's
    cache reads of the name answer 503 (``count`` of them, or all): the wait's first round sees 0 and 1 done and 2
    unreadable. Returns (the heal's result, the fault rule)."""
    make_ghost(lab, "default", "web-0", stale=1)
    lab.replicas[1].faults.clear()
    settings = Settings(kubeconfig=lab.kubeconfig(0), events=False, probe_timeout=2.0)
    kube = Kube(load_configuration(lab.kubeconfig(0)), timeout=2.0, pool_size=4)
    pool = ReplicaPool(settings, kube)
    rules = []

    def progress(line: str) -> None:
        if "placeholder deleted" in line:
            eventually(lambda: lab.cached_pod(0, "default", "web-0") is None
                       and lab.cached_pod(1, "default", "web-0") is None, 10, what="replicas 0 and 1 dropping the ghost")
            rules.append(lab.replicas[2].faults.add("status", method="GET", path=PODS, status=503, count=count,
                                                    query=".*resourceVersion=0.*"))

    healer = Healer(kube, pool.clients, timeout=10.0, progress=progress)
    try:
        result = healer.heal("default", "web-0")
    finally:
        healer.close()
        pool.close()
        kube.close()
        lab.replicas[2].faults.clear()
    assert len(rules) == 1, "the heal never reached the wait after the placeholder's delete"
    return result, rules[0]


@pytest.mark.timeout(60)
def test_one_failed_read_after_the_delete_is_read_again_and_the_heal_is_healed(lab):
    result, rule = heal_with_replica_2_failing(lab, count=1)
    assert rule.hits == 1
    assert (result.action.value, result.outcome.value) == ("placeholder", "healed"), result.detail
    assert "every replica agrees with etcd" in result.detail


@pytest.mark.timeout(60)
def test_a_replica_that_keeps_failing_is_given_up_on_and_named(lab):
    result, rule = heal_with_replica_2_failing(lab, count=None)
    assert rule.hits == UNREADABLE_READS  # read again, then given up on: not polled until the deadline
    assert (result.action.value, result.outcome.value) == ("placeholder", "failed"), result.detail
    stale2 = f"{lab.replicas[2].ip}:{lab.replicas[2].port}"
    assert f"every readable replica agrees, but {stale2} could not be read" in result.detail
