"""``/metrics`` under gunicorn reads every process's metrics file; one still being created is skipped."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os
from guard import metrics
metrics.HEALS_DROPPED.inc()
open(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "counter_99999.db"), "wb").close()  # being created
print(metrics.exposition().decode())
"""


def test_an_empty_metrics_file_of_a_starting_process_is_skipped(tmp_path):
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr  # was struct.error: /metrics answered 500
    assert "ghost_guard_heals_dropped_total 1.0" in r.stdout
