"""The package graph's contracts (pyproject.toml [tool.importlinter], run by `make lint`) hold on
this tree and catch a forbidden import: the gateway reaching into the operator."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{root / 'operator'}{os.pathsep}{root}"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_tree_keeps_every_contract() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_gateway_module_importing_the_controller_breaks_two_contracts(tmp_path: Path) -> None:
    skip = shutil.ignore_patterns("__pycache__", "bin-src", "golden")
    for package in ("operator/pdserve", "devtools", "tests"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=skip)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "operator" / "pdserve" / "gateway" / "shortcut.py").write_text(
        "from pdserve.controller import reconcile  # noqa: F401\n"
    )
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    assert "the processes never import each other BROKEN" in result.stdout
    assert "know nothing of the operator or the" in result.stdout
    assert "pdserve.gateway.shortcut -> pdserve.controller.reconcile" in result.stdout
