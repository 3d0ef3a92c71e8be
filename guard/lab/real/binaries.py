"""Find the real control-plane binaries: ``--kube-bin DIR``, then ``$GHOST_GUARD_KUBE_BIN``, then
``$KUBEBUILDER_ASSETS`` (controller-runtime envtest's convention).

Each names a directory holding ``kube-apiserver`` (and optionally ``kube-scheduler``,
``kube-controller-manager``, ``etcd``, ``kubectl``) or a release tarball
(``kubernetes-*-linux-amd64.tar.xz``, ``.tar.gz``, ``.tgz``; or a directory holding exactly one
such tarball), which is unpacked once into a cache directory
(``$XDG_CACHE_HOME/ghost-guard/kube-bin/<tarball name>-<size>``) and reused.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV_VARS = ("GHOST_GUARD_KUBE_BIN", "KUBEBUILDER_ASSETS")
TARBALL_SUFFIXES = (".tar.xz", ".tar.gz", ".tgz")
NAMES = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "etcd", "kubectl")


class BinariesError(RuntimeError):
    """The binaries named by a flag or variable are missing or unusable (the message says which and why)."""


@dataclass(frozen=True)
class KubeBinaries:
    """Paths of the binaries found (None: not in that directory). ``source``: where they were named
    (``--kube-bin``, ``GHOST_GUARD_KUBE_BIN`` or ``KUBEBUILDER_ASSETS``) and ``dir`` the directory used."""

    dir: Path
    source: str
    kube_apiserver: Path
    kube_scheduler: Path | None = None
    kube_controller_manager: Path | None = None
    etcd: Path | None = None
    kubectl: Path | None = None

    def require(self, name: str) -> Path:
        """The path of ``name`` (``kube-scheduler``, ...), or BinariesError naming the directory."""
        path = getattr(self, name.replace("-", "_"), None)
        if path is None:
            raise BinariesError(f"{name} not found in {self.dir} (from {self.source})")
        return path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ghost-guard" / "kube-bin"


def _is_tarball(path: Path) -> bool:
    return path.is_file() and path.name.endswith(TARBALL_SUFFIXES)


def unpack(tarball: Path, cache: Path | None = None) -> Path:
    """Unpack ``tarball`` once into the cache; returns the directory holding ``kube-apiserver``."""
    st = tarball.stat()
    target = (cache or cache_root()) / f"{tarball.name}-{st.st_size}"
    found = _find_apiserver_dir(target) if target.is_dir() else None
    if found is not None:
        return found
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        try:
            with tarfile.open(tarball) as tf:
                tf.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError) as e:
            raise BinariesError(f"cannot unpack {tarball}: {e}") from e
        try:
            os.rename(tmp, target)  # atomic: a concurrent unpack of the same tarball loses the race harmlessly
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = _find_apiserver_dir(target)
    if found is None:
        raise BinariesError(f"{tarball} holds no kube-apiserver")
    return found


def _find_apiserver_dir(root: Path) -> Path | None:
    """``root`` or the directory under it (release tarballs: ``kubernetes/server/bin``) holding kube-apiserver."""
    if (root / "kube-apiserver").is_file():
        return root
    for dirpath, _dirs, files in os.walk(root):
        if "kube-apiserver" in files:
            return Path(dirpath)
    return None


def _executable(path: Path) -> Path | None:
    if path.is_file():
        if not os.access(path, os.X_OK):
            raise BinariesError(f"{path} is not executable")
        return path
    return None


def resolve(path: str | os.PathLike[str], source: str = "--kube-bin", *, cache: Path | None = None) -> KubeBinaries:
    """The binaries in ``path`` (a directory or a release tarball); BinariesError saying what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        raise BinariesError(f"{source}={path}: no such file or directory")
    if p.is_dir() and not (p / "kube-apiserver").exists():
        tarballs = sorted(x for x in p.iterdir() if _is_tarball(x))
        if len(tarballs) == 1:
            p = tarballs[0]
        elif len(tarballs) > 1:
            raise BinariesError(f"{source}={path}: no kube-apiserver and several tarballs ({', '.join(t.name for t in tarballs)})")
    if _is_tarball(p):
        d = unpack(p, cache)
    elif p.is_dir():
        d = p
    else:
        raise BinariesError(f"{source}={path}: neither a directory nor a {'/'.join(TARBALL_SUFFIXES)} tarball")
    apiserver = _executable(d / "kube-apiserver")
    if apiserver is None:
        raise BinariesError(f"{source}={path}: no kube-apiserver in {d}")
    found = {n.replace("-", "_"): _executable(d / n) for n in NAMES[1:]}
    return KubeBinaries(dir=d, source=source, kube_apiserver=apiserver, **found)


def named(flag: str | None = None) -> tuple[str, str] | None:
    """(source, value) of the first of ``--kube-bin``, ``$GHOST_GUARD_KUBE_BIN``, ``$KUBEBUILDER_ASSETS`` that is set."""
    if flag:
        return "--kube-bin", flag
    for var in ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return var, value
    return None


def find(flag: str | None = None, *, cache: Path | None = None) -> KubeBinaries | None:
    """The binaries named by ``flag``, else the environment; None when nothing names any.
    BinariesError when something names binaries that are not there (never a silent fallback)."""
    which = named(flag)
    if which is None:
        return None
    return resolve(which[1], which[0], cache=cache)
