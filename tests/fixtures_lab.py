"""pytest fixtures for the lab (real etcd + apiserver replicas); loaded by tests/conftest.py.

- ``lab``: a fresh 3-replica lab per test (for tests that inject faults, stop
  replicas or etcd).
- ``shared_lab``: one 3-replica lab per session for tests that only read and
  write objects; faults are cleared and stopped replicas restarted after each
  test. Use ``lab_namespace`` to keep objects apart.
- ``module_lab``: a fresh 3-replica lab per test module (a module overrides ``module_lab_replicas`` for
  another count), for a module whose tests share one guard
  (``module_guard``); each test uses its own object names and clears the faults it set
  (``mend``).
- ``mended_module_lab``: ``module_lab`` for one test, mended (``mend``) after it.
- ``lab_factory``: ``lab_factory(replicas=1, **options)`` for other shapes.
- ``lab_scheduler``: ``lab_scheduler(kubeconfig, timings=..., extenders=...)`` starts the
  scheduler simulator (``guard.lab.scheduler.Scheduler``), stopped after the test.

On failure, the etcd log tail is printed (uses ``rep_call``, set by the
``pytest_runtest_makereport`` hook in tests/conftest.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from guard.lab import Lab


__all__ = ["lab", "lab_factory", "module_lab", "module_lab_replicas", "mended_module_lab", "lab_namespace", "lab_scheduler", "shared_lab", "_shared_lab_session"]


def _report(lab: Lab, request: pytest.FixtureRequest) -> None:
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(f"--- etcd log tail ({lab.etcd.log_path}) ---\n{lab.etcd.log_tail()}")


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    with Lab(replicas=3) as lab:
        yield lab
        _report(lab, request)


@pytest.fixture(scope="module")
def module_lab_replicas() -> int:
    """How many replicas ``module_lab`` has: 3; a module that wants another count overrides this fixture."""
    return 3


@pytest.fixture(scope="module")
def module_lab(module_lab_replicas: int) -> Iterator[Lab]:
    with Lab(replicas=module_lab_replicas) as lab:
        yield lab


@pytest.fixture
def mended_module_lab(module_lab: Lab) -> Iterator[Lab]:
    """``module_lab`` for one test: every replica's faults cleared (stopped ones started) after it."""
    yield module_lab
    mend(module_lab)


@pytest.fixture
def lab_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., Lab]]:
    labs: list[Lab] = []

    def make(replicas: int = 3, **options: object) -> Lab:
        lab = Lab(replicas=replicas, **options)  # type: ignore[arg-type]
        labs.append(lab)
        return lab.start()

    yield make
    for lab in labs:
        _report(lab, request)
        lab.close()


@pytest.fixture(scope="session")
def _shared_lab_session() -> Iterator[Lab]:
    with Lab(replicas=3) as lab:
        yield lab


@pytest.fixture
def shared_lab(_shared_lab_session: Lab, request: pytest.FixtureRequest) -> Iterator[Lab]:
    lab = _shared_lab_session
    yield lab
    _report(lab, request)
    mend(lab)


def mend(lab: Lab) -> None:
    """Undo what a test broke: etcd and stopped replicas started again, every replica's faults cleared."""
    if not lab.etcd.running:
        lab.etcd.start()
    for r in lab.replicas:
        r.faults.clear()
        if not r.running:
            r.start()


@pytest.fixture
def lab_scheduler() -> Iterator[Callable[..., object]]:
    from guard.lab.scheduler import Scheduler

    started: list[Scheduler] = []

    def start(kubeconfig: str, **options: object) -> Scheduler:
        s = Scheduler(kubeconfig, **options)  # type: ignore[arg-type]
        s.start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def lab_namespace(shared_lab: Lab) -> str:
    """A fresh namespace in the shared lab."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    shared_lab.core_v1(0).create_namespace({"metadata": {"name": name}})
    return name


# --- helpers (import them: ``from fixtures_lab import raw``; pods, ghosts and polling: guard.lab.harness) ---


def raw(lab: Lab, replica: int, method: str, path: str, *, body: object = None, token: str | None = "lab",
        headers: dict[str, str] | None = None, timeout: float = 5.0):
    """One HTTPS request to a replica without the kubernetes client: returns (status, parsed JSON or text)."""
    import json

    import urllib3

    http = urllib3.PoolManager(ca_certs=lab.ca_path, cert_reqs="CERT_REQUIRED", retries=False)
    hdrs = dict(headers or {})
    if token is not None:
        hdrs["Authorization"] = f"Bearer {lab.token if token == 'lab' else token}"
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    r = http.request(method, lab.replicas[replica].url + path, body=data, headers=hdrs,
                     timeout=urllib3.Timeout(total=timeout))
    try:
        return r.status, json.loads(r.data)
    except ValueError:
        return r.status, r.data.decode()
