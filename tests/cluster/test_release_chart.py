"""`make release`'s chart package: the pushed image pinned by digest in its values, so that an
install of the package (helm's own render of the .tgz) runs exactly that operator, and hands
the same reference to every gateway; the rest of values.yaml unchanged, comments included."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from devtools.clitools import ensure_cli_tools
from devtools.publish import Pushed
from devtools.release import CHART, package_chart, pinned_values

PUSHED = Pushed(source="ghcr.io/pdserve/pdserve:0.1.0",
                repository="registry.example.com:5000/team/pdserve", tag="0.1.0",
                digest="sha256:" + "ab" * 32)  # fmt: skip


def test_the_packaged_chart_runs_the_pushed_image_by_digest(tmp_path: Path) -> None:
    package = package_chart(PUSHED, tmp_path)
    assert package.is_file(), package
    assert package.suffix == ".tgz", package
    rendered = subprocess.run(
        [str(ensure_cli_tools().helm), "template", "pdserve", str(package), "-n", "pdserve-system"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    objects: list[dict[str, Any]] = [o for o in yaml.safe_load_all(rendered) if o]
    operator = next(o for o in objects if o["kind"] == "Deployment")
    container = operator["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == PUSHED.reference
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env["PDSERVE_GATEWAY_IMAGE"] == PUSHED.reference


def test_only_the_image_lines_of_the_values_change() -> None:
    values = (CHART / "values.yaml").read_text()
    pinned = pinned_values(values, PUSHED)
    changed = [(a, b) for a, b in zip(values.splitlines(), pinned.splitlines(), strict=True)
               if a != b]  # fmt: skip
    assert changed == [
        ("  repository: ghcr.io/pdserve/pdserve", f'  repository: "{PUSHED.repository}"'),
        ('  tag: ""', '  tag: "0.1.0"'),
        ('  digest: ""', f'  digest: "{PUSHED.digest}"'),
    ]
    assert yaml.safe_load(pinned)["image"]["digest"] == PUSHED.digest
