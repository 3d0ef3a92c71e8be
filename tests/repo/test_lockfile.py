"""The locks the image installs from agree with pyproject.toml.

requirements.lock pins every runtime dependency ([project].dependencies) and
their dependencies; requirements-build.lock pins the build backend
([build-system].requires). The Dockerfile installs both with
``pip install --require-hashes --no-deps``, so an entry without a hash or
without an exact version would fail the image build, and a dependency missing
from the lock would be missing from the image. These tests fail first, in CI.
Regenerate the locks with the commands in docs/INSTALL.md ("Updating the
dependency locks").
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import InvalidRequirement, Requirement  # packaging: a dependency of pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
RUNTIME_LOCK = REPO / "requirements.lock"
BUILD_LOCK = REPO / "requirements-build.lock"
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


@dataclass
class Entry:
    name: str
    version: str | None  # the exact version, None when the entry is not `name==version`
    hashes: list[str]
    line: str


def entries(text: str) -> tuple[list[Entry], list[str]]:
    """(entries, problems) of a pip requirements file in hash-checking form."""
    out, problems = [], []
    logical, buf = [], ""
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() and not buf:
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append((buf + line).strip())
        buf = ""
    if buf.strip():
        logical.append(buf.strip())
    for line in logical:
        if not line:
            continue
        if line.startswith("-"):
            problems.append(f"option line not allowed in a lock: {line[:80]!r}")
            continue
        spec = HASH.sub("", line).strip()
        hashes = HASH.findall(line)
        if "--hash=" in spec:
            problems.append(f"{spec[:60]!r}: a hash that is not sha256:<64 hex>")
        try:
            req = Requirement(spec)
        except InvalidRequirement as e:
            problems.append(f"{spec[:80]!r}: {e}")
            continue
        pins = list(req.specifier)
        version = pins[0].version if len(pins) == 1 and pins[0].operator == "==" and "*" not in pins[0].version else None
        if version is None:
            problems.append(f"{req.name}: pinned as {str(req.specifier)!r}, not ==VERSION")
        if req.url:
            problems.append(f"{req.name}: a direct URL, not an index release")
        if not hashes:
            problems.append(f"{req.name}: no --hash=sha256:")
        out.append(Entry(canonicalize_name(req.name), version, hashes, line))
    seen: set[str] = set()
    for e in out:
        if e.name in seen:
            problems.append(f"{e.name}: listed twice")
        seen.add(e.name)
    return out, problems


def lock_problems(lock_text: str, requirements: list[str]) -> list[str]:
    """Everything wrong with ``lock_text`` as the lock of ``requirements`` (PEP 508 strings)."""
    locked, problems = entries(lock_text)
    by_name = {e.name: e for e in locked}
    for spec in requirements:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate({"sys_platform": "linux", "platform_system": "Linux"}):
            continue
        entry = by_name.get(canonicalize_name(req.name))
        if entry is None:
            problems.append(f"{spec}: not in the lock")
        elif entry.version is not None and not req.specifier.contains(Version(entry.version), prereleases=True):
            problems.append(f"{spec}: the lock pins {entry.name}=={entry.version}, outside the range")
    return problems


def runtime_requirements() -> list[str]:
    return PYPROJECT["project"]["dependencies"]


def build_requirements() -> list[str]:
    return PYPROJECT["build-system"]["requires"]


@pytest.mark.parametrize("lock,requirements", [(RUNTIME_LOCK, runtime_requirements), (BUILD_LOCK, build_requirements)],
                         ids=["runtime", "build"])
def test_lock_pins_every_requirement_with_hashes(lock, requirements):
    assert lock.exists(), f"{lock.name} is missing: docs/INSTALL.md says how to generate it"
    assert lock_problems(lock.read_text(), requirements()) == []


def test_runtime_lock_covers_the_dependencies_of_what_it_pins():
    """Every entry is there because something needs it: pyproject.toml or another locked package
    (uv's `# via` annotations); a stale entry, or one whose reason was removed, means a stale lock."""
    text = RUNTIME_LOCK.read_text()
    locked, _ = entries(text)
    names = {e.name for e in locked}
    direct = {canonicalize_name(Requirement(r).name) for r in runtime_requirements()}
    assert direct <= names
    blocks = re.split(r"^(?=[A-Za-z0-9])", text, flags=re.M)
    for block in blocks[1:]:
        name = canonicalize_name(re.match(r"[A-Za-z0-9._-]+", block).group(0))
        via = set(re.findall(r"^\s+#\s+(?:via\s+)?([A-Za-z0-9._-]+)", block, re.M)) - {"via"}
        via = {canonicalize_name(v) for v in via}
        assert via, f"{name}: no `# via` annotation (generate the lock with uv pip compile, docs/INSTALL.md)"
        reasons = via & (names | {"kube-ghost-guard"})
        assert reasons, f"{name} is in the lock for {sorted(via)}, none of which is pinned or the project"
        if name in direct:
            assert "kube-ghost-guard" in via, f"{name} is a direct dependency but the lock does not say so"


def test_locks_target_the_image_python():
    """The locks were resolved for the Python of the Dockerfile's base image (requires-python admits it)."""
    dockerfile = (REPO / "Dockerfile").read_text()
    m = re.search(r"^ARG PYTHON_IMAGE=python:(3\.\d+)\.(\d+)-", dockerfile, re.M)
    assert m, "Dockerfile: ARG PYTHON_IMAGE=python:3.X.Y-... not found"
    minor = m.group(1)
    from packaging.specifiers import SpecifierSet

    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(f"{minor}.{m.group(2)}")
    for lock in (RUNTIME_LOCK, BUILD_LOCK):
        header = lock.read_text().split("\n", 3)[:3]
        command = next((h for h in header if "uv pip compile" in h), "")
        assert f"--python-version {minor}" in command, f"{lock.name} header {header!r}: not resolved for Python {minor}"
        assert "--generate-hashes" in command


BAD_LOCKS = {
    "no hash": ("flask==3.1.0\n", ["flask>=3.0"], "no --hash"),
    "a range": ("flask>=3.0 \\\n    --hash=sha256:" + "a" * 64 + "\n", ["flask>=3.0"], "not ==VERSION"),
    "outside the range": ("flask==2.3.3 \\\n    --hash=sha256:" + "a" * 64 + "\n", ["flask>=3.0"], "outside the range"),
    "missing": ("click==8.1.7 \\\n    --hash=sha256:" + "b" * 64 + "\n", ["flask>=3.0"], "not in the lock"),
    "short hash": ("flask==3.1.0 \\\n    --hash=sha256:abc\n", ["flask>=3.0"], "not sha256"),
    "index option": ("--index-url https://example.invalid/simple\nflask==3.1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n",
                     ["flask>=3.0"], "option line"),
    "twice": (("flask==3.1.0 \\\n    --hash=sha256:" + "a" * 64 + "\n") * 2, ["flask>=3.0"], "listed twice"),
}


@pytest.mark.parametrize("case", sorted(BAD_LOCKS))
def test_lock_problems_are_found(case):
    text, requirements, expected = BAD_LOCKS[case]
    problems = lock_problems(text, requirements)
    assert any(expected in p for p in problems), problems


def test_a_good_lock_passes():
    text = ("# comment\nflask==3.1.0 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64 +
            "\n    # via kube-ghost-guard (pyproject.toml)\ncolorama==0.4.6 ; sys_platform == 'win32' \\\n"
            "    --hash=sha256:" + "c" * 64 + "\n")
    assert lock_problems(text, ["flask>=3.0", "colorama>=0.4; sys_platform == 'win32'"]) == []
