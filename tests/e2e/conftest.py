"""End-to-end fixtures: the real guard (``ghost-guard serve`` over HTTPS + mTLS) next to a lab.

``start_guard`` (tests/conftest.py) starts the process (guard.lab.harness.GuardProcess),
waits for ``/readyz``; a failing test's report carries its log; ``lab`` (tests/fixtures_lab.py)
is a fresh 3-replica lab.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from guard.tools import certs as guard_certs
from guard.lab.harness import GuardProcess, tls_files
from guard.lab.scheduler import ExtenderConfig


@dataclass
class Guard:
    process: GuardProcess
    certs: guard_certs.CertBundle

    def extender(self, *, node_cache_capable: bool = True, preempt: bool = True) -> ExtenderConfig:
        """The KubeSchedulerConfiguration extender entry for this guard (HTTPS, CA and client certificate)."""
        return self.process.extender(node_cache_capable=node_cache_capable, preempt=preempt)


@pytest.fixture
def https_guard(lab, start_guard, tmp_path):
    """Factory: ``https_guard()`` starts ``ghost-guard serve`` over HTTPS with mTLS, reading the
    cluster through replica 0, and returns a :class:`Guard` once ``/readyz`` answers 200."""
    bundle = guard_certs.generate(tmp_path / "certs")

    def start() -> Guard:
        process = start_guard(["--kubeconfig", lab.kubeconfig(0), "--audit-db", str(tmp_path / "audit.db"),
                               "--stale-confirm-delay", "0.2",
                               # The tests run kube-scheduler 20x faster (initial backoff 0.05 s, not 1 s):
                               # scale the guard's windows that are sized below that backoff the same way.
                               "--prepared-grace", "0.025", "--alive-ttl", "0.025"], tls=tls_files(bundle))
        return Guard(process=process, certs=bundle)

    return start
