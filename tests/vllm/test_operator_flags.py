"""Every vLLM command line the operator builds for examples/*.yaml (the GPU engines' `vllm serve`,
the render pool's `vllm launch render`) goes through real vLLM's own CLI parser, built as the
`vllm` command builds it, and the subcommand's own validation (tests/support/vllm_cli_check.py,
in the vLLM CPU venv): no unrecognized argument, no invalid choice, --kv-transfer-config valid
JSON that vLLM's KVTransferConfig holds field for field. Parsing needs neither a GPU nor the
model; `EngineArgs.create_engine_config()` needs the model's config on disk (the examples name
Hub models and PVC paths, not here), so each engine line also goes through it with the model
swapped for the tiny one (devtools/tiny_model.py) and what only the real model can answer
(--revision, a --max-model-len past the tiny model's 4,096 positions, a tensor parallel size past
its 2 attention heads, expert parallelism on a dense model) set aside. Multi-node lines are
checked as the first and the last pod of a group run them."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from devtools.tiny_model import ensure_tiny_model
from devtools.vllm_cpu import VLLM_VERSION, ensure_vllm_cpu
from pdserve.builders import build_all
from pdserve.builders.leaderworkerset import pod_template_of
from pdserve.builders.pod_security import WORKLOAD_KINDS
from pdserve.builders.vllm_args import LWS_LEADER_ADDRESS, LWS_WORKER_INDEX
from pdserve.contract.names import COMPONENT_LABEL
from pdserve.contract.pod_layout import CHAT_TEMPLATE_DIR
from pdserve.manifests import load_resources

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
CHECKER = ROOT / "tests" / "support" / "vllm_cli_check.py"
KV_FLAG = "--kv-transfer-config"
TINY_MAX_LEN = 4096  # the tiny model's max_position_embeddings
TINY_MAX_TP = 2  # the tiny model's attention heads: vLLM needs them divisible by TP
# Expert parallelism needs experts (the tiny model is dense) and EPLB a GPU: vLLM's config
# refuses both here, so the engine config is built without them (flag -> takes a value); the
# parse still checks them.
EXPERT_FLAGS = {"--enable-expert-parallel": False, "--all2all-backend": True,
                "--enable-eplb": False, "--eplb-config": True}  # fmt: skip


@dataclass(frozen=True)
class VllmLine:
    """One vLLM container's command line, as `vllm` receives it (argv after `vllm`)."""

    id: str
    argv: tuple[str, ...]

    @property
    def serve(self) -> bool:
        return self.argv[0] == "serve"

    def value(self, flag: str) -> str:
        return self.argv[self.argv.index(flag) + 1]


def operator_lines() -> list[VllmLine]:
    """Each distinct vLLM container command line of every example (slices that only differ in
    name run the same line once)."""
    lines: dict[tuple[str, ...], VllmLine] = {}
    for path in EXAMPLES:
        for dm in load_resources(path):
            for obj in build_all(dm):
                if obj["kind"] not in WORKLOAD_KINDS:
                    continue
                for container in pod_template_of(obj)["spec"]["containers"]:
                    if container["command"][:1] != ["vllm"]:
                        continue
                    argv = (*container["command"][1:], *container["args"])
                    component = obj["metadata"]["labels"][COMPONENT_LABEL]
                    for worker, line in group_members(argv):
                        member = "" if worker is None else f":w{worker}"
                        name = f"{path.stem}:{component}{member}"
                        lines.setdefault(line, VllmLine(name, line))
    return list(lines.values())


def group_members(argv: tuple[str, ...]) -> list[tuple[int | None, tuple[str, ...]]]:
    """A multi-node pod's line as its group's first and last pod run it: the kubelet expands
    $(LWS_WORKER_INDEX) and $(LWS_LEADER_ADDRESS) from the env LWS's webhook sets (the leader's
    name resolves in the cluster; an address here). Other lines as they are."""
    index = f"$({LWS_WORKER_INDEX})"
    if index not in argv:
        return [(None, argv)]
    nodes = int(argv[argv.index("--nnodes") + 1])
    return [
        (worker, tuple(arg.replace(index, str(worker))
                       .replace(f"$({LWS_LEADER_ADDRESS})", "127.0.0.1") for arg in argv))
        for worker in (0, nodes - 1)
    ]  # fmt: skip


LINES = operator_lines()


def on_this_host(line: VllmLine, template_dir: Path) -> list[str]:
    """The pod's chat-template mount (the user's ConfigMap) is a directory here with a real
    template in it: vLLM checks that the file exists."""
    return [arg.replace(CHAT_TEMPLATE_DIR, str(template_dir)) for arg in line.argv]


def with_tiny_model(argv: list[str], model: Path) -> list[str]:
    """An engine line for create_engine_config: the tiny model in place of the example's."""
    out = [argv[0], str(model)]
    rest = iter(argv[2:])
    for arg in rest:
        if arg == "--revision":
            next(rest)  # a Hub commit of the real model
        elif arg == "--max-model-len":
            out += [arg, str(min(int(next(rest)), TINY_MAX_LEN))]
        elif arg == "--tensor-parallel-size":
            out += [arg, str(min(int(next(rest)), TINY_MAX_TP))]
        elif arg in EXPERT_FLAGS:
            if EXPERT_FLAGS[arg]:
                next(rest)
        else:
            out.append(arg)
    return out


@pytest.fixture(scope="module")
def vllm_says(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Real vLLM's verdict on every line, from one process of the vLLM CPU venv."""
    env = ensure_vllm_cpu()
    model = ensure_tiny_model(env)
    template_dir = tmp_path_factory.mktemp("chat-template")
    (template_dir / "template.jinja").write_text((model / "chat_template.jinja").read_text())
    items: list[dict[str, Any]] = []
    for line in LINES:
        argv = on_this_host(line, template_dir)
        items.append({"argv": argv, "engine_config": False})
        if line.serve:
            items.append({"argv": with_tiny_model(argv, model), "engine_config": True})
    done = subprocess.run(
        [str(env.python), "-P", str(CHECKER)], input=json.dumps(items), capture_output=True,
        text=True, timeout=600,
        env={**{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")},
             "VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    results = iter(answer["results"])
    verdicts: dict[str, Any] = {"version": answer["vllm"]}
    for line in LINES:
        verdicts[line.id] = next(results)
        if line.serve:
            verdicts[f"{line.id}:engine_config"] = next(results)
    return verdicts


def test_every_example_is_checked_and_vllm_is_the_pinned_one(vllm_says: dict[str, Any]) -> None:
    assert vllm_says["version"] == f"{VLLM_VERSION}+cpu"
    checked = {line.id.split(":")[0] for line in LINES}
    assert checked == {path.stem for path in EXAMPLES}
    assert {line.argv[0] for line in LINES} == {"serve", "launch"}
    assert any(KV_FLAG in line.argv for line in LINES)
    assert any("--nnodes" in line.argv for line in LINES)  # a multi-node example is checked


@pytest.mark.parametrize("line", LINES, ids=lambda line: line.id)
def test_vllm_parses_what_the_operator_emits(line: VllmLine, vllm_says: dict[str, Any]) -> None:
    verdict = vllm_says[line.id]
    assert "error" not in verdict, f"vllm {' '.join(line.argv)}\n{verdict['error']}"
    parsed = verdict["parsed"]
    assert parsed["model"] == line.argv[2 if line.argv[0] == "launch" else 1]
    assert parsed["port"] == int(line.value("--port"))
    assert parsed["served_model_name"] == [line.value("--served-model-name")]
    if not line.serve:
        assert parsed["renderer_num_workers"] == int(line.value("--renderer-num-workers"))
        return
    assert parsed["tensor_parallel_size"] == int(line.value("--tensor-parallel-size"))
    assert parsed["block_size"] == int(line.value("--block-size"))
    assert parsed["tokens_only"] is ("--tokens-only" in line.argv)
    assert parsed["enable_scale_out"] is ("--enable-scale-out" in line.argv)
    if KV_FLAG not in line.argv:
        assert parsed["kv_transfer_config"] is None
        return
    assert parsed["enable_expert_parallel"] is ("--enable-expert-parallel" in line.argv)
    assert parsed["enable_eplb"] is ("--enable-eplb" in line.argv)
    if "--all2all-backend" in line.argv:
        assert parsed["all2all_backend"] == line.value("--all2all-backend")
    if "--eplb-config" in line.argv:
        emitted_eplb = json.loads(line.value("--eplb-config"))
        assert {k: parsed["eplb_config"][k] for k in emitted_eplb} == emitted_eplb
    emitted = json.loads(line.value(KV_FLAG))
    held = parsed["kv_transfer_config"]
    assert {key: held[key] for key in emitted} == emitted, "vLLM holds another KV config"


@pytest.mark.parametrize("line", [line for line in LINES if line.serve], ids=lambda line: line.id)
def test_vllm_builds_an_engine_config_from_the_engine_flags(
    line: VllmLine, vllm_says: dict[str, Any]
) -> None:
    verdict = vllm_says[f"{line.id}:engine_config"]
    assert "engine_config_error" not in verdict, verdict.get("engine_config_error")
    config = verdict["parsed"]["engine_config"]
    assert config["block_size"] == int(line.value("--block-size"))
    assert config["tensor_parallel_size"] == min(
        int(line.value("--tensor-parallel-size")), TINY_MAX_TP
    )
    role = json.loads(line.value(KV_FLAG))["kv_role"] if KV_FLAG in line.argv else None
    assert config["kv_role"] == role
    parallel = config["parallel"]
    ranks = int(line.value("--data-parallel-size"))
    assert parallel["data_parallel_size"] == ranks
    if "--nnodes" not in line.argv:
        assert parallel["nnodes"] == 1
        return
    # A pod of a multi-node group: vLLM derives its ranks from --nnodes and --node-rank, and
    # serves them in hybrid load balancing (every pod answers HTTP for its own ranks).
    nodes, node = int(line.value("--nnodes")), int(line.value("--node-rank"))
    local = ranks // nodes
    assert (parallel["nnodes"], parallel["node_rank"]) == (nodes, node)
    assert parallel["data_parallel_size_local"] == local
    assert parallel["data_parallel_rank"] == node * local
    assert parallel["data_parallel_hybrid_lb"] is True
    assert parallel["data_parallel_external_lb"] is False
