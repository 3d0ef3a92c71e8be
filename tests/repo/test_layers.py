"""The layers of pyproject.toml's [tool.importlinter]: the folders of guard/ are the layers (one
``layers`` contract, bottom up core, metrics, kube, audit, engine, http, serving, tools, lab, cli),
guard.core does no I/O, only the guard/kube package (and the lab) imports kubernetes, nothing below guard.http
imports a web library.

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


def layers() -> list[str]:
    (contract,) = [c for c in CONFIG["contracts"] if c["type"] == "layers"]
    return contract["layers"]


def test_every_module_lives_in_a_layer():
    """A new module goes into a layer's folder (or is one of the layers), so the one layers contract covers it."""
    assert "guard.core" in layers() and layers()[-1] == "guard.core", layers()

    def placed(name: str) -> bool:
        return any(name == layer or name.startswith(layer + ".") for layer in layers())

    unplaced = [n for n in module_names() if n not in ("guard", "guard.__main__") and not placed(n)]
    assert unplaced == [], f"put them in a layer's folder (or add a layer to pyproject.toml): {unplaced}"


def test_a_planted_upward_import_fails_the_layers_contract(tmp_path):
    """A copy of the package with one upward import (a pure rule importing the running guard) breaks the
    layers contract and only it: the contract is read and checked, not merely declared."""
    shutil.copytree(REPO / "guard", tmp_path / "guard", ignore=shutil.ignore_patterns("__pycache__"))
    verdict = tmp_path / "guard" / "core" / "verdict.py"
    verdict.write_text(verdict.read_text() + "\nfrom guard.engine import checker  # planted upward import\n")
    config = tmp_path / "importlinter.toml"
    write_config(config, CONFIG["contracts"])
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    r = subprocess.run([exe, "--no-cache", "--config", str(config)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "200", "PYTHONPATH": str(tmp_path)})
    out = " ".join((r.stdout + r.stderr).split())
    (contract,) = [c for c in CONFIG["contracts"] if c["type"] == "layers"]
    assert r.returncode != 0, out
    assert f"{contract['name']} BROKEN" in out, out
    assert "guard.core.verdict -> guard.engine.checker" in out, out


def test_a_broken_contract_fails_the_check(tmp_path):
    broken = {"name": "The server never reads its settings (false on purpose)", "type": "forbidden",
              "source_modules": ["guard.serving.server"], "forbidden_modules": ["guard.core.settings"]}
    config = tmp_path / "importlinter.toml"
    write_config(config, [*CONFIG["contracts"], broken])
    code, out = lint_imports("--config", str(config))
    assert code != 0, out
    assert f"{broken['name']} BROKEN" in out, out
    for contract in CONFIG["contracts"]:
        assert f"{contract['name']} KEPT" in out, out
