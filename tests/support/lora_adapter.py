"""A tiny LoRA adapter for the tiny test model (devtools/tiny_model.py), made at test time (no
adapter can be downloaded): PEFT's layout, which vLLM's `--lora-modules` loads, with random
weights that visibly change the model's greedy answer (PEFT starts B at zero, a no-op adapter;
here B is random too).

The weights are written as safetensors with numpy: this venv has neither torch nor the
safetensors package, and the format is a JSON header (names, dtypes, shapes, byte ranges) after
its little-endian length, then the raw little-endian arrays."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

# Attention projections vLLM supports for Qwen3; v_proj makes the prompt's KV itself depend on
# the adapter (what prefill hands decode), q_proj and o_proj change every answer visibly.
TARGETS = ("q_proj", "v_proj", "o_proj")
RANK = 8  # one of vLLM's --max-lora-rank choices
ALPHA = 16  # PEFT's scaling is alpha / rank
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"

Weights = dict[str, npt.NDArray[np.float32]]


def make_lora_adapter(out: Path, base: Path, *, seed: int, rank: int = RANK) -> Path:
    """Write an adapter for the model in `base` into `out` (created), its weights drawn from
    `seed` (another seed, another adapter); return `out`."""
    model = json.loads((base / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS, lora_weights(model, seed, rank))
    (out / CONFIG).write_text(json.dumps(peft_config(base, rank), indent=2) + "\n")
    return out


def lora_weights(model: dict[str, Any], seed: int, rank: int) -> Weights:
    """lora_A (rank x in) and lora_B (out x rank) of every target in every layer, named as PEFT
    names them. A is scaled by 1/sqrt(in) so that each layer's change stays of the order of its
    input."""
    rng = np.random.default_rng(seed)
    weights: Weights = {}
    for layer in range(model["num_hidden_layers"]):
        for module in TARGETS:
            fan_in, fan_out = projection_shape(model, module)
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = rng.standard_normal((rank, fan_in)) / np.sqrt(fan_in)
            weights[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
            weights[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, rank)).astype(
                np.float32
            )
    return weights


def projection_shape(model: dict[str, Any], module: str) -> tuple[int, int]:
    """(in features, out features) of a Qwen3 attention projection."""
    hidden = int(model["hidden_size"])
    head_dim = int(model.get("head_dim") or hidden // model["num_attention_heads"])
    queries = int(model["num_attention_heads"]) * head_dim
    keys = int(model["num_key_value_heads"]) * head_dim
    return {"q_proj": (hidden, queries), "k_proj": (hidden, keys), "v_proj": (hidden, keys),
            "o_proj": (queries, hidden)}[module]  # fmt: skip


def peft_config(base: Path, rank: int) -> dict[str, Any]:
    """adapter_config.json: what vLLM reads (r, lora_alpha, target_modules) and refuses (DoRA,
    biases, ...) set as a plain LoRA."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def write_safetensors(path: Path, tensors: Weights) -> None:
    """The safetensors file format: an 8-byte little-endian header length, the JSON header
    (padded with spaces to 8 bytes), then every tensor's bytes in the header's order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        blob = np.ascontiguousarray(tensor, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}  # fmt: skip
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
