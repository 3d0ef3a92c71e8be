"""``benchmarks/scale_sweep_real.py`` on a tiny scale, so it cannot rot: bound pods filled by raw POSTs,
nodes set, one backlog (takeover) case with the guard and one live case with the pass-through on the
real kube-scheduler, each measured as the sweep measures it; then its table and its plots."""

from __future__ import annotations

import math

from benchmarks import scale_sweep_real as sweep

PENDING = 4


def test_a_tiny_cell_of_the_sweep_end_to_end(real_lab_factory, tmp_path):
    # A lab of its own: the sweep counts every pod GET the apiservers served in a case's window, and on the
    # shared lab one full real-tier run counted 5 per pod (alone: 1), so another test's leftovers cannot count.
    real_lab = real_lab_factory(replicas=2)
    assert sweep.fill_bound(real_lab, 20) > 0
    bound = real_lab.core_v1(0).list_namespaced_pod(sweep.BOUND_NS, _request_timeout=10).items
    assert len(bound) == 20 and all(p.spec.node_name for p in bound)
    sweep.set_nodes(real_lab, 0, 2)
    guard = sweep.run_case(real_lab, "guard", "backlog", 2, PENDING, 1, str(tmp_path), [], timeout=120)
    plain = sweep.run_case(real_lab, "pass-through", "live", 2, PENDING, 2, str(tmp_path), [], timeout=120)
    for res in (guard, plain):
        assert res["pods_per_s"] > 0 and math.isfinite(res["pods_per_s"])
        assert res["peak_rss_mib"] > 10
        assert res["requests"]["POST/pods/binding"] >= PENDING  # every pod bound by kube-scheduler
        assert res["watch_events_per_pod"] > 0  # apiserver_watch_events_total read from the replicas
    assert plain["requests"]["POST/pods"] == PENDING  # live: created inside the window (backlog: before it)
    assert "POST/pods" not in guard["requests"]
    assert guard["first_verdict_s"] >= guard["ready_s"] > 0  # the takeover: launch -> ready -> first pod bound
    assert guard["guard"]["filter_calls"] >= PENDING and guard["guard"]["fail_open"] == 0
    assert 0 < guard["pod_gets_per_pod"] <= 1 and plain["pod_gets_per_pod"] == 0
    # the rest of the machine's work in the window, from /proc (the backlog's window holds the guard's and
    # kube-scheduler's starts: seconds of apiserver and scheduler CPU, never 0 ticks), and the guard's own
    # /filter time from its histogram
    assert guard["control_plane_cpu_ms_per_pod"] > 0 and guard["scheduler_cpu_ms_per_pod"] > 0
    assert plain["control_plane_cpu_ms_per_pod"] >= 0 and math.isfinite(plain["scheduler_cpu_ms_per_pod"])
    assert 0 < guard["filter_ms_mean"] < 5000
    assert not real_lab.core_v1(0).list_namespaced_pod("c1", _request_timeout=10).items  # deleted after its case
    rows = sweep.table([guard | {"phase": "live"}, plain])
    assert "| 2 | 4 | live | 1 |" in rows
    assert all(p.stat().st_size > 1000 for p in sweep.plot([guard, plain], tmp_path))
    sweep.set_nodes(real_lab, 2, 0)
