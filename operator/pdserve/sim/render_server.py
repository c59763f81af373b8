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
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from pdserve.sim.chat import (
    BUILTIN_TEMPLATES,
    ChatError,
    ChatTemplate,
    OutputParser,
    ReasoningParser,
    ToolParser,
)
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm.protocol import usage

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


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }
    return web.json_response(body, status=status)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HttpError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


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

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


# prometheus-fastapi-instrumentator's default buckets, as vLLM's API servers expose them.
HTTP_BUCKETS = (0.1, 0.5, 1.0)


class RenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # What a real `vllm launch render` exposes: HTTP metrics per handler (its parse load is
        # the busy time of the render/derender handlers) and the process's CPU.
        self.http_requests = Counter(
            "http_requests",
            "Total number of requests by method, status and handler.",
            ["method", "status", "handler"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler.",
            ["method", "handler"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)
        self.requests = Counter(
            "pdserve_sim_render_requests",
            "Requests by endpoint and status",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.inflight_derender = Gauge(
            "pdserve_sim_render_inflight_derender",
            "Derender calls in flight",
            registry=self.registry,
        )
        self.parse_cpu = Counter(
            "pdserve_sim_render_parse_cpu_seconds",
            "CPU seconds spent decoding and parsing output",
            registry=self.registry,
        )
        self.derender_calls = Counter(
            "pdserve_sim_render_derender_calls",
            "Derender calls",
            ["stream"],
            registry=self.registry,
        )
        self.streams = Counter(
            "pdserve_sim_render_derender_streams",
            "Streams started (first chunk derendered)",
            registry=self.registry,
        )


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
        app.router.add_get("/health", self.health)
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

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdserve-sim",
                        "root": self.config.model,
                        "max_model_len": self.config.max_model_len,
                    }
                ],
            }
        )

    async def metrics_endpoint(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), content_type="text/plain", charset="utf-8"
        )

    # ---- render --------------------------------------------------------------------------------
    def _check_model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model") or self.config.name
        if model != self.config.name:
            raise HttpError(404, f"The model `{model}` does not exist.", "model")
        return str(model)

    def sampling_params(self, body: Mapping[str, Any], prompt_len: int) -> dict[str, Any]:
        if body.get("use_beam_search"):
            raise HttpError(
                400, "beam search is not supported by the render server", "use_beam_search"
            )
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
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
        params["max_tokens"] = limit
        extra: dict[str, Any] = dict(body.get("vllm_xargs") or {})
        if body.get("kv_transfer_params") is not None:
            extra["kv_transfer_params"] = body["kv_transfer_params"]
        params["extra_args"] = extra or None
        return params

    def generate_request(
        self, body: Mapping[str, Any], token_ids: list[int], prefix: str
    ) -> dict[str, Any]:
        if not token_ids:
            raise HttpError(400, "the prompt is empty", "messages")
        return {
            "request_id": f"{prefix}-{uuid.uuid4().hex}",
            "token_ids": token_ids,
            "features": None,
            "sampling_params": self.sampling_params(body, len(token_ids)),
            "model": self._check_model(body),
            "stream": bool(body.get("stream", False)),
            "stream_options": body.get("stream_options"),
            "cache_salt": body.get("cache_salt"),
            "priority": body.get("priority", 0),
        }

    async def chat_render(self, body: dict[str, Any]) -> web.Response:
        self._check_model(body)
        tool_choice = body.get("tool_choice")
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
            self.generate_request(body, self.tokenizer.encode(text), "chatcmpl")
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
        return web.json_response([self.generate_request(body, ids, "cmpl") for ids in prompts])

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

    # ---- derender ------------------------------------------------------------------------------
    def _parse(
        self,
        token_ids: list[int],
        chat_request: Mapping[str, Any] | None,
        *,
        final: bool,
        call_ids: list[str],
    ) -> tuple[str, Any]:
        started = time.process_time()
        try:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        except ValueError as error:
            raise HttpError(400, str(error), "token_ids") from None
        text = text.replace("<|im_end|>", "").replace("<|endoftext|>", "")
        if chat_request is None:
            parsed = None  # vLLM: plain detokenization, markup stays in content
        else:
            tools_requested = (
                bool(chat_request.get("tools")) and chat_request.get("tool_choice") != "none"
            )
            parsed = self.parser.parse(
                text, final=final, tools_requested=tools_requested, call_ids=call_ids
            )
        self.metrics.parse_cpu.inc(time.process_time() - started)
        return text, parsed

    @staticmethod
    def _message(text: str, parsed: Any) -> dict[str, Any]:
        if parsed is None:
            return {"role": "assistant", "content": text, "tool_calls": []}
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content,
            "tool_calls": parsed.tool_calls,
        }
        if parsed.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = parsed.reasoning
        return message

    async def chat_derender(self, body: dict[str, Any]) -> web.Response:
        self.metrics.derender_calls.labels(str(bool(body.get("stream"))).lower()).inc()
        self.metrics.inflight_derender.inc()
        try:
            if body.get("stream"):
                return web.json_response(self._chat_derender_chunk(body))
            return web.json_response(self._chat_derender_full(body))
        finally:
            self.metrics.inflight_derender.dec()

    def _chat_derender_full(self, body: Mapping[str, Any]) -> dict[str, Any]:
        response = body.get("generate_response")
        if not isinstance(response, Mapping):
            raise HttpError(400, "generate_response is required", "generate_response")
        chat_request = body.get("chat_request")
        choices = []
        completion_tokens = 0
        for choice in response.get("choices", []):
            ids = list(choice.get("token_ids", []))
            completion_tokens += len(ids)
            text, parsed = self._parse(ids, chat_request, final=True, call_ids=[])
            finish = choice.get("finish_reason")
            if parsed is not None and parsed.tool_calls and finish == "stop":
                finish = "tool_calls"
            choices.append(
                {
                    "index": choice.get("index", 0),
                    "message": self._message(text, parsed),
                    "finish_reason": finish,
                    "logprobs": None,
                }
            )
        prompt_tokens = int(body.get("prompt_tokens") or 0)
        return {
            "id": response.get("request_id", f"chatcmpl-{uuid.uuid4().hex}"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.config.name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def _chat_derender_chunk(self, body: Mapping[str, Any]) -> dict[str, Any]:
        chunk = body.get("generate_chunk")
        if not isinstance(chunk, Mapping):
            raise HttpError(400, "generate_chunk is required", "generate_chunk")
        chat_request = body.get("chat_request")
        if self.parser.configured and (
            chat_request is None or body.get("prompt_token_ids") is None
        ):
            raise HttpError(
                400,
                "streaming derender with a reasoning or tool-call parser needs "
                "chat_request and prompt_token_ids",
                "chat_request",
            )
        choices = chunk.get("choices") or []
        if len(choices) > 1:
            raise HttpError(
                400, "one choice per chunk: derender each choice index separately", "generate_chunk"
            )
        state = dict(body.get("stream_state") or {})
        if not state:
            self.metrics.streams.inc()
        ids: list[int] = list(state.get("token_ids", []))
        index = 0
        finish = None
        if choices:
            index = choices[0].get("index", 0)
            ids += list(choices[0].get("token_ids") or [])
            finish = choices[0].get("finish_reason")
        call_ids = list(state.get("call_ids", []))
        text, parsed = self._parse(ids, chat_request, final=finish is not None, call_ids=call_ids)
        delta: dict[str, Any] = {}
        if not state.get("role_sent"):
            delta["role"] = "assistant"
        message = self._message(text, parsed)
        sent_content = int(state.get("content", 0))
        sent_reasoning = int(state.get("reasoning", 0))
        content = message.get("content") or ""
        reasoning = message.get("reasoning") or ""
        if len(content) > sent_content:
            delta["content"] = content[sent_content:]
        if len(reasoning) > sent_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning[sent_reasoning:]
        sent_calls = int(state.get("tool_calls", 0))
        new_calls = message["tool_calls"][sent_calls:]
        if new_calls:
            delta["tool_calls"] = [
                {"index": sent_calls + i, **call} for i, call in enumerate(new_calls)
            ]
        if finish == "stop" and message["tool_calls"]:
            finish = "tool_calls"
        out_chunk: dict[str, Any] = {
            "id": chunk.get("request_id", ""),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model") or self.config.name,
            "choices": [
                {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
            ],
        }
        if chunk.get("usage") is not None:
            out_chunk["usage"] = chunk["usage"]
        new_state = {
            "token_ids": ids,
            "role_sent": True,
            "content": max(sent_content, len(content)),
            "reasoning": max(sent_reasoning, len(reasoning)),
            "tool_calls": sent_calls + len(new_calls),
            "call_ids": call_ids,
        }
        return {"chunk": out_chunk, "stream_state": new_state}

    async def completion_derender(self, body: dict[str, Any]) -> web.Response:
        self.metrics.derender_calls.labels(str(bool(body.get("stream"))).lower()).inc()
        if body.get("stream"):
            chunk = body.get("generate_chunk") or {}
            state = dict(body.get("stream_state") or {})
            out = []
            for choice in chunk.get("choices") or []:
                text, _ = self._parse(
                    list(choice.get("token_ids") or []), None, final=False, call_ids=[]
                )
                out.append(
                    {
                        "index": choice.get("index", 0),
                        "text": text,
                        "finish_reason": choice.get("finish_reason"),
                        "logprobs": None,
                    }
                )
            return web.json_response(
                {
                    "chunk": {
                        "id": chunk.get("request_id", ""),
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": body.get("model") or self.config.name,
                        "choices": out,
                    },
                    "stream_state": state,
                }
            )
        response = body.get("generate_response")
        if not isinstance(response, Mapping):
            raise HttpError(400, "generate_response is required", "generate_response")
        choices = []
        completion_tokens = 0
        for choice in response.get("choices", []):
            ids = list(choice.get("token_ids", []))
            completion_tokens += len(ids)
            text, _ = self._parse(ids, None, final=True, call_ids=[])
            choices.append(
                {
                    "index": choice.get("index", 0),
                    "text": text,
                    "finish_reason": choice.get("finish_reason"),
                    "logprobs": None,
                }
            )
        prompt_tokens = int(body.get("prompt_tokens") or 0)
        return web.json_response(
            {
                "id": response.get("request_id", f"cmpl-{uuid.uuid4().hex}"),
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or self.config.name,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )
