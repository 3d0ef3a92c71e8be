"""Shared test plumbing: real guard processes over real HTTP(S).

Layer fixtures: the lab (real etcd + apiserver replicas) comes from
``tests/fixtures_lab.py``; this file starts ``ghost-guard serve`` processes
(``guard.lab.harness.GuardProcess``, shared with the demo and the benchmarks) through one launcher:
``start_guard`` (stopped after the test) and ``module_guard`` (after the module). A failing test's
report carries the log of every guard still running. Never mock or patch ``guard.*``: faults come
from the lab.

Helpers to import: ``payloads`` (what callers send), ``clirun`` (the CLI in-process),
``guardstate`` (what a running guard says it has seen, to wait on), ``fixtures_lab.raw``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from guard.lab.harness import GuardProcess

_TESTS = Path(__file__).resolve().parent

try:  # the lab fixtures (needs the `lab` extra)
    from fixtures_lab import *  # noqa: F401,F403
except ImportError as e:  # pragma: no cover - reported, not hidden
    if "fixtures_lab" not in str(e):
        raise


# The kinds of tests, slowest first: the order in which a distributed run (pytest-xdist, ``-n``) hands out
# its groups (`--no-loadscope-reorder`: in collection order, not by size), so that the long files start
# first and the short ones fill the gaps at the end.
_SLOWEST_FIRST = ("real", "e2e", "integration", "lab", "component", "state", "repo", "unit")


def _file(item) -> str:
    path = Path(item.path).resolve()
    return path.relative_to(_TESTS).as_posix() if path.is_relative_to(_TESTS) else str(path)


def _kind(item) -> str:
    parts = _file(item).split("/")
    return parts[0] if len(parts) > 1 else ""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """One test file is one group of a distributed run (``--dist loadgroup``): its module-scoped labs and
    guards are started once, on one worker. The real tier is one group (its tests share one control plane,
    started once). Run alone, end-to-end tests run last; distributed, the slowest kinds start first."""
    for item in items:
        kind = _kind(item)
        group = "real" if kind == "real" else _file(item)
        item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # a worker of a distributed run
        rank = {kind: i for i, kind in enumerate(_SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(_kind(item), len(rank)))
    else:
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


# Every guard process the fixtures below started and have not stopped yet: a failing test's report carries
# each one's log (pytest_runtest_makereport), whichever fixture scope started it.
_RUNNING: list[GuardProcess] = []
READY_TIMEOUT = 60.0  # seconds a started guard has to answer its first probe


class _Guards:
    """``ghost-guard serve`` processes started for one fixture scope; each one is in ``_RUNNING`` until stopped."""

    def __init__(self) -> None:
        self.started: list[GuardProcess] = []

    def __call__(self, args: list[str], *, tls: dict | None = None, wait: str | None = "/readyz",
                 env: dict | None = None, **options) -> GuardProcess:
        g = GuardProcess(args, tls=tls, env=env, **options)
        self.started.append(g)
        _RUNNING.append(g)
        if wait:
            # A positive signal, so a generous deadline costs nothing when the guard is well: a guard's start
            # (interpreter, imports, gunicorn, its first reads) took 15 s and more at a load average of 15.
            g.wait(wait, timeout=READY_TIMEOUT)
        return g

    def together(self, *arg_lists: list[str], **options) -> list[GuardProcess]:
        """One guard per argument list, started at once (their start-ups overlap), then each waited for as
        ``self(args)`` waits (``/readyz``)."""
        guards = [self(args, wait=None, **options) for args in arg_lists]
        for g in guards:
            g.wait("/readyz", timeout=READY_TIMEOUT)
        return guards

    def stop(self, *guards: GuardProcess) -> None:
        """Stop these guards (default: every one started here) and wait until they exited; their log files
        stay readable."""
        for g in guards or self.started:
            g.stop()
            if g in _RUNNING:
                _RUNNING.remove(g)

    def release(self) -> None:
        """The fixture's teardown: every guard started here is stopped in the background (SIGTERM, SIGKILL
        after 10 s, as ``stop``), so that the next test need not wait for a guard's exit (a few seconds of
        thread joins after its worker's last request); the session's end waits for every one of them."""
        for g in self.started:
            if g in _RUNNING:
                _RUNNING.remove(g)
            t = threading.Thread(target=g.stop, name=f"stop guard {g.port}", daemon=True)
            t.start()
            _STOPPING.append(t)


# Guards stopping in the background (``_Guards.release``): joined when the session ends.
_STOPPING: list[threading.Thread] = []


def pytest_sessionfinish(session, exitstatus):
    for t in _STOPPING:
        t.join(30)


@pytest.fixture
def start_guard():
    """Factory: ``start_guard(["--kubeconfig", k, ...], tls=..., wait="/readyz")`` -> GuardProcess, stopped
    after the test (in the background: the next test starts at once). Other keywords (``port``,
    ``verbatim``, ``clean_env``, ...) go to :class:`GuardProcess`. ``start_guard.stop(g)`` stops one now and
    waits for its exit. A failing test's report shows the log of every guard still running (the "guard log"
    sections)."""
    guards = _Guards()
    yield guards
    guards.release()


@pytest.fixture(scope="module")
def module_guard():
    """``start_guard`` for a guard shared by a module's tests (start it from a module-scoped fixture):
    stopped after the module (in the background); its log is in the report of each of the module's tests
    that fails."""
    guards = _Guards()
    yield guards
    guards.release()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
    if rep.failed and rep.when in ("setup", "call"):
        for g in _RUNNING:
            rep.sections.append((f"guard log ({' '.join(g.cmd[3:])})", g.logs()))
