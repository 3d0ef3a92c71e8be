"""The layers of pyproject.toml's [tool.importlinter]: pure modules do no I/O, only guard.kube
imports kubernetes, the serving path never imports the lab or certificate generation.

Each contract of pyproject.toml must be reported kept, by name; and the same
checker, given the same configuration plus one contract the code breaks, must
fail and name it (so a checker that reads no contract, or checks nothing,
cannot pass here).
"""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]


def lint_imports(*args: str) -> tuple[int, str]:
    """(exit code, output with every run of whitespace made one space: the report wraps long names)."""
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    r = subprocess.run([exe, "--no-cache", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    return r.returncode, " ".join((r.stdout + r.stderr).split())


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(path: Path, contracts: list[dict]) -> None:
    """The project's [tool.importlinter] settings with ``contracts``, as a TOML file lint-imports reads."""
    lines = ["[tool.importlinter]"]
    lines += [f"{k} = {toml_value(v)}" for k, v in CONFIG.items() if k != "contracts"]
    for contract in contracts:
        lines += ["", "[[tool.importlinter.contracts]]"]
        lines += [f"{k} = {toml_value(v)}" for k, v in contract.items()]
    path.write_text("\n".join(lines) + "\n")


def test_every_contract_is_kept():
    assert CONFIG["contracts"], "pyproject.toml declares no import contract"
    code, out = lint_imports()
    assert code == 0, out
    for contract in CONFIG["contracts"]:
        assert f"{contract['name']} KEPT" in out, f"contract not reported kept: {contract['name']!r}\n{out}"


def module_names() -> list[str]:
    """Every module of the guard package, dotted (``guard.lab.harness``), packages by their ``__init__``."""
    names = []
    for path in sorted((REPO / "guard").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.append(".".join(parts))
    return names


def test_every_module_is_registered_as_pure_or_io():
    """A new module is named in the first contract: a source there (pure) or, itself or its package,
    a forbidden module there (I/O), so the pure modules cannot start importing it unnoticed."""
    pure = next(c for c in CONFIG["contracts"] if c["name"].startswith("Pure modules"))
    io = [m for m in pure["forbidden_modules"] if m.startswith("guard.")]

    def registered(name: str) -> bool:
        return name in pure["source_modules"] or any(name == m or name.startswith(m + ".") for m in io)

    assert registered("guard.lab.harness") and "guard.lab.harness" not in pure["source_modules"]
    unregistered = [n for n in module_names() if n not in ("guard", "guard.__main__") and not registered(n)]
    assert unregistered == [], f"add them to pyproject.toml's first import contract: {unregistered}"


def test_a_broken_contract_fails_the_check(tmp_path):
    broken = {"name": "The server never reads its settings (false on purpose)", "type": "forbidden",
              "source_modules": ["guard.server"], "forbidden_modules": ["guard.settings"]}
    config = tmp_path / "importlinter.toml"
    write_config(config, [*CONFIG["contracts"], broken])
    code, out = lint_imports("--config", str(config))
    assert code != 0, out
    assert f"{broken['name']} BROKEN" in out, out
    for contract in CONFIG["contracts"]:
        assert f"{contract['name']} KEPT" in out, out
