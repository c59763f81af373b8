"""The simulated engine's token-id API (vLLM's scale-out API, `vllm serve --tokens-only` or
`--enable-scale-out`): POST /inference/v1/generate, streamed or not, handing KV to a peer through
kv_transfer_params, and POST /inference/v1/abort_requests. Requests are named as vLLM names
them (`generate-tokens-<id>`), and aborts go by that name; without a tokenizer (--tokens-only),
stop strings and structured outputs are refused as vLLM refuses them. A request runs on the
data-parallel rank its X-data-parallel-rank header names, else on the least loaded one
(engine_ranks); an abort reaches every rank."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from pdserve.sim.engine_config import EngineConfig, Faults
from pdserve.sim.engine_core import Sequence
from pdserve.sim.engine_rank import EngineRank
from pdserve.sim.engine_ranks import EngineRanks
from pdserve.sim.http import SSE_DONE, HttpError, error_response, open_sse, read_json, sse_event
from pdserve.sim.render_server import check_model
from pdserve.vllm.protocol import generate_request_id, usage

# vLLM 0.32's generate answers and chunks say what they carry (tokens, not text).
OUTPUT_MODE = "tokens"


class TokensApi:
    def __init__(self, config: EngineConfig, ranks: EngineRanks, faults: Faults) -> None:
        self.config, self.ranks, self.faults = config, ranks, faults

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            model = check_model(self.config.name, self.config.adapters, body.get("model"))
            # Any rank's check: it reads only the server's config and tokenizer.
            prompt_ids = self.ranks[0].requests.validate_prompt(body.get("token_ids"))
            params = dict(body.get("sampling_params") or {})
            extra = params.get("extra_args") or {}
            kv_params = body.get("kv_transfer_params") or extra.get("kv_transfer_params")
            request_id = generate_request_id(
                request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
            )
            if not self.config.detokenizes:
                refuse_what_needs_a_tokenizer(params)
            # After the request's own checks, as vLLM checks the rank in process_inputs.
            rank = self.ranks.for_request(request.headers)
        except HttpError as error:
            return error_response(error.status, error.message, error.param)
        with rank.serving():
            return await self._generate(
                request, rank, body, request_id, prompt_ids, params, kv_params, model
            )

    async def _generate(
        self,
        request: web.Request,
        rank: EngineRank,
        body: Mapping[str, Any],
        request_id: str,
        prompt_ids: list[int],
        params: Mapping[str, Any],
        kv_params: Mapping[str, Any] | None,
        model: str,
    ) -> web.StreamResponse:
        adapter = model if model != self.config.name else None
        try:
            sequences, remote_decode = await rank.requests.start(
                request_id, prompt_ids, params, kv_params, adapter
            )
        except HttpError as error:
            return error_response(error.status, error.message, error.param)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return await self._stream(
                request,
                rank,
                request_id,
                sequences,
                prompt_ids,
                include_usage=bool(options.get("include_usage")),
            )
        try:
            choices, completion_tokens = [], 0
            for index, seq in enumerate(sequences):
                ids, finish = await rank.requests.collect(seq)
                completion_tokens += len(ids)
                choices.append(
                    {"index": index, "token_ids": ids, "finish_reason": finish, "logprobs": None}
                )
        except asyncio.CancelledError:
            rank.requests.abort(sequences)  # the client went away
            raise
        kv_out = None
        if remote_decode:
            kv_out = rank.kv.hold(request_id, len(prompt_ids))
        elif (
            self.config.transfer.bidirectional
            and self.config.role == "decode"
            and len(sequences) == 1
        ):
            # Keep this turn's KV (prompt + answer) for the next turn's prefill to pull back.
            tokens = [*prompt_ids, *sequences[0].output_ids[: sequences[0].emitted]]
            kv_out = rank.kv.hold(
                request_id,
                len(tokens),
                token_ids=tokens,
                lease=self.config.transfer.decoder_kv_ttl_seconds,
            )
        return web.json_response(
            {
                "request_id": request_id,
                "model": model,
                "created": int(time.time()),
                "choices": choices,
                "usage": usage(len(prompt_ids), completion_tokens),
                "kv_transfer_params": kv_out,
                "prompt_logprobs": None,
                "output_mode": OUTPUT_MODE,
            }
        )

    async def _stream(
        self,
        request: web.Request,
        rank: EngineRank,
        request_id: str,
        sequences: list[Sequence],
        prompt_ids: list[int],
        *,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = await open_sse(
            request, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        # Opt-in extension for benchmarks: each event carries the token's simulated time.
        timing = request.headers.get("X-PDServe-Sim-Timing") == "1"
        counts = [0] * len(sequences)
        drop_after = self.faults.drop_stream_after
        self.faults.drop_stream_after = None
        sent = 0
        pending = {
            asyncio.ensure_future(seq.queue.get()): index for index, seq in enumerate(sequences)
        }
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    token, finish = future.result()
                    if token is not None or finish is not None:
                        # A finish without a token (an abort) is sent too, as vLLM sends it.
                        event: dict[str, Any] = {
                            "request_id": request_id,
                            "output_mode": OUTPUT_MODE,
                            "choices": [
                                {
                                    "index": index,
                                    "token_ids": [] if token is None else [token],
                                    "finish_reason": finish,
                                    "logprobs": None,
                                }
                            ],
                        }
                        if token is not None and timing:
                            seq_times = sequences[index].sim_times
                            event["sim_time"] = seq_times[min(counts[index], len(seq_times) - 1)]
                            counts[index] += 1
                        await response.write(sse_event(event))
                        sent += 1
                    if drop_after is not None and sent >= drop_after:
                        rank.requests.abort(sequences)
                        request.transport and request.transport.close()  # type: ignore[func-returns-value]
                        return response
                    if finish is None:
                        pending[asyncio.ensure_future(sequences[index].queue.get())] = index
            if include_usage:
                completion = sum(s.emitted for s in sequences)
                final = {
                    "request_id": request_id,
                    "output_mode": OUTPUT_MODE,
                    "choices": [],
                    "usage": usage(len(prompt_ids), completion),
                }
                await response.write(sse_event(final))
            await response.write(SSE_DONE)
        except (ConnectionResetError, asyncio.CancelledError):
            rank.requests.abort(sequences)  # the client went away: stop generating for it
            for future in pending:
                future.cancel()
            raise
        return response

    async def abort_requests(self, request: web.Request) -> web.Response:
        """Abort requests by the engine's names for them (`generate-tokens-<id>`): an id the
        engine does not know, the bare <id> among them, aborts nothing. Every rank is told, as
        the request may run or hold KV on any of them."""
        try:
            body = await read_json(request)
        except HttpError as error:
            return error_response(error.status, error.message)
        ids = body.get("request_ids")
        if not isinstance(ids, list):
            return error_response(400, "Missing 'request_ids' in request body", "request_ids")
        for request_id in ids:
            request_id = str(request_id)
            for rank in self.ranks:
                rank.core.abort(request_id)
                rank.kv.release(request_id)  # a producer's lease ends with the request
        return web.Response(status=200)  # vLLM's answer: no body


# vLLM's own words (a client behind a gateway that does not check first would see them).
STOP_NEEDS_DETOKENIZER = (
    "stop strings are not supported on a --tokens-only server because detokenization is "
    "disabled. Check stop strings on the coordinator, or use stop_token_ids."
)
STRUCTURED_NEEDS_TOKENIZER = (
    "Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'"
)


def refuse_what_needs_a_tokenizer(params: Mapping[str, Any]) -> None:
    """A --tokens-only engine's refusals: stop strings (vLLM normalizes a string to a list of
    it, so even "" is one) and structured outputs."""
    stop = params.get("stop")
    if stop is not None and stop != []:
        raise HttpError(400, STOP_NEEDS_DETOKENIZER)
    if params.get("structured_outputs") is not None:
        raise HttpError(400, STRUCTURED_NEEDS_TOKENIZER)
