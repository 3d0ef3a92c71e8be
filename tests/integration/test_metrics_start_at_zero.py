"""Every labelled counter has a series from the start (issue 26, finding 7): an alert rule "should stay 0"
(``increase(ghost_guard_fail_open_total[10m]) > 0``) sees 0, not nothing, before the first event.

A real `ghost-guard serve` (two workers, multiprocess metrics), no cluster needed.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(120)


def test_labelled_counters_start_at_zero(start_guard, dead_kubeconfig, tmp_path) -> None:
    g = start_guard(["--kubeconfig", dead_kubeconfig, "--workers", "2", "--no-prepare", "--no-events",
                     "--audit-db", str(tmp_path / "audit.db")], wait=None)
    g.wait("/healthz", 90)  # a loaded machine boots workers slowly
    samples = g.metrics()
    for name, labels in [
        ("ghost_guard_fail_open_total", {"reason": "apiserver"}),
        ("ghost_guard_fail_open_total", {"reason": "budget"}),
        ("ghost_guard_fail_open_total", {"reason": "internal-error"}),
        ("ghost_guard_heals_total", {"action": "placeholder", "outcome": "healed"}),
        ("ghost_guard_heals_total", {"action": "placeholder", "outcome": "frozen"}),
        ("ghost_guard_ghosts_blocked_total", {"verdict": "ghost-deleted"}),
        ("ghost_guard_audit_records_dropped_total", {"reason": "queue-full"}),
        ("ghost_guard_connections_rejected_total", {"reason": "header-timeout"}),
    ]:
        key = (name, tuple(sorted(labels.items())))
        assert samples.get(key) == 0, (name, labels, sorted(k for k in samples if k[0] == name))
