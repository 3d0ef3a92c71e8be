"""The real tier: real kube-apiserver (and kube-scheduler, kube-controller-manager) binaries.

Every test under ``tests/real/`` is marked ``real``. The binaries come from ``GHOST_GUARD_KUBE_BIN``,
else ``KUBEBUILDER_ASSETS`` (a directory holding ``kube-apiserver``, or a release tarball unpacked
once to a cache; see ``guard.lab.real.binaries``). Without either, every real test is skipped with
ONE reason; when one is set but broken (or CI=true and ``../shared/k8s/*.tar.xz`` exists but
nothing names binaries), the fixtures FAIL instead: a broken setup never skips silently.

Fixture API (stable; scenario branches build on it):

- ``kube_binaries`` (session): the :class:`guard.lab.real.binaries.KubeBinaries` found.
- ``real_lab`` (session; module-scoped fixtures may use it): one started
  :class:`guard.lab.real.controlplane.RealLab` for every test that asks for it: 2 replicas
  (``127.0.0.1``, ``127.0.0.2``, one port), a fault proxy per replica when ``guard.lab.real.etcdproxy``
  exists, no scheduler, no controller-manager. The real tier's tests are ordered so those using it run
  in a row; it starts with the first and is closed once no test left to run asks for it. Tests
  sharing it use their own namespace (``real_namespace``) and clear the faults they set (done after each test on it too:
  ``replicas[i].faults.clear()`` and stopped replicas restarted).
- ``real_namespace`` (function): a fresh namespace (with its ``default`` ServiceAccount) in ``real_lab``.
- ``real_lab_factory`` (function) / ``real_lab_module_factory`` (module):
  ``factory(replicas=2, scheduler=False, controller_manager=False, proxies=None, **RealLab options)``
  -> a started RealLab, closed when the test (module) ends. ``scheduler=True`` starts kube-scheduler
  without an extender; ``lab.start_scheduler(running_guard.extender(), replica=0)`` (re)starts it with the
  product's KubeSchedulerConfiguration pointing at a guard. ``lab.binding_404s(i)`` counts
  ``apiserver_request_total{resource="pods",subresource="binding",code="404"}``.

The RealLab surface is :class:`guard.lab.backend.LabBackend` (shared with the Python ``Lab``):
``kubeconfig(i)``, ``api_client(i)``, ``core_v1(i)``, ``urls``, ``token``, ``ca_path``, ``revision()``,
``wait_synced()``, ``cached_pod()``, ``ensure_namespace()``, ``replicas[i].faults/stop()/start()/running``.
On a failing test the tail of every process's log is printed.
"""

from __future__ import annotations

import glob
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from guard.lab.real.binaries import BinariesError, KubeBinaries, find
from guard.lab.real.controlplane import RealLab

SKIP_REASON = "real tier: no kube-apiserver binary (set GHOST_GUARD_KUBE_BIN or KUBEBUILDER_ASSETS)"
REPO = Path(__file__).resolve().parents[2]


def _uses_shared_lab(item: pytest.Item | None) -> bool:
    return item is not None and "real_lab" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)  # after a shuffle (pytest-randomly): the shared lab's tests still run in a row
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    mine = [i for i, item in enumerate(items) if here in Path(str(item.fspath)).parents]
    for i in mine:
        items[i].add_marker(pytest.mark.real)
    # The tests on the shared ``real_lab`` run one after the other (a stable sort of the real tier's own
    # slots: everything else keeps its place), so the shared control plane is started once and closed
    # as soon as the last of them is done (``pytest_runtest_teardown``), before another control plane starts.
    ordered = sorted((items[i] for i in mine), key=lambda item: not _uses_shared_lab(item))
    for i, item in zip(mine, ordered):
        items[i] = item


def _shared_tarballs() -> list[str]:
    return glob.glob(str(REPO.parent / "shared" / "k8s" / "*.tar.xz"))


@pytest.fixture(scope="session")
def kube_binaries() -> KubeBinaries:
    try:
        found = find(None)
    except BinariesError as e:
        pytest.fail(f"real tier: binaries named but unusable: {e}", pytrace=False)
    if found is None:
        if os.environ.get("CI", "").lower() == "true" and _shared_tarballs():
            pytest.fail("real tier: CI=true and ../shared/k8s holds a tarball, but GHOST_GUARD_KUBE_BIN is not set "
                        "(.ci/run exports it)", pytrace=False)
        pytest.skip(SKIP_REASON)
    return found


def _failed_since(request: pytest.FixtureRequest, before: int) -> bool:
    rep = getattr(request.node, "rep_call", None)
    if rep is not None:
        return bool(rep.failed)
    return request.session.testsfailed > before


def _factory(request: pytest.FixtureRequest, binaries: KubeBinaries) -> Iterator[Callable[..., RealLab]]:
    labs: list[RealLab] = []
    before = request.session.testsfailed

    def make(replicas: int = 2, *, scheduler: bool = False, controller_manager: bool = False, **options: object) -> RealLab:
        lab = RealLab(replicas=replicas, kube_bin=binaries, scheduler=scheduler, controller_manager=controller_manager,
                      **options)  # type: ignore[arg-type]
        labs.append(lab)
        return lab.start()

    try:
        yield make
    finally:
        for lab in labs:
            if _failed_since(request, before):
                print(f"\n--- real lab logs ({lab.out_dir}) ---\n{lab.logs()}")
            lab.close()


@pytest.fixture
def real_lab_factory(request: pytest.FixtureRequest, kube_binaries: KubeBinaries) -> Iterator[Callable[..., RealLab]]:
    yield from _factory(request, kube_binaries)


@pytest.fixture(scope="module")
def real_lab_module_factory(request: pytest.FixtureRequest, kube_binaries: KubeBinaries) -> Iterator[Callable[..., RealLab]]:
    yield from _factory(request, kube_binaries)


class _SharedLab:
    """The session's shared 2-replica RealLab: started by the first test that asks for ``real_lab``, closed
    once no test left to run asks for it (or at the session's end)."""

    def __init__(self) -> None:
        self.lab: RealLab | None = None

    def get(self, binaries: KubeBinaries) -> RealLab:
        if self.lab is None:
            self.lab = RealLab(replicas=2, kube_bin=binaries).start()
        return self.lab

    def close(self) -> None:
        lab, self.lab = self.lab, None
        if lab is not None:
            lab.close()


_shared = _SharedLab()


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (module-scoped ones on real_lab too) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if _shared.lab is None or _uses_shared_lab(nextitem):
        return
    items = item.session.items
    later = items[items.index(item) + 1:] if item in items else [nextitem]
    if not any(_uses_shared_lab(i) for i in later):  # the run order as it is, whatever reordered it
        _shared.close()


@pytest.fixture(scope="session")
def real_lab(kube_binaries: KubeBinaries) -> Iterator[RealLab]:
    """The shared 2-replica RealLab (see the module docstring). After each test on it
    (``_real_lab_after_test``): the logs printed if it failed, every fault cleared, a stopped replica
    started again, so the next test finds the lab as it was."""
    try:
        yield _shared.get(kube_binaries)
    finally:
        _shared.close()


@pytest.fixture(autouse=True)
def _real_lab_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    lab = _shared.lab
    if lab is None or "real_lab" not in request.fixturenames:
        return
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(f"\n--- real lab logs ({lab.out_dir}) ---\n{lab.logs()}")
    for r in lab.replicas:
        if r.proxy is not None:
            r.faults.clear()
        if not r.running:
            r.start()


@pytest.fixture
def real_namespace(real_lab: RealLab) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    real_lab.ensure_namespace(name)
    return name
