"""The lab scheduler's pure fit functions (guard/lab/scheduler/fit.py): the fit error message, resource fit.

FitError.Error() in kube-scheduler counts each node's reasons one by one: NodeResourcesFit
gives one reason per insufficient resource, an extender's failed node one reason, commas
and all (the guard's reasons hold commas).
"""

from __future__ import annotations

import pytest

from guard.lab.scheduler.fit import UNRESOLVABLE, UNSCHEDULABLE, fit_error_message, fit_reasons, static_filters

GHOST = "ghost pod: ns/web-1 uid u-1 is terminating since 2026-01-01T00:00:00Z (quorum read, etcd); scheduler cache is stale"


@pytest.mark.parametrize("statuses,message", [
    pytest.param({}, "0/0 nodes are available.", id="no-nodes"),
    pytest.param({n: (UNRESOLVABLE, (GHOST,)) for n in "abc"}, f"0/3 nodes are available: 3 {GHOST}.",
                 id="extender-reason-with-commas-is-one-reason"),
    pytest.param({"a": (UNSCHEDULABLE, ("Insufficient cpu", "Insufficient memory")),
                  "b": (UNSCHEDULABLE, ("Insufficient cpu",)),
                  "c": (UNRESOLVABLE, ("node(s) were unschedulable",))},
                 "0/3 nodes are available: 1 Insufficient memory, 1 node(s) were unschedulable, 2 Insufficient cpu.",
                 id="reasons-counted-per-node-sorted"),
])
def test_fit_error_message(statuses, message):
    assert fit_error_message(len(statuses), statuses) == message


def node(cpu: str, memory: str = "1Gi", pods: str = "110", **spec) -> dict:
    return {"metadata": {"name": "n", "labels": {"zone": "a"}}, "spec": spec,
            "status": {"allocatable": {"cpu": cpu, "memory": memory, "pods": pods}}}


def pod(cpu: str = "0", memory: str = "0", **spec) -> dict:
    return {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [{"resources": {"requests": {"cpu": cpu, "memory": memory}}}], **spec}}


@pytest.mark.parametrize("incoming,on_node,allocatable,reasons", [
    pytest.param(pod("500m"), [pod("500m")], node("1"), [], id="fits-exactly"),
    pytest.param(pod("600m", "600Mi"), [pod("500m", "500Mi")], node("1"), ["Insufficient cpu", "Insufficient memory"],
                 id="two-reasons"),
    pytest.param(pod(), [pod()], node("1", pods="1"), ["Too many pods"], id="pod-count"),
])
def test_fit_reasons(incoming, on_node, allocatable, reasons):
    assert fit_reasons(incoming, allocatable, on_node) == reasons


@pytest.mark.parametrize("incoming,target,status", [
    pytest.param(pod(), node("1"), None, id="schedulable"),
    pytest.param(pod(), node("1", unschedulable=True), (UNRESOLVABLE, ("node(s) were unschedulable",)),
                 id="cordoned"),
    pytest.param(pod(nodeSelector={"zone": "b"}), node("1"),
                 (UNRESOLVABLE, ("node(s) didn't match Pod's node affinity/selector",)), id="selector"),
    pytest.param(pod(tolerations=[{"operator": "Exists"}]), node("1", unschedulable=True), None,
                 id="tolerates-cordon"),
])
def test_static_filters(incoming, target, status):
    assert static_filters(incoming, target) == status
