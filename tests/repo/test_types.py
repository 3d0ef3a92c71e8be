"""Types: mypy with pyproject.toml's [tool.mypy], strict on the pure modules, the default checks on the rest of guard/.

The second test checks that configuration, not just today's code: mypy reads a pure module
and an I/O module with one bad function added to each (``--shadow-file``, the files on disk
are not touched) and must reject a type error in both, an unannotated function in the pure
module only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PURE, IO = "guard/core/verdict.py", "guard/engine/checker.py"
UNTYPED = "\n\ndef _untyped_helper(x):\n    return x\n"
WRONG = '\n\ndef _wrong_type() -> int:\n    return "not an int"\n'


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def mypy(cache_dir: Path, *args: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache_dir), "--no-error-summary", *args],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    return r.returncode, r.stdout + r.stderr


def test_guard_type_checks(cache_dir):
    code, out = mypy(cache_dir)
    assert code == 0, out


def test_the_check_fails_on_type_errors_and_is_strict_on_pure_modules(cache_dir, tmp_path):
    shadows = []
    for module in (PURE, IO):
        shadow = tmp_path / Path(module).name
        shadow.write_text((REPO / module).read_text() + UNTYPED + WRONG)
        shadows += ["--shadow-file", module, str(shadow)]
    code, out = mypy(cache_dir, *shadows)
    assert code == 1, out
    errors = {(line.split(":")[0], line.rsplit("[", 1)[-1].rstrip("]"))
              for line in out.splitlines() if ": error: " in line}
    assert errors == {(PURE, "return-value"), (PURE, "no-untyped-def"), (IO, "return-value")}, out
