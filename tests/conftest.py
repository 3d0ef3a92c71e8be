"""Shared test plumbing: real guard processes over real HTTP(S).

Layer fixtures: the lab (real etcd + apiserver replicas) comes from
``tests/fixtures_lab.py``; this file starts ``ghost-guard serve`` processes
(``guard.lab.harness.GuardProcess``, shared with the demo and the benchmarks).
Never mock or patch ``guard.*``: faults come from the lab.
"""

from __future__ import annotations

import pytest

from guard.lab.harness import GuardProcess

try:  # the lab fixtures (needs the `lab` extra)
    from fixtures_lab import *  # noqa: F401,F403
except ImportError as e:  # pragma: no cover - reported, not hidden
    if "fixtures_lab" not in str(e):
        raise


def pytest_collection_modifyitems(config, items):
    """End-to-end tests run last."""
    items.sort(key=lambda item: 1 if item.get_closest_marker("e2e") else 0)


@pytest.fixture(scope="session", autouse=True)
def _user_state_home(tmp_path_factory):
    """A guard started without --audit-db on a machine whose /var/lib/ghost-guard is not writable records to
    $XDG_STATE_HOME/ghost-guard/audit.db: in the tests, a temporary directory (never the user's own)."""
    import os

    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    yield
    if before is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = before


@pytest.fixture(scope="session")
def dead_kubeconfig(tmp_path_factory) -> str:
    """A kubeconfig whose apiserver never answers (a closed port): every quorum GET fails open."""
    path = tmp_path_factory.mktemp("kc") / "kubeconfig"
    path.write_text("apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: 'http://127.0.0.1:9'}\n"
                    "users:\n- name: u\n  user: {token: t}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
                    "current-context: x\n")
    return str(path)


@pytest.fixture
def start_guard(request):
    """Factory: ``start_guard(["--kubeconfig", k, ...], tls=..., wait="/readyz")`` -> GuardProcess.

    Other keywords (``port``, ``verbatim``, ``clean_env``, ...) go to :class:`GuardProcess`."""
    started: list[GuardProcess] = []

    def start(args: list[str], *, tls: dict | None = None, wait: str | None = "/readyz",
              env: dict | None = None, **options) -> GuardProcess:
        g = GuardProcess(args, tls=tls, env=env, **options)
        started.append(g)
        if wait:
            g.wait(wait)
        return g

    yield start
    failed = getattr(request.node, "rep_call", None)
    for g in started:
        g.stop()
        if failed is not None and failed.failed:
            print(f"\n--- guard log ({' '.join(g.cmd[3:])}) ---\n{g.logs()}")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
