"""The simulated render server's derender side: generated token ids back to OpenAI responses
and chunks, decoded and parsed (reasoning, tool calls) again in full on every call, as vLLM
rebuilds its parser per chunk; a stream's progress travels in `stream_state`.

It has real vLLM 0.32's gaps (pdserve/vllm/derender_gaps.py), which the gateway closes: a stop
token left in the token ids is decoded into the content, usage counts the token ids given, a
whole chat answer with tool calls keeps finish_reason "stop". Reasoning goes in `reasoning`
only, as vLLM 0.32 sends it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from pdserve.sim.chat import OutputParser
from pdserve.sim.http import HttpError
from pdserve.sim.render_metrics import RenderMetrics
from pdserve.sim.tokenizer import SimTokenizer
from pdserve.vllm.protocol import usage


class Derenderer:
    def __init__(
        self, model: str, tokenizer: SimTokenizer, parser: OutputParser, metrics: RenderMetrics
    ) -> None:
        self.model, self.tokenizer, self.parser, self.metrics = model, tokenizer, parser, metrics

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
            message["reasoning"] = parsed.reasoning
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
            "model": body.get("model") or self.model,
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
            delta["reasoning"] = reasoning[sent_reasoning:]
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
            "model": body.get("model") or self.model,
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
                        "model": body.get("model") or self.model,
                        "choices": out,
                    },
                    "stream_state": state,
                }
            )
        # One generate answer per prompt, as vLLM's multi-prompt completions (0.32's shape).
        responses = body.get("generate_responses")
        if not isinstance(responses, list) or not responses:
            raise HttpError(400, "generate_responses: Field required", "generate_responses")
        if not isinstance(body.get("prompt_tokens", []), list):
            raise HttpError(400, "prompt_tokens: Input should be a valid list", "prompt_tokens")
        response = responses[0]
        if not isinstance(response, Mapping):
            raise HttpError(400, "generate_responses.0: Input should be an object",
                            "generate_responses")  # fmt: skip
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for answer in responses:
            for choice in answer.get("choices", []):
                ids = list(choice.get("token_ids", []))
                completion_tokens += len(ids)
                text, _ = self._parse(ids, None, final=True, call_ids=[])
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "finish_reason": choice.get("finish_reason"),
                        "logprobs": None,
                    }
                )
        prompt_tokens = sum(int(n) for n in body.get("prompt_tokens") or [])
        return web.json_response(
            {
                "id": response.get("request_id", f"cmpl-{uuid.uuid4().hex}"),
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or self.model,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )
