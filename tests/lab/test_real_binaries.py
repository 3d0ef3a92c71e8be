"""``guard.lab.real.binaries``: where the real control-plane binaries come from (flag, then
GHOST_GUARD_KUBE_BIN, then KUBEBUILDER_ASSETS), tarballs unpacked once, and clear errors."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from guard.lab.real.binaries import BinariesError, find, resolve


def _bin_dir(path, names=("kube-apiserver", "kube-scheduler")):
    path.mkdir(parents=True, exist_ok=True)
    for n in names:
        f = path / n
        f.write_text("#!/bin/sh\n")
        f.chmod(0o755)
    return path


def _tarball(path, prefix=""):
    with tarfile.open(path, "w:xz") as tf:
        for n in ("kube-apiserver", "kube-controller-manager"):
            data = b"#!/bin/sh\n"
            info = tarfile.TarInfo(prefix + n)
            info.size, info.mode = len(data), 0o755
            tf.addfile(info, io.BytesIO(data))
    return path


def test_precedence_flag_then_ghost_guard_variable_then_kubebuilder_assets(tmp_path, monkeypatch):
    a, b, c = (_bin_dir(tmp_path / x) for x in "abc")
    monkeypatch.setenv("GHOST_GUARD_KUBE_BIN", str(b))
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(c))
    assert (find(str(a)).dir, find(str(a)).source) == (a, "--kube-bin")
    assert (find(None).dir, find(None).source) == (b, "GHOST_GUARD_KUBE_BIN")
    monkeypatch.delenv("GHOST_GUARD_KUBE_BIN")
    assert (find(None).dir, find(None).source) == (c, "KUBEBUILDER_ASSETS")
    monkeypatch.delenv("KUBEBUILDER_ASSETS")
    assert find(None) is None


def test_optional_binaries_and_require(tmp_path):
    found = resolve(_bin_dir(tmp_path / "d"))
    assert found.kube_scheduler == tmp_path / "d" / "kube-scheduler"
    assert found.kube_controller_manager is None
    with pytest.raises(BinariesError, match=r"kube-controller-manager not found in .*/d \(from --kube-bin\)"):
        found.require("kube-controller-manager")


def test_tarball_unpacked_once_into_the_cache(tmp_path):
    tb = _tarball(tmp_path / "kubernetes-v9.9.9-linux-amd64.tar.xz", prefix="kubernetes/server/bin/")
    cache = tmp_path / "cache"
    first = resolve(tb, cache=cache)
    assert first.dir.name == "bin" and first.kube_controller_manager is not None
    assert os.access(first.kube_apiserver, os.X_OK)
    marker = first.dir / "marker"
    marker.write_text("x")
    again = resolve(tmp_path, cache=cache)  # a directory holding one tarball: the same cached copy
    assert again.dir == first.dir and marker.exists()


@pytest.mark.parametrize(("setup", "message"), [
    (lambda p: p / "missing", "no such file or directory"),
    (lambda p: _bin_dir(p / "e", names=("kubectl",)), "no kube-apiserver in"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "neither a directory nor a"),
], ids=["missing", "no-apiserver", "not-a-tarball"])
def test_clear_errors(tmp_path, setup, message):
    with pytest.raises(BinariesError, match=message):
        resolve(setup(tmp_path))


def test_a_variable_naming_nothing_usable_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("GHOST_GUARD_KUBE_BIN", str(tmp_path / "nope"))
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(_bin_dir(tmp_path / "ok")))
    with pytest.raises(BinariesError, match="GHOST_GUARD_KUBE_BIN="):
        find(None)


def test_not_executable(tmp_path):
    d = _bin_dir(tmp_path / "d")
    (d / "kube-apiserver").chmod(0o644)
    with pytest.raises(BinariesError, match="is not executable"):
        resolve(d)
