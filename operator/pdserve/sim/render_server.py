"""Simulated `vllm launch render`: /render and /derender with vLLM's field names and errors.

Stateless like the real one: streaming derender carries its state in `stream_state`, and every
chunk re-decodes and re-parses the whole output so far (vLLM rebuilds its parser per chunk), so
the CPU cost of per-token derender calls is real and shows in the parser-load metrics."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from pdserve.sim.chat import (
    BUILTIN_TEMPLATES,
    ChatError,
    ChatTemplate,
    OutputParser,
    ReasoningParser,
    ToolParser,
)
from pdserve.sim.http import (
    HttpError,
    error_response,
    health,
    metrics_response,
    read_json,
    version,
)
from pdserve.sim.render_derender import Derenderer
from pdserve.sim.render_metrics import RenderMetrics
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm.protocol import SAMPLING_DEFAULT_MAX_TOKENS

SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": [],
    "stop_token_ids": [],
    "min_tokens": 0,
    "logprobs": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
}


LEGACY_CONSTRAINTS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # fmt: skip


def structured_outputs(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The output constraint vLLM's render puts in the sampling params (None: none): from
    structured_outputs, response_format (json_schema, json_object, structural_tag), the older
    guided_* parameters, and a forced tool call (tool_choice required or a named function),
    which vLLM forces with the JSON schema of the call."""
    constraint: dict[str, Any] = dict(body.get("structured_outputs") or {})
    response_format = body.get("response_format")
    fmt: Mapping[str, Any] = response_format if isinstance(response_format, Mapping) else {}
    kind = fmt.get("type")
    if kind == "json_schema":
        constraint["json"] = (fmt.get("json_schema") or {}).get("schema") or {}
    elif kind == "json_object":
        constraint["json_object"] = True
    elif kind == "structural_tag":
        constraint["structural_tag"] = json.dumps(fmt)
    for legacy, key in LEGACY_CONSTRAINTS.items():
        if body.get(legacy) is not None:
            constraint[key] = body[legacy]
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, Mapping):
        constraint["json"] = tool_call_schema(body.get("tools") or [], choice)
    return constraint or None


def tool_call_schema(tools: list[Any], choice: Any) -> dict[str, Any]:
    """The JSON schema of a forced call: the named function's arguments, or (required) a
    non-empty list of calls to any of the tools."""
    functions = [t.get("function") or {} for t in tools if isinstance(t, Mapping)]
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name")
        named = next((f for f in functions if f.get("name") == name), {})
        return dict(named.get("parameters") or {})
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.get("name")}, "parameters": f.get("parameters")},
            "required": ["name", "parameters"],
        }
        for f in functions
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def check_model(
    name: str, adapters: Mapping[str, str], model: Any, *, any_model: bool = False
) -> str:
    """The `model` a request names, when served (the model, one of its adapters, or any with
    any_model); else vLLM's 404 (entrypoints/serve/engine/serving.py _check_model)."""
    if not model:
        return name
    if model == name or model in adapters or any_model:
        return str(model)
    raise HttpError(404, f"The model `{model}` does not exist. Valid aliases: {name}.", "model")


@dataclass
class RenderConfig:
    model: str = "sim-model"
    served_model_name: str | None = None
    max_model_len: int = 32768
    chat_template: str = BUILTIN_TEMPLATES["qwen3"]
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    adapters: Mapping[str, str] = field(default_factory=dict)
    """LoRA adapters served beside the model (an engine's --lora-modules), name -> path."""
    any_model: bool = False
    """VLLM_SKIP_MODEL_NAME_VALIDATION: any `model` name is taken and passed on."""

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names; None: the base model."""
        return model if model and model != self.name and model in self.adapters else None


class RenderServer:
    def __init__(self, config: RenderConfig, tokenizer: SimTokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or SimTokenizer()
        self.template = ChatTemplate(config.chat_template, config.default_chat_template_kwargs)
        self.parser = OutputParser(
            ReasoningParser(config.reasoning_parser) if config.reasoning_parser else None,
            ToolParser(config.tool_call_parser) if config.tool_call_parser else None,
        )
        if config.enable_auto_tool_choice and config.tool_call_parser is None:
            raise ChatError("--enable-auto-tool-choice needs --tool-call-parser")
        self.metrics = RenderMetrics()
        self.derenderer = Derenderer(config.name, self.tokenizer, self.parser, self.metrics)

    # ---- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        routes = {
            "/v1/chat/completions/render": self.chat_render,
            "/v1/completions/render": self.completion_render,
            "/v1/chat/completions/derender": self.chat_derender,
            "/v1/completions/derender": self.completion_derender,
            "/tokenize": self.tokenize,
            "/detokenize": self.detokenize,
        }
        for path, handler in routes.items():
            app.router.add_post(path, self._wrap(path, handler))
        app.router.add_get("/health", health)
        app.router.add_get("/version", version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    def _wrap(self, path: str, handler: Any) -> Any:
        async def run(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            try:
                response: web.StreamResponse = await handler(await read_json(request))
            except HttpError as error:
                response = error_response(error.status, error.message, error.param)
            except ChatError as error:
                response = error_response(400, str(error))
            self.metrics.requests.labels(path, str(response.status)).inc()
            status = f"{response.status // 100}xx"
            self.metrics.http_requests.labels(request.method, status, path).inc()
            elapsed = time.perf_counter() - started
            self.metrics.http_duration.labels(request.method, path).observe(elapsed)
            return response

        return run

    async def models(self, _: web.Request) -> web.Response:
        """The model, then its LoRA adapters with the model as their parent, as vLLM lists
        them (entrypoints/openai/models/serving.py)."""
        model = {
            "id": self.config.name, "object": "model", "created": 0, "owned_by": "pdserve-sim",
            "root": self.config.model, "max_model_len": self.config.max_model_len,
        }  # fmt: skip
        adapters = [
            {"id": name, "object": "model", "created": 0, "owned_by": "pdserve-sim",
             "root": path, "parent": self.config.name, "max_model_len": None}
            for name, path in self.config.adapters.items()
        ]  # fmt: skip
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        return metrics_response(self.metrics.registry)

    async def chat_derender(self, body: dict[str, Any]) -> web.Response:
        return await self.derenderer.chat_derender(body)

    async def completion_derender(self, body: dict[str, Any]) -> web.Response:
        return await self.derenderer.completion_derender(body)

    # ---- render --------------------------------------------------------------------------------
    def _check_model(self, body: Mapping[str, Any]) -> str:
        return check_model(self.config.name, self.config.adapters, body.get("model"),
                           any_model=self.config.any_model)  # fmt: skip

    def sampling_params(
        self, body: Mapping[str, Any], prompt_len: int, *, chat: bool
    ) -> dict[str, Any]:
        if body.get("use_beam_search"):
            raise HttpError(
                400, "beam search is not supported by the render server", "use_beam_search"
            )
        # max_completion_tokens is a chat field: vLLM's CompletionRequest has none (it ignores it).
        limit = body.get("max_tokens")
        if chat:
            limit = body.get("max_completion_tokens", limit)
        room = self.config.max_model_len - prompt_len
        if limit is None:
            limit = room
        if not isinstance(limit, int) or limit < 1:
            raise HttpError(400, "max_tokens must be a positive integer", "max_tokens")
        if prompt_len + limit > self.config.max_model_len:
            raise HttpError(
                400,
                f"This model's maximum context length is {self.config.max_model_len} tokens. "
                f"However, you requested {prompt_len + limit} tokens ({prompt_len} in the "
                f"messages, {limit} in the completion). Please reduce the length of the "
                "messages or completion.",
                "max_tokens",
            )
        params = {key: body.get(key, default) for key, default in SAMPLING_DEFAULTS.items()}
        if isinstance(params["stop"], str):
            params["stop"] = [params["stop"]]
        # vLLM's render leaves every SamplingParams field equal to its default out of its answer;
        # max_tokens is the one a tokens engine then resolves differently (the whole context
        # left, not 16), so the simulator leaves it out just as vLLM does.
        if limit != SAMPLING_DEFAULT_MAX_TOKENS:
            params["max_tokens"] = limit
        params["structured_outputs"] = structured_outputs(body)
        extra: dict[str, Any] = dict(body.get("vllm_xargs") or {})
        if body.get("kv_transfer_params") is not None:
            extra["kv_transfer_params"] = body["kv_transfer_params"]
        params["extra_args"] = extra or None
        return params

    def generate_request(
        self, body: Mapping[str, Any], token_ids: list[int], *, chat: bool
    ) -> dict[str, Any]:
        if not token_ids:
            raise HttpError(400, "the prompt is empty", "messages")
        return {
            "request_id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "token_ids": token_ids,
            "features": None,
            "sampling_params": self.sampling_params(body, len(token_ids), chat=chat),
            "model": self._check_model(body),
            "stream": bool(body.get("stream", False)),
            "stream_options": body.get("stream_options"),
            "cache_salt": body.get("cache_salt"),
            "priority": body.get("priority", 0),
        }

    async def chat_render(self, body: dict[str, Any]) -> web.Response:
        self._check_model(body)
        # vLLM's default with tools: auto (ChatCompletionRequest.check_tool_usage).
        tool_choice = body.get("tool_choice", "auto" if body.get("tools") else None)
        if tool_choice == "auto" and body.get("tools") and not self.config.enable_auto_tool_choice:
            raise HttpError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                "tool_choice",
            )
        kwargs = {**(body.get("chat_template_kwargs") or {})}
        text = self.template.render(
            body.get("messages"),
            tools=body.get("tools") if tool_choice != "none" else None,
            add_generation_prompt=body.get("add_generation_prompt", True),
            kwargs=kwargs,
        )
        return web.json_response(
            self.generate_request(body, self.tokenizer.encode(text), chat=True)
        )

    async def completion_render(self, body: dict[str, Any]) -> web.Response:
        self._check_model(body)
        prompt = body.get("prompt")
        prompts: list[list[int]]
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        else:
            raise HttpError(
                400, "prompt must be a string, a list of strings or token ids", "prompt"
            )
        return web.json_response([self.generate_request(body, ids, chat=False) for ids in prompts])

    async def tokenize(self, body: dict[str, Any]) -> web.Response:
        if "messages" in body:
            text = self.template.render(
                body["messages"],
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
            )
        else:
            text = str(body.get("prompt", ""))
        ids = self.tokenizer.encode(text)
        return web.json_response(
            {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids}
        )

    async def detokenize(self, body: dict[str, Any]) -> web.Response:
        try:
            return web.json_response(
                {"prompt": self.tokenizer.decode(list(body.get("tokens", [])))}
            )
        except (ValueError, TypeError) as error:
            raise HttpError(400, str(error), "tokens") from None
