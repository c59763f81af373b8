"""`make release REGISTRY=...`: a release's artefacts, each naming exactly what it contains.

- The images (devtools/images.py: the Python packages from images/*.lock, with hashes) pushed
  to REGISTRY by devtools/publish.py, referred to by the digests the registry stored;
- the chart packaged (`helm package`) with those references written into its values.yaml:
  `image.repository`, `image.tag` and `image.digest`, so an install of the package runs the
  pushed operator and, through it, the same gateway image, whatever a tag later points to;
- dist/release.json: the version, each image's reference and digest, the base image's and the
  locks' digests, and the chart package's sha256.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from devtools.clitools import ensure_cli_tools
from devtools.images import BASE_IMAGE, Builder, ImageBuildError, image_cache, version
from devtools.publish import Published, Pushed, publish
from devtools.pylock import locks

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "pdserve"
DIST = ROOT / "dist"


def pinned_values(values: str, pushed: Pushed) -> str:
    """The chart's values.yaml with its `image:` block naming ``pushed`` (comments kept)."""
    block = re.search(r"^image:\n((?:[ #].*\n|\n)*)", values, re.MULTILINE)
    if block is None:
        raise ImageBuildError("charts/pdserve/values.yaml has no top-level `image:` block")
    body = block[1]
    for key, value in (("repository", pushed.repository), ("tag", pushed.tag),
                       ("digest", pushed.digest)):  # fmt: skip
        body, found = re.subn(rf"^  {key}: .*$", f"  {key}: {json.dumps(value)}", body,
                              count=1, flags=re.MULTILINE)  # fmt: skip
        if not found:
            raise ImageBuildError(f"charts/pdserve/values.yaml: no `image.{key}` to pin")
    return values[: block.start(1)] + body + values[block.end(1) :]


def package_chart(pushed: Pushed, out: Path) -> Path:
    """`helm package` of the chart with its image pinned to ``pushed``; the package's path."""
    helm = ensure_cli_tools().helm
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        chart = Path(work) / CHART.name
        shutil.copytree(CHART, chart)
        values = chart / "values.yaml"
        values.write_text(pinned_values(values.read_text(), pushed))
        packaged = subprocess.run([str(helm), "package", str(chart), "-d", str(out)],
                                  capture_output=True, text=True, check=False)  # fmt: skip
    if packaged.returncode != 0:
        raise ImageBuildError(f"helm package failed:\n{packaged.stdout}{packaged.stderr}")
    return Path(packaged.stdout.strip().rsplit(": ", 1)[-1])


def sha256_of(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _image(pushed: Pushed) -> dict[str, str]:
    return {"reference": pushed.reference, "tag": f"{pushed.repository}:{pushed.tag}"}


def manifest(published: Published, chart: Path, base_digest: str) -> dict[str, Any]:
    return {
        "version": version(),
        "images": {"pdserve": _image(published.pdserve), "sim": _image(published.sim)},
        "base": {"name": BASE_IMAGE, "digest": base_digest},
        "locks": {lock.path.name: sha256_of(lock.path) for lock in locks()},
        "chart": {"file": chart.name, "sha256": sha256_of(chart)},
    }


def release(registry: str, *, cert_dir: Path | None = None, out: Path = DIST) -> Path:
    published = publish(registry, cert_dir=cert_dir)
    base_digest = (
        Builder(image_cache())
        .buildah("images", "--format", "{{.Digest}}", BASE_IMAGE, step="base image digest")
        .split()[0]
    )
    chart = package_chart(published.pdserve, out)
    path = out / "release.json"
    path.write_text(json.dumps(manifest(published, chart, base_digest), indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make release", description=__doc__)
    parser.add_argument("registry", help="host[:port][/path] the images are pushed under")
    parser.add_argument("--cert-dir", type=Path, help="directory of CA certificates (*.crt)")
    args = parser.parse_args(argv)
    try:
        path = release(args.registry, cert_dir=args.cert_dir)
    except ImageBuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
