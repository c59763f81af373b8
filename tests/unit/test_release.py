"""Versions and images agree across the package, the chart and the defaults users get."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

from pdserve import __version__
from pdserve.api.images import DEFAULT_GATEWAY_IMAGE

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "images" / "Dockerfile"
PAUSE_DOCKERFILE = REPO / "images" / "pause" / "Dockerfile"


def test_chart_app_version_and_default_gateway_image_match_the_package() -> None:
    chart = yaml.safe_load((REPO / "charts" / "pdserve" / "Chart.yaml").read_text())
    assert chart["appVersion"] == __version__
    assert DEFAULT_GATEWAY_IMAGE.endswith(f":{__version__}")


def stages(text: str) -> dict[str, str]:
    """Each stage's name and what it is built FROM, in order."""
    return {name: base for base, name in re.findall(r"^FROM (\S+) AS (\S+)$", text, re.MULTILINE)}


def test_dockerfile_follows_the_checklist() -> None:
    """What hadolint would pin: multi-stage from a pinned base, a wheel built in the first
    stage, no caches, each shipped target non-root with OCI labels."""
    text = DOCKERFILE.read_text()
    built = stages(text)
    assert {"build", "runtime", "sim", "pdserve"} <= set(built), built
    external = [base for base in built.values() if base not in built]
    assert external, "no base image"
    assert all(re.search(r":\d+\.\d+\.\d+", base) for base in external), f"unpinned: {external}"
    assert "pip wheel" in text
    assert text.count("--no-cache-dir") >= 2

    def body(stage: str) -> str:
        return re.split(r"^FROM ", text.split(f" AS {stage}\n", 1)[1], flags=re.MULTILINE)[0]

    for label in ("version", "source", "licenses"):  # on the stage both targets build on
        assert f"org.opencontainers.image.{label}=" in body("runtime"), label
    for target in ("sim", "pdserve"):
        assert built[target] == "runtime", target
        assert re.search(r"^USER 10001$", body(target), re.MULTILINE), target
        assert "org.opencontainers.image.title=" in body(target), target


def test_pause_image_is_static_and_unprivileged() -> None:
    text = PAUSE_DOCKERFILE.read_text()
    assert re.findall(r"^FROM (\S+)", text, re.MULTILINE) == ["scratch"]
    assert re.search(r"^USER 65535:65535$", text, re.MULTILINE)


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
