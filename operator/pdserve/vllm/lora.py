"""vLLM's LoRA facts the operator, the render pool's settings and the simulator share (vLLM 0.32:
vllm/config/lora.py, vllm/envs.py)."""

from __future__ import annotations

# --max-lora-rank's choices (MaxLoRARanks); any other value makes `vllm serve` exit at start.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# --max-lora-rank's default: an adapter of a higher rank is refused when it loads.
DEFAULT_MAX_LORA_RANK = 16
# A server with this set serves any `model` name: how `vllm launch render`, which has no LoRA
# support, renders an adapter's request (passing the name on to the engines).
SKIP_MODEL_NAME_CHECK = "VLLM_SKIP_MODEL_NAME_VALIDATION"
