"""vLLM's image names: the render pool's default (the CPU image of the engine's release), and
every vLLM image named in the examples, the docs and the chart spelled as vLLM publishes it,
at the release the operator defaults to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.api.images import (
    DEFAULT_ENGINE_IMAGE,
    VLLM_CPU_REPOSITORY,
    VLLM_CUDA_REPOSITORY,
    VLLM_VERSION,
    ImageSpec,
    vllm_cpu_image,
)

REPO = Path(__file__).resolve().parents[3]
SCANNED = ("examples", "docs", "charts", "README.md")
# Any mention of an image of Docker Hub's vllm organisation (all named vllm-*, unlike a path
# such as vllm/derender_gaps.py), with its tag when it has one.
VLLM_IMAGE = re.compile(
    r"(?<![\w/.-])(?:docker\.io/)?vllm/(vllm[\w.-]*?)(?::([\w.-]+))?(?=[^\w.:-]|$)"
)
PUBLISHED = {VLLM_CUDA_REPOSITORY.removeprefix("vllm/"), VLLM_CPU_REPOSITORY.removeprefix("vllm/")}
# A release tag (an arch or CUDA variant may follow), or the docs' placeholder for one.
RELEASE_TAG = re.compile(r"^(v\d+\.\d+\.\d+)(-[\w.]+)?$|^vX\.Y\.Z$")


def scanned_files() -> list[Path]:
    files: list[Path] = []
    for name in SCANNED:
        path = REPO / name
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [f for f in files if f.suffix in (".md", ".yaml", ".yml", ".tpl", ".txt", "")]


def mentions() -> list[tuple[str, int, str, str | None]]:
    found = []
    for path in scanned_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in VLLM_IMAGE.finditer(line):
                where = f"{path.relative_to(REPO)}:{number}"
                found.append((where, number, match.group(1), match.group(2)))
    return found


def test_the_scan_sees_the_default_image() -> None:
    assert any(repo == "vllm-openai" for _, _, repo, _ in mentions())


def test_every_vllm_image_named_follows_vllms_published_naming() -> None:
    wrong = [
        f"{where}: vllm/{repo}{':' + tag if tag else ''}"
        for where, _, repo, tag in mentions()
        if repo not in PUBLISHED or (tag is not None and not RELEASE_TAG.match(tag))
    ]
    assert not wrong, (
        "vLLM publishes vllm/vllm-openai:vX.Y.Z (CUDA) and vllm/vllm-openai-cpu:vX.Y.Z (CPU) "
        "only; fix these (or leave spec.image.render unset for the CPU image):\n" + "\n".join(wrong)
    )


def test_every_vllm_release_named_is_the_operators_default() -> None:
    stale = [
        f"{where}: vllm/{repo}:{tag}"
        for where, _, repo, tag in mentions()
        if tag is not None and tag != "vX.Y.Z" and not tag.startswith(VLLM_VERSION)
    ]
    assert not stale, f"images.py's VLLM_VERSION is {VLLM_VERSION}:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    ("engine", "cpu"),
    [
        (DEFAULT_ENGINE_IMAGE, f"vllm/vllm-openai-cpu:{VLLM_VERSION}"),
        ("vllm/vllm-openai:v0.31.2", "vllm/vllm-openai-cpu:v0.31.2"),
        ("docker.io/vllm/vllm-openai:v0.29.0-cu129", "docker.io/vllm/vllm-openai-cpu:v0.29.0"),
        ("vllm/vllm-openai:latest", None),
        ("vllm/vllm-openai@sha256:" + "0" * 64, None),
        ("vllm/vllm-openai", None),
        ("registry.example.com:5000/vllm/vllm-openai:v0.33.0", None),
        ("ghcr.io/pdserve/pdserve-sim:0.1.0", None),
    ],
)
def test_the_cpu_image_of_an_engine_image(engine: str, cpu: str | None) -> None:
    assert vllm_cpu_image(engine) == cpu


def test_the_render_pool_defaults_to_the_cpu_image_else_the_engines() -> None:
    assert ImageSpec().render_image == f"{VLLM_CPU_REPOSITORY}:{VLLM_VERSION}"
    own = "registry.example.com/my-vllm:1"
    assert ImageSpec(engine=own).render_image == own
    assert ImageSpec(render="r:1").render_image == "r:1"
