"""Versions and images agree across the package, the chart and the defaults users get."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from pdserve import __version__
from pdserve.api.spec import DEFAULT_GATEWAY_IMAGE

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "images").glob("*/Dockerfile"))


def test_chart_app_version_and_default_gateway_image_match_the_package() -> None:
    chart = yaml.safe_load((REPO / "charts" / "pdserve" / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert DEFAULT_GATEWAY_IMAGE.endswith(f":{__version__}")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfiles_follow_the_checklist(dockerfile: Path) -> None:
    """No Docker engine here, so the images cannot be built; this pins what hadolint would:
    pinned multi-stage base, a wheel built in the first stage, no caches, non-root, OCI labels."""
    text = dockerfile.read_text()
    bases = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert len(bases) == 2, "multi-stage: build a wheel, install it into a slim runtime"
    assert all(re.search(r":\d+\.\d+\.\d+", base) for base in bases), f"unpinned base in {bases}"
    assert "pip wheel" in text
    assert text.count("--no-cache-dir") >= 2
    assert re.search(r"^USER 10001$", text, re.MULTILINE)
    for label in ("title", "version", "source", "licenses"):
        assert f"org.opencontainers.image.{label}=" in text


def test_the_wheel_the_images_install_builds(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "--wheel-dir",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    [wheel] = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pdserve/cli.py" in names
    assert "pdserve/sim/engine_server.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)
