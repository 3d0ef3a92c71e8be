"""A clean stop (issue 26, finding 2): SIGTERM to a real `ghost-guard serve` on the lab, while its
replica cache health check is in the middle of a round, logs no error-level line.

The round is made slow on purpose (a latency fault on one replica's revision probe reads), and each
SIGTERM is sent only once that replica has been asked, so every stop lands inside a round: before the
fix the round's next ``ThreadPoolExecutor.map`` met a pool shut down under it (``RuntimeError: cannot
schedule new futures after ... shutdown``) and logged it at error level.
"""

from __future__ import annotations

import pytest

from guard.lab.harness import GuardProcess, eventually, stop_group

pytestmark = pytest.mark.timeout(400)

STOPS = 3


def test_sigterm_mid_round_logs_no_error(shared_lab, tmp_path) -> None:
    rule = shared_lab.replicas[1].faults.add("latency", seconds=1.5, query=".*ghost-guard-revision-probe.*")
    try:
        for i in range(STOPS):
            g = GuardProcess(["--kubeconfig", shared_lab.kubeconfig(0), "--no-prepare", "--no-events",
                              "--frozen-after", "3", "--workers", "1",
                              "--audit-db", str(tmp_path / "audit.db")])
            try:
                g.wait("/healthz", timeout=90)
                asked = rule.hits
                eventually(lambda: rule.hits > asked, 15, what="a revision round in flight", process=g)
                stop_group(g.proc, term_timeout=30)
                bad = [r for r in g.log_records() if r.get("level") in ("error", "critical")]
                assert not bad, f"stop {i + 1}: error-level lines on SIGTERM: {bad}"
                assert g.proc.returncode == 0, g.logs()
            finally:
                g.stop()
    finally:
        shared_lab.replicas[1].faults.remove(rule.id)
