"""``benchmarks/cpu_per_pod_real.py`` on a tiny scale: a case runs to the end on the real kube-scheduler
with either extender and measures what it says (every pod bound through the extender's ``/filter``,
the guard's quorum GETs counted by the real apiservers, the extender's CPU read from ``/proc``)."""

from __future__ import annotations

import math

from benchmarks import cpu_per_pod_real as bench

PODS = 5


def test_a_case_per_extender_and_phase_on_the_real_scheduler(real_lab, tmp_path):
    bench.add_nodes(real_lab, 0, 3)
    guard = bench.run_case(real_lab, "guard", "backlog", PODS, 1, str(tmp_path), [], timeout=120)
    plain = bench.run_case(real_lab, "pass-through", "live", PODS, 2, str(tmp_path), [], timeout=120)
    for res in (guard, plain):
        assert res["pods_per_s"] > 0 and math.isfinite(res["pods_per_s"])
        # the extender's process tree, read from /proc: in clock ticks (10 ms), so an extender that served 5
        # pods may show none (the guard too: 0.0 on a quiet machine, seen once)
        assert res["cpu_ms_per_pod"] >= 0 and math.isfinite(res["cpu_ms_per_pod"])
        assert res["requests"]["POST/pods/binding"] >= PODS  # kube-scheduler bound every pod
        assert res["requests"]["POST/pods"] == PODS
    # ignorable: false, so each pod bound went through a /filter answer of the guard
    assert guard["guard"]["filter_calls"] >= PODS and guard["guard"]["fail_open"] == 0
    # the card: at most one quorum GET per live pod; the pass-through makes none
    assert 0 < guard["pod_gets_per_pod"] <= 1, (guard["guard"], guard["requests"])
    assert plain["pod_gets_per_pod"] == 0
    # the case's pods are gone, so the next case's guard does not verify them
    assert not real_lab.core_v1(0).list_namespaced_pod("backlog-1").items


def test_the_floor_reads_every_pending_pod_from_etcd(real_lab, tmp_path):
    """``floor`` (the pass-through plus a quorum GET per pending pod) makes the GETs it stands for:
    at least one per pod, counted by the real apiservers (any pending pod another test left is read too),
    and every pod is bound."""
    bench.add_nodes(real_lab, 3, 6)  # names of its own: the lab is shared with the test above
    floor = bench.run_case(real_lab, "floor", "live", PODS, 3, str(tmp_path), [], timeout=120)
    assert floor["requests"]["POST/pods/binding"] >= PODS
    assert floor["pod_gets_per_pod"] >= 1, floor["requests"]
    assert floor["floor"]["gets"] >= PODS and floor["floor"]["get_errors"] == 0, floor["floor"]
