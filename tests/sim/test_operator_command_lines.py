"""The exact command lines the operator builds run in the simulator, and the four stages work
together: render -> prefill (do_remote_decode) -> decode (kv_transfer_params) -> derender."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.localplane import free_port, wait_until
from pdserve.builders import build_all
from pdserve.manifests import load_resources
from pdserve.vllm.protocol import prefill_handoff_params

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen2.5-7b-pd.yaml"


def command_lines() -> dict[str, list[str]]:
    [dm] = load_resources(EXAMPLE)
    lines = {}
    for obj in build_all(dm):
        if obj["kind"] in ("StatefulSet", "Deployment") and not obj["metadata"]["name"].endswith(
            "-gateway"
        ):
            container = obj["spec"]["template"]["spec"]["containers"][0]
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            lines[component] = [*container["command"], *container["args"]]
    return lines


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One simulator process per pool, started with the operator's command line."""
    logs = tmp_path_factory.mktemp("sim-pods")
    processes, urls = [], {}
    env = {
        **os.environ,
        "PDSERVE_SIM_TIME_SCALE": "0.02",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    }
    try:
        for component, argv in command_lines().items():
            assert argv[0] == "vllm"
            port = free_port()
            args = list(argv[1:])
            args[args.index("--port") + 1] = str(port)
            log = (logs / f"{component}.log").open("wb")
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pdserve.cli", "sim", "vllm", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
            urls[component] = f"http://127.0.0.1:{port}"
        for component, url in urls.items():
            health = f"{url}/health"
            wait_until(f"the {component} simulator", lambda: _up(health), timeout=30)  # noqa: B023
        yield urls
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def _up(url: str) -> bool:
    return httpx.get(url).status_code == 200


def test_operator_command_lines_are_accepted_by_the_simulator() -> None:
    lines = command_lines()
    assert set(lines) == {"prefill", "decode", "render"}
    assert lines["render"][:3] == ["vllm", "launch", "render"]
    assert "--enable-scale-out" in lines["prefill"]  # the default spec.render.engineApi


def test_four_stage_request_through_the_operators_pools(pods: dict[str, str]) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    chat: dict[str, Any] = {
        "model": "qwen25-7b",
        "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": tools,
        "tool_choice": "auto",
        "max_tokens": 128,
    }
    with httpx.Client(timeout=30) as http:
        generate = http.post(f"{pods['render']}/v1/chat/completions/render", json=chat).json()
        handoff = prefill_handoff_params()
        prefill_body = {
            **generate,
            "kv_transfer_params": handoff,
            "sampling_params": {**generate["sampling_params"], "max_tokens": 1},
        }
        prefilled = http.post(f"{pods['prefill']}/inference/v1/generate", json=prefill_body).json()
        params = prefilled["kv_transfer_params"]
        assert params["remote_num_tokens"] == len(generate["token_ids"])
        decoded = http.post(
            f"{pods['decode']}/inference/v1/generate",
            json={**generate, "kv_transfer_params": params},
        )
        assert decoded.status_code == 200, decoded.text
        answer = http.post(
            f"{pods['render']}/v1/chat/completions/derender",
            json={
                "stream": False,
                "model": "qwen25-7b",
                "generate_response": decoded.json(),
                "prompt_tokens": len(generate["token_ids"]),
                "prompt_token_ids": generate["token_ids"],
                "chat_request": chat,
            },
        ).json()
    [choice] = answer["choices"]
    # vLLM 0.32's whole-answer derender says "stop" (the gateway then says "tool_calls").
    assert choice["finish_reason"] == "stop"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city"}
    assert answer["usage"]["prompt_tokens"] == len(generate["token_ids"])
