"""Where pdserve's pods keep what it mounts and which names it uses: the builders lay pods out
by these, and spec podOverrides may not collide with them."""

from __future__ import annotations

MODEL_MOUNT = "/models"
"""A model from a PersistentVolumeClaim (the model argument of every vLLM process)."""
CHAT_TEMPLATE_DIR = "/etc/pdserve/chat-template"
PEER_KEY_DIR = "/etc/pdserve/peer-key"
ROUTING_DIR = "/etc/pdserve/routing"
"""The gateway's routing config (its ConfigMap)."""
HF_CACHE = "/root/.cache/huggingface"
"""The engines' Hugging Face download (they run as root)."""
NON_ROOT_HOME = "/home/pdserve"
"""HOME for a CPU pod running an image built for root: a writable emptyDir where vLLM keeps its
caches and config (~/.cache/vllm, ~/.config/vllm) and Hugging Face its downloads."""
SHM_MOUNT = "/dev/shm"
PROBE_MOUNT = "/opt/pdserve-probe"

MOUNT_PATHS = (
    MODEL_MOUNT,
    "/etc/pdserve",
    HF_CACHE,
    NON_ROOT_HOME,
    SHM_MOUNT,
    PROBE_MOUNT,
)
"""Every path under which pdserve mounts a volume of its own."""
VOLUMES = frozenset(
    {"model", "hf-cache", "home", "chat-template", "dshm", "routing", "peer-key", "probe"}
)
"""The names of pdserve's own volumes."""
CONTAINERS = frozenset({"vllm", "render", "gateway", "probe"})
"""The names of pdserve's own containers."""
LABEL_PREFIXES = ("app.kubernetes.io/", "pdserve.io/")
"""Label keys pdserve sets (selectors, the model, the slice)."""
