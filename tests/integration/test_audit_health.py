"""A broken audit disk degrades the audit record only: never the verdicts, never readiness.

A real guard on the shared lab writes its audit store on a small tmpfs. The disk is filled
during the run, then freed; another store is on ext4 that turns read-only during the run (a
filesystem error with errors=remount-ro); another guard starts with its store on a read-only
mount, which is then made writable. Throughout, ghosts are rejected and live pods pass, ``/readyz`` stays 200,
and the store's health is told three ways: ``ghost_guard_audit_store_healthy``, one log line per
change, and ``details.audit_store`` in ``/readyz``'s body. Needs root (mount); skipped otherwise.
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from guard.audit.backend import GuardAudit
from guard.core.settings import Settings
from guard.lab.harness import eventually, pod_manifest

pytestmark = pytest.mark.timeout(120)
# Each step blocks a new ghost that never existed, to make an audit write: these test the store, not the flood
# budget for such ghosts (--unsighted-ghost-rate/-burst, tests/integration/test_forged_flood.py), so it is lifted.
UNBUDGETED = ["--unsighted-ghost-rate", "1000", "--unsighted-ghost-burst", "100000"]

NAMES = ["n1", "n2"]


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def disk(tmp_path: Path):
    """A 256 KiB tmpfs, unmounted after the test."""
    path = tmp_path / "disk"
    path.mkdir()
    try:
        mount("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {getattr(e, 'stderr', e)}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Write a file until the disk is full; returns it."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == 28, e  # ENOSPC
    finally:
        os.close(fd)
    return filler


def pod(namespace: str, name: str, uid: str) -> dict:
    return {"Pod": {"metadata": {"name": name, "namespace": namespace, "uid": uid}}, "Nodes": None,
            "NodeNames": NAMES}


def rejected(reply: dict) -> bool:
    return reply["NodeNames"] == [] and sorted(reply["FailedAndUnresolvableNodes"]) == NAMES


def audit_detail(g) -> dict:
    resp = g.session.get(g.url("/readyz"), timeout=5)
    assert resp.status_code == 200, resp.text  # never a reason to leave the Service
    return resp.json()["details"]["audit_store"]


class Verdicts:
    """Live pods pass and new ghosts are rejected, whatever the audit store does."""

    def __init__(self, g, lab, namespace: str) -> None:
        self.g, self.namespace, self.n = g, namespace, 0
        self.live = lab.core_v1(0).create_namespaced_pod(namespace, pod_manifest("live"), _request_timeout=5)

    def check(self) -> None:
        self.n += 1
        name, uid = f"ghost-{self.n}", str(uuid.uuid4())

        def blocked() -> bool:
            ghost = self.g.post("/filter", pod(self.namespace, name, uid))
            assert ghost.status_code == 200, ghost.text
            return rejected(ghost.json())

        # The ghost's quorum GET may time out on a loaded machine (seen once: the answer fails open, as designed,
        # and kube-scheduler asks again): asked again; a pass is only ever that fail-open, never a verdict.
        eventually(blocked, 30, what=f"ghost {name} rejected", interval=0.1, process=self.g)
        verdicts = set(self.g.verdicts(uid))
        assert verdicts <= {"unknown", "ghost-deleted"}, verdicts
        live = self.g.post("/filter", pod(self.namespace, "live", self.live.metadata.uid))
        assert live.status_code == 200 and live.json()["NodeNames"] == NAMES, live.text


def test_audit_disk_full_during_a_run(shared_lab, lab_namespace, start_guard, disk):
    g = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--audit-db", str(disk / "audit.db"), "--no-events",
                     "--no-prepare", *UNBUDGETED])
    verdicts = Verdicts(g, shared_lab, lab_namespace)
    verdicts.check()
    assert audit_detail(g)["writable"] is True
    assert g.metric("ghost_guard_audit_store_healthy") == 1

    filler = fill(disk)

    def noticed() -> bool:
        verdicts.check()  # each check blocks a new ghost: an audit write
        return g.metric("ghost_guard_audit_store_healthy") == 0

    eventually(noticed, 30, what="the full disk noticed", interval=0.3, process=g)
    for _ in range(3):
        verdicts.check()
    detail = eventually(lambda: (d := audit_detail(g))["writable"] is False and d, 10, what="/readyz detail")
    assert "full" in detail["error"], detail
    assert detail["failures"] >= 1
    assert g.metric("ghost_guard_audit_write_errors_total") >= 1
    assert g.logs(tail=None).count("cannot be written") == 1, g.logs()  # once per change, not per write

    filler.unlink()
    eventually(lambda: audit_detail(g)["writable"] is True, 10, what="the freed disk noticed", process=g)
    assert g.metric("ghost_guard_audit_store_healthy") == 1
    assert g.logs(tail=None).count("is writable again") == 1
    verdicts.check()


@pytest.fixture
def ext4(tmp_path: Path):
    """A 16 MiB ext4 on a loop device, mounted with errors=remount-ro: (its mount point, a function that
    makes it read-only at once with a filesystem error, as a failing disk does: the kernel's own
    trigger_fs_error)."""
    image, mnt = tmp_path / "disk.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    try:
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, text=True)
        mount("-o", "loop,errors=remount-ro", str(image), str(mnt))
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount an ext4 loop device here: {getattr(e, 'stderr', e)}")
    device = subprocess.run(["findmnt", "-n", "-o", "SOURCE", str(mnt)], check=True, capture_output=True,
                            text=True).stdout.strip().rsplit("/", 1)[-1]

    def break_it() -> None:
        Path(f"/sys/fs/ext4/{device}/trigger_fs_error").write_text("ghost-guard test: disk turns read-only")
        options = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", str(mnt)], capture_output=True,
                                 text=True).stdout.strip().split(",")
        assert {"ro", "emergency_ro"} & set(options), options  # Linux 6.x says emergency_ro

    try:
        yield mnt, break_it
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_audit_disk_turns_read_only_during_a_run(shared_lab, lab_namespace, start_guard, ext4):
    mnt, break_it = ext4
    g = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--audit-db", str(mnt / "audit.db"),
                     "--no-events", "--no-prepare", *UNBUDGETED])
    verdicts = Verdicts(g, shared_lab, lab_namespace)
    verdicts.check()
    assert audit_detail(g)["writable"] is True

    break_it()

    def noticed() -> bool:
        verdicts.check()
        return g.metric("ghost_guard_audit_store_healthy") == 0

    eventually(noticed, 30, what="the read-only disk noticed", interval=0.3, process=g)
    for _ in range(3):
        verdicts.check()
    detail = eventually(lambda: (d := audit_detail(g))["writable"] is False and d, 10, what="/readyz detail")
    assert detail["error"], detail
    assert g.logs(tail=None).count("cannot be written") == 1, g.logs()


def test_a_write_that_changes_nothing_does_not_call_a_read_only_disk_writable_again(ext4, caplog):
    """In process, step by step: the disk turns read-only; a probe older than the one stored commits
    without writing a page, so it returns even there. Seen in CI: the guard logged "writable again",
    then "cannot be written" 20 ms later. Only the store's own write probe may say it is writable again."""
    mnt, break_it = ext4
    audit = GuardAudit.open(Settings(audit_db=str(mnt / "audit.db")))

    def probe(at: float) -> None:
        audit.write("probe", "a probe", lambda store: store.record_probe(
            uid="u1", replica="10.0.0.1:6443", serves=True, cache_resource_version="7", error=None, at=at))

    audit.write("block", "a block", lambda store: store.record_block(
        uid="u1", namespace="ns", name="g1", verdict="ghost-deleted", evidence={}, at=100.0))
    probe(100.0)
    assert audit.health.healthy is True
    break_it()
    with caplog.at_level(logging.WARNING, logger="guard.incident"):
        audit.write("block", "a block", lambda store: store.record_block(
            uid="u2", namespace="ns", name="g2", verdict="ghost-deleted", evidence={}, at=101.0))
        assert audit.health.healthy is False
        probe(50.0)  # older than the stored probe: changes nothing, and returns
        assert audit.store is not None and audit.store.check() is not None  # the disk is still read-only
        assert audit.health.healthy is False, caplog.text
        assert audit.health.detail()["writable"] is False
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot be written" in m for m in messages) == 1, messages
    assert not any("writable again" in m for m in messages), messages
    audit.store.close()


def test_audit_disk_read_only(shared_lab, lab_namespace, start_guard, disk, tmp_path):
    view = tmp_path / "ro"
    view.mkdir()
    mount("--bind", str(disk), str(view))
    try:
        mount("-o", "remount,bind,ro", str(view))
        g = start_guard(["--kubeconfig", shared_lab.kubeconfig(0), "--audit-db", str(view / "audit.db"),
                         "--no-events", "--no-prepare", *UNBUDGETED])  # waits for /readyz 200
        verdicts = Verdicts(g, shared_lab, lab_namespace)
        verdicts.check()
        detail = audit_detail(g)
        assert detail["writable"] is False and "not writable" in detail["error"], detail
        assert g.metric("ghost_guard_audit_store_healthy") == 0
        assert g.metric("ghost_guard_audit_write_errors_total", operation="open") >= 1
        verdicts.check()

        mount("-o", "remount,bind,rw", str(view))
        eventually(lambda: audit_detail(g)["writable"] is True, 10, what="the store opened once writable", process=g)
        assert g.metric("ghost_guard_audit_store_healthy") == 1
        verdicts.check()
        assert os.path.exists(view / "audit.db")
        assert g.logs(tail=None).count("cannot be written") == 1 and g.logs(tail=None).count("is writable again") == 1, g.logs()
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)
