from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import __version__
from pdserve.cli import main


def test_version_subcommand_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == __version__


def test_no_subcommand_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: pdserve" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"pdserve {__version__}"
