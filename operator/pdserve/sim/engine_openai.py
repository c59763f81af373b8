"""The simulated engine's OpenAI API (`vllm serve` without --tokens-only: deployments without a
render pool, and --enable-scale-out engines): /v1/chat/completions and /v1/completions, rendered
and derendered in process by the render server's own code, with derender's gaps closed as
`vllm serve` has none of them (pdserve/vllm/derender_gaps.py). A request runs on the
data-parallel rank its X-data-parallel-rank header names, else on the least loaded one
(engine_ranks)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any

from aiohttp import web

from pdserve.sim.engine_config import EngineConfig
from pdserve.sim.engine_core import Sequence
from pdserve.sim.engine_rank import EngineRank
from pdserve.sim.engine_ranks import EngineRanks
from pdserve.sim.http import SSE_DONE, HttpError, error_response, open_sse, read_json, sse_event
from pdserve.sim.render_server import RenderServer
from pdserve.vllm.derender_gaps import match_vllm_serve, without_stop_tokens
from pdserve.vllm.protocol import (
    derender_body,
    derender_chunk_body,
    ends_on_stop_token,
    usage,
    with_rendered_limit,
)


class OpenAIApi:
    def __init__(self, config: EngineConfig, ranks: EngineRanks, render: RenderServer) -> None:
        self.config, self.ranks, self.render = config, ranks, render

    async def openai_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def openai_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        with ExitStack() as on_rank:  # the request counts as its rank's until it is answered
            return await self._answer(request, on_rank, chat=chat)

    async def _answer(
        self, request: web.Request, on_rank: ExitStack, *, chat: bool
    ) -> web.StreamResponse:
        try:
            body = await read_json(request)
            if chat:
                rendered = json.loads((await self.render.chat_render(body)).text or "{}")
            else:
                rendered = json.loads((await self.render.completion_render(body)).text or "[]")[0]
            # vLLM's own OpenAI endpoint keeps SamplingParams in process; only their serialised
            # form leaves a resolved 16 out, so it is written back here as the gateway does.
            rendered = with_rendered_limit(rendered)
            prompt_ids = rendered["token_ids"]
            params = rendered["sampling_params"]
            kv_params = body.get("kv_transfer_params")
            # vLLM's name for it: the header's id (else its own) behind the endpoint's prefix.
            own = request.headers.get("X-Request-Id")
            prefix = "chatcmpl" if chat else "cmpl"
            request_id = f"{prefix}-{own}" if own else rendered["request_id"]
            # After rendering, as vLLM checks the rank in process_inputs.
            rank = self.ranks.for_request(request.headers)
            on_rank.enter_context(rank.serving())
            model = str(rendered.get("model") or self.config.name)
            sequences, remote_decode = await rank.requests.start(
                request_id, prompt_ids, params, kv_params, self.render.config.adapter(model)
            )
        except HttpError as error:
            return error_response(error.status, error.message, error.param)
        except Exception as error:  # ChatError and friends: the caller's input
            return error_response(400, str(error))
        derender_path = self.render.chat_derender if chat else self.render.completion_derender
        if body.get("stream"):
            return await self._openai_stream(
                request, rank, body, sequences, prompt_ids, params, derender_path
            )
        choices: list[dict[str, Any]] = []
        generated_tokens = 0
        try:
            for index, seq in enumerate(sequences):
                ids, finish = await rank.requests.collect(seq)
                generated_tokens += len(ids)
                choices.append(
                    {"index": index, "token_ids": ids, "finish_reason": finish, "stop_reason": None}
                )
        except asyncio.CancelledError:
            rank.requests.abort(sequences)  # the client went away (vLLM aborts it too)
            raise
        generated = {
            "request_id": request_id,
            "choices": choices,
            "usage": usage(len(prompt_ids), generated_tokens),
        }
        derendered = await derender_path(
            dict(
                derender_body(
                    model,
                    without_stop_tokens(generated, params),
                    prompt_ids,
                    body,
                    chat=chat,
                )
            )
        )
        answer = json.loads(derendered.text or "{}")
        match_vllm_serve(answer, generated, params, body, chat=chat)
        if remote_decode:
            answer["kv_transfer_params"] = rank.kv.hold(request_id, len(prompt_ids))
        return web.json_response(answer)

    async def _openai_stream(
        self,
        request: web.Request,
        rank: EngineRank,
        body: Mapping[str, Any],
        sequences: list[Sequence],
        prompt_ids: list[int],
        params: Mapping[str, Any],
        derender: Any,
    ) -> web.StreamResponse:
        response = await open_sse(request, {"Content-Type": "text/event-stream"})
        chat = "messages" in body
        model = str(body.get("model") or self.config.name)  # checked when it was rendered
        generated_tokens = 0
        last: Mapping[str, Any] = {}
        try:
            for index, seq in enumerate(sequences):
                state = None
                while True:
                    token, finish = await seq.queue.get()
                    choice: dict[str, Any] = {
                        "index": index,
                        "token_ids": [] if token is None else [token],
                        "finish_reason": finish,
                        "logprobs": None,
                    }
                    if ends_on_stop_token(choice, params):
                        choice["token_ids"] = []  # `vllm serve` does not send the stop token
                    out = await derender(
                        dict(
                            derender_chunk_body(
                                model, seq.request_id, state, choice,  # type: ignore[arg-type]
                                prompt_ids, body, chat=chat,
                            )
                        )
                    )  # fmt: skip
                    result = json.loads(out.text or "{}")
                    state = result.get("stream_state")
                    last = result.get("chunk") or last
                    generated_tokens += token is not None
                    await response.write(sse_event(result.get("chunk")))
                    if finish is not None:
                        break
            if (body.get("stream_options") or {}).get("include_usage"):
                # vLLM's last chunk: no choices, the request's usage.
                trailer = {key: last[key] for key in ("id", "object", "created", "model")
                           if key in last}  # fmt: skip
                trailer |= {"choices": [], "usage": usage(len(prompt_ids), generated_tokens)}
                await response.write(sse_event(trailer))
            await response.write(SSE_DONE)
        except (ConnectionResetError, asyncio.CancelledError):
            rank.requests.abort(sequences)
            raise
        return response
