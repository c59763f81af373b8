"""Routes 1 and 3, engines behind render servers: render -> (prefill ->) decode -> derender,
streamed or not; with bidirectional KV, a conversation's next prefill reuses what its last
decode turn left on decode."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from pdserve.contract.routing import GatewayConfig
from pdserve.gateway.affinity import DecodeKv, HeldKv
from pdserve.gateway.endpoints import Endpoint
from pdserve.gateway.errors import (
    GatewayError,
    UpstreamFailed,
    json_response,
    out_of_time,
    stream_logprobs_refused,
    upstream_failure,
    upstream_message,
)
from pdserve.gateway.exchange import Exchange
from pdserve.gateway.held_kv import FALLBACK_REASON, HELD_FINISH_REASONS, DecodeHolds
from pdserve.gateway.hops import Hops, has_choices
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openai_schema import logprobs_asked
from pdserve.gateway.peers import PeerAdmission
from pdserve.gateway.placement import Placement
from pdserve.gateway.planner import RoutePlanner
from pdserve.gateway.settings import GatewaySettings
from pdserve.gateway.streaming import (
    DONE,
    SSE_HEADERS,
    ClientWriter,
    DerenderPipeline,
    StreamDerender,
    StreamTimeout,
    sse_data,
)
from pdserve.gateway.upstream import UpstreamClient, counted
from pdserve.vllm.derender_gaps import match_vllm_serve, without_stop_tokens
from pdserve.vllm.protocol import (
    GENERATE_PATH,
    DerenderStreamRequest,
    derender_body,
    derender_path,
    ends_on_stop_token,
    prefill_handoff_params,
    render_path,
    reuse_decode_kv_params,
    stop_string_of,
    tokens_decode_body,
    tokens_prefill_body,
    with_rendered_limit,
)
from pdserve.wirejson import loads_trusted

log = logging.getLogger("pdserve.gateway")


class TokensRoute:
    def __init__(
        self,
        config: GatewayConfig,
        settings: GatewaySettings,
        upstream: UpstreamClient,
        hops: Hops,
        planner: RoutePlanner,
        placement: Placement,
        decode_kv: DecodeKv,
        metrics: GatewayMetrics,
        holds: DecodeHolds | None = None,
        peers: PeerAdmission | None = None,
    ) -> None:
        self.config, self.settings, self.upstream, self.hops = config, settings, upstream, hops
        self.planner, self.placement, self.decode_kv = planner, placement, decode_kv
        self.metrics = metrics
        self.holds = holds or DecodeHolds(
            ttl=config.kv_transfer.decode_blocks_ttl_seconds,
            block_size=config.block_size,
            fraction=settings.held_kv_fraction,
        )
        self.peers = peers

    async def serve(self, ex: Exchange) -> web.StreamResponse:
        if ex.stream and (param := logprobs_asked(ex.body, chat=ex.chat)) is not None:
            raise stream_logprobs_refused(param)  # derendered from token ids (streaming.py)
        render_endpoint, rendered = await self.upstream.post_json(
            "render",
            ex.selection.pools["render"],
            render_path(ex.chat),
            ex.body,
            ex.headers,
            self.settings.render_timeout,
        )
        ex.served_by["render"] = render_endpoint.label
        generates = rendered if isinstance(rendered, list) else [rendered]
        if len(generates) != 1:
            raise GatewayError(400, "send one prompt per request", param="prompt")
        generate = generates[0]
        if not (
            isinstance(generate, dict)
            and isinstance(generate.get("token_ids"), list)
            and isinstance(generate.get("sampling_params"), dict)
        ):
            raise GatewayError(502, "render answered without token ids", kind="UpstreamError")
        generate = with_rendered_limit(generate)
        generate["request_id"] = ex.request_id
        self.planner.decide_auto(ex, len(generate["token_ids"]))
        held = ex.pd and self.config.kv_transfer.bidirectional
        if held and not self.admit_hold(ex, generate):
            ex.pd = held = False
        try:
            prefill_endpoint: Endpoint | None = None
            kv: dict[str, Any] | None = None
            if ex.pd:
                handoff, reused = self.bidirectional_handoff(ex, generate["token_ids"])
                prefill_body = tokens_prefill_body(generate, handoff)
                prefilled = await self.hops.prefill(
                    ex, GENERATE_PATH, prefill_body, generate["token_ids"]
                )
                if prefilled is not None:
                    prefill_endpoint, kv = prefilled
                    if reused is not None:
                        # Prefill read the last turn's KV back (or found it all cached and
                        # said so): decode freed it, and nothing of it is left to point
                        # another prefill at.
                        self.holds.released(reused.decode_url, reused.request_id)
                        if ex.conversation:
                            self.decode_kv.consumed(ex.conversation, reused.request_id)
            if ex.stream:
                return await self.stream_generate(ex, generate, kv, prefill_endpoint)
            return await self.generate_once(ex, generate, kv, prefill_endpoint)
        finally:
            if held:
                self.holds.settle(ex)

    def admit_hold(self, ex: Exchange, generate: Mapping[str, Any]) -> bool:
        """Bidirectional KV: whether decode may hold this request's KV once it finishes (every
        P/D request's, held for the TTL) within the budget (held_kv.py). Else it prefills
        locally on decode, which holds nothing, instead of filling decode's cache with holds
        that would stall its admission."""
        params = generate["sampling_params"]
        choices = max(1, int(params.get("n") or 1))
        tokens = len(generate["token_ids"]) + int(params.get("max_tokens") or 0)
        if self.holds.admit(ex, tokens * choices, self.gateway_replicas()):
            return True
        self.metrics.fallbacks.labels(FALLBACK_REASON).inc()
        log.info(
            "%s: decode's held KV is at its budget; prefilling on decode",
            ex.request_id,
            extra={"request_id": ex.request_id},
        )
        return False

    def gateway_replicas(self) -> int:
        """This gateway's replicas (the peers it sees and itself): they share each budget."""
        return 1 if self.peers is None else self.peers.replicas()

    def bidirectional_handoff(
        self, ex: Exchange, prompt_ids: list[int]
    ) -> tuple[dict[str, Any], HeldKv | None]:
        """The prefill's kv_transfer_params: with bidirectional KV and a conversation whose last
        decode turn left its KV on decode, point prefill at it, if the token ids still match
        for at least a block, the decode replica holding it is still discovered, and a prefill
        replica of its KV-compatibility digest can take the request (then only those may: mid
        engine upgrade another digest's prefill could not pull it). With it, the turn reused."""
        handoff = prefill_handoff_params()
        conversation = ex.conversation
        if not (self.config.kv_transfer.bidirectional and conversation):
            return handoff, None
        turn = self.decode_kv.held.get(conversation)
        held, outcome, matched = self.decode_kv.reuse(
            conversation, prompt_ids, self.config.block_size
        )
        pools = ex.selection.pools
        if held is not None and turn is not None:
            holder = [e for e in pools.get("decode", []) if e.url == turn.decode_url]
            prefills = [p for p in pools.get("prefill", []) if p.kv_compat == turn.kv_compat]
            if not holder:
                held, outcome = None, "decode_gone"
            elif not prefills:
                held, outcome = None, "incompatible"
            else:
                pools["prefill"] = prefills
        if outcome != "none":
            self.metrics.bidirectional.labels(outcome).inc()
        if held is None or turn is None:
            return handoff, None
        self.metrics.bidirectional_tokens.inc(matched)
        return reuse_decode_kv_params(held, matched, self.config.block_size), turn

    def keep_decode_kv(
        self, ex: Exchange, prompt_ids: list[int], answer: Mapping[str, Any]
    ) -> None:
        """What decode holds after a non-streamed turn: for the budget, every finished
        choice; for the next turn, the conversation's (streamed turns return no
        kv_transfer_params, so they leave nothing to reuse, though decode holds them all the
        same)."""
        params = answer.get("kv_transfer_params")
        choices = answer.get("choices") or []
        ex.held_tokens = [
            len(prompt_ids) + len(choice.get("token_ids") or [])
            for choice in choices
            if isinstance(choice, dict) and choice.get("finish_reason") in HELD_FINISH_REASONS
        ]
        conversation = ex.conversation
        if not (self.config.kv_transfer.bidirectional and conversation):
            return
        decode = ex.decoded_on
        if (
            isinstance(params, dict) and params.get("remote_request_id") and len(choices) == 1
            and decode is not None
        ):  # fmt: skip
            output = list(choices[0].get("token_ids") or [])
            self.decode_kv.keep(conversation, params, [*prompt_ids, *output],
                                decode_url=decode.url, kv_compat=decode.kv_compat,
                                request_id=ex.request_id)  # fmt: skip

    async def generate_once(
        self,
        ex: Exchange,
        generate: dict[str, Any],
        kv: dict[str, Any] | None,
        prefill_endpoint: Endpoint | None,
    ) -> web.Response:
        prompt_ids = generate["token_ids"]
        answer = await self.hops.decode_once(
            ex,
            GENERATE_PATH,
            tokens_decode_body(generate, kv),
            tokens_decode_body(generate, None) if kv is not None else None,
            prefill_endpoint,
            prompt_ids,
        )
        self.keep_decode_kv(ex, prompt_ids, answer)
        model = ex.body["model"]  # the model's, or the LoRA adapter's the request named
        params = generate["sampling_params"]
        _, result = await self.upstream.post_json(
            "derender",
            ex.selection.pools["render"],
            derender_path(ex.chat),
            derender_body(
                model, without_stop_tokens(answer, params), prompt_ids, ex.body, chat=ex.chat
            ),
            ex.headers,
            self.settings.render_timeout,
        )
        if not (isinstance(result, dict) and has_choices(result)):
            raise GatewayError(502, "derender answered without choices", kind="UpstreamError")
        match_vllm_serve(result, answer, params, ex.body, chat=ex.chat)
        result["model"] = model
        result["id"] = ex.request_id
        usage = result.get("usage") or {}
        ex.prompt_tokens, ex.output_tokens = (
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
        )
        self.metrics.ttft.labels(ex.route).observe(time.monotonic() - ex.started)
        return json_response(result)

    @asynccontextmanager
    async def open_decode_stream(
        self,
        ex: Exchange,
        generate: dict[str, Any],
        kv: dict[str, Any] | None,
        prefill_endpoint: Endpoint | None,
    ) -> AsyncIterator[tuple[Endpoint, aiohttp.ClientResponse]]:
        """Open the decode SSE stream, trying the next decode replica when one fails or does
        not answer (never one that already did); a KV load failure before any token is retried
        once with local prefill on decode, on another replica when there is one (the engine
        that could not pull the KV answered, so it may serve the retry when it is alone). No
        replica is sent prefill's KV past its lease: the request prefills locally instead."""
        attempts: list[dict[str, Any] | None] = [kv, None] if kv is not None else [None]
        tried: list[Endpoint] = []
        kv_failed: list[Endpoint] = []
        deadline = self.upstream.deadline(ex.started)
        failure, status = "no decode endpoint", 503
        for attempt_kv in attempts:
            local_ids = generate["token_ids"] if attempt_kv is None else None
            affinity = self.placement.affinity(ex, "decode", local_ids)
            candidates = self.hops.decode_candidates(ex, with_kv=attempt_kv is not None)
            while (
                endpoint := self.upstream.endpoints.pick(candidates, tried + kv_failed, affinity)
                or self.upstream.endpoints.pick(candidates, tried, affinity)
            ) is not None:
                if attempt_kv is not None and await self.hops.lease_ran_out(ex, prefill_endpoint):
                    break  # next attempt: local prefill
                body = tokens_decode_body(generate, attempt_kv)
                async with counted(endpoint):
                    try:
                        response = await self.upstream.post_stream(
                            endpoint, GENERATE_PATH, body, ex.headers, deadline=deadline
                        )
                    except TimeoutError as error:
                        tried.append(endpoint)
                        self.metrics.retries.labels("decode", "timeout").inc()
                        s = self.settings
                        failure = out_of_time(
                            "decode", endpoint.url, error, s.first_byte_timeout, s.connect_timeout
                        )
                        status = 504
                        continue
                    except aiohttp.ClientError as error:
                        tried.append(endpoint)
                        self.metrics.retries.labels("decode", "connect").inc()
                        log.info("decode at %s failed: %r", endpoint.url, error)
                        failure = f"decode at {endpoint.url}: {upstream_failure(error)}"
                        status = 502
                        continue
                    if response.status == 200:
                        self.placement.remember(ex, "decode", endpoint, local_ids)
                        ex.decoded_on, ex.decode_pulled_kv = endpoint, attempt_kv is not None
                        try:
                            yield endpoint, response
                        finally:
                            response.release()
                        return
                    message = upstream_message(await response.read())
                    response.release()
                if 400 <= response.status < 500:
                    raise GatewayError(response.status, message, kind="UpstreamError")
                failure = f"decode at {endpoint.url}: HTTP {response.status}: {message}"
                status = 502
                if attempt_kv is not None and "KV transfer" in message:
                    self.planner.fallback("kv_load_failed")
                    await self.upstream.abort(prefill_endpoint, ex)
                    kv_failed.append(endpoint)
                    break  # next attempt: local prefill
                tried.append(endpoint)
                self.metrics.retries.labels("decode", "upstream_error").inc()
        kind = "GatewayTimeout" if status == 504 else "UpstreamError"
        raise GatewayError(status, failure, kind=kind)

    def stream_derender(self, ex: Exchange, prompt_ids: list[int]) -> StreamDerender:
        async def post(body: DerenderStreamRequest) -> dict[str, Any]:
            _, result = await self.upstream.post_json(
                "derender",
                ex.selection.pools["render"],
                derender_path(ex.chat),
                body,
                ex.headers,
                self.settings.render_timeout,
            )
            assert isinstance(result, dict)
            return result

        return StreamDerender(
            post=post,
            model=ex.body["model"],
            request_id=ex.request_id,
            prompt_ids=prompt_ids,
            request=ex.body,
            chat=ex.chat,
            pipelining=self.settings.derender_pipelining,
        )

    async def stream_generate(
        self,
        ex: Exchange,
        generate: dict[str, Any],
        kv: dict[str, Any] | None,
        prefill_endpoint: Endpoint | None,
    ) -> web.StreamResponse:
        """Relay decode's stream through the derender pipelines. It ends with every choice's
        finish_reason, or, when decode broke, went quiet past the idle timeout or the deadline,
        sent a malformed event or `[DONE]` before a finish_reason, with an error event (and
        decode is told to abort); `[DONE]` either way."""
        prompt_ids = generate["token_ids"]
        params = generate["sampling_params"]
        ex.prompt_tokens = len(prompt_ids)
        derender = self.stream_derender(ex, prompt_ids)
        s = self.settings
        async with self.open_decode_stream(ex, generate, kv, prefill_endpoint) as (
            decode,
            upstream,
        ):
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(ex.request)
            writer = ClientWriter(response, ex, self.metrics)
            pipelines: dict[int, DerenderPipeline] = {}
            generated: dict[int, int] = {}  # per choice: tokens decode sent
            ended: dict[int, str] = {}  # per choice: decode's finish_reason
            usage: dict[str, Any] | None = None
            done = False  # decode's [DONE]
            broke = ""
            timed_out = False
            opened = time.monotonic()
            first_event = True
            last_event: float | None = None
            try:
                try:
                    lines = sse_data(
                        upstream.content,
                        first_by=opened + s.first_byte_timeout,
                        idle=s.idle_timeout,
                        deadline=self.upstream.deadline(ex.started),
                    )
                    async with aclosing(lines) as events:
                        async for data in events:
                            if data == DONE:
                                done = True
                                break
                            try:
                                event = loads_trusted(data)
                                if "error" in event:
                                    broke = f"decode reported: {event['error']}"
                                    break
                                choices = event.get("choices")
                                if choices:
                                    now = time.monotonic()
                                    if last_event is not None:
                                        self.planner.note_step(decode, now - last_event, now)
                                    last_event = now
                                if first_event and choices:
                                    first_event = False
                                    self.metrics.stage.labels("decode_first_token").observe(
                                        now - opened
                                    )
                                    self.planner.note_handoff(ex, now, len(prompt_ids))
                                if event.get("usage") is not None:
                                    usage = event["usage"]
                                for choice in choices or []:
                                    tokens = list(choice.get("token_ids") or [])
                                    ex.output_tokens = (ex.output_tokens or 0) + len(tokens)
                                    if ends_on_stop_token(choice, params):
                                        tokens = tokens[:-1]  # vllm/derender_gaps.py
                                    index = int(choice.get("index", 0))
                                    generated[index] = generated.get(index, 0) + len(
                                        choice.get("token_ids") or []
                                    )
                                    if reason := choice.get("finish_reason"):
                                        ended[index] = str(reason)
                                    if index not in pipelines:
                                        pipelines[index] = DerenderPipeline(
                                            derender, index, writer, self.metrics
                                        )
                                    pipelines[index].push(
                                        tokens,
                                        choice.get("finish_reason"),
                                        stop_string_of(choice, params),
                                    )
                            except (ValueError, TypeError, AttributeError) as error:
                                broke = f"decode sent a malformed event ({error})"
                                break
                except StreamTimeout as error:
                    broke, timed_out = str(error), True
                except (TimeoutError, aiohttp.ClientError) as error:
                    broke = f"decode stream broke ({type(error).__name__})"
                finished = done and bool(pipelines) and all(p.finished for p in pipelines.values())
                if done:  # decode finished these: with the KV pulled, it holds them now
                    ex.held_tokens = [
                        len(prompt_ids) + generated.get(index, 0)
                        for index, reason in ended.items()
                        if reason in HELD_FINISH_REASONS
                    ]
                if not finished and not broke:
                    broke = "sent [DONE] before a finish_reason" if done else "closed it"
                    broke = f"decode {broke}"
                # Flush what was generated before reporting anything, so chunks stay in order.
                results = await asyncio.gather(
                    *(p.close() for p in pipelines.values()), return_exceptions=True
                )
                failed = [r for r in results if isinstance(r, BaseException)]
                if finished:
                    self.planner.policy.observe_output(ex.output_tokens or 0)
                if failed:
                    slow = isinstance(failed[0], UpstreamFailed) and failed[0].timed_out
                    await writer.error(504 if slow else 502, f"derender failed: {failed[0]}")
                elif not finished:
                    # Say the answer is cut short instead of truncating it silently.
                    await writer.error(
                        504 if timed_out else 502,
                        f"decode stream ended before the answer was complete: {broke}",
                    )
                options = ex.body.get("stream_options") or {}
                if finished and not failed and usage is not None and options.get("include_usage"):
                    await writer.send(
                        {
                            "id": ex.request_id,
                            "object": writer.object_name,
                            "created": int(time.time()),
                            "model": ex.body["model"],
                            "choices": [],
                            "usage": usage,
                        }
                    )
                await writer.done()
            except (ConnectionResetError, asyncio.CancelledError):
                # The client went away: stop the engines working for it.
                for pipeline in pipelines.values():
                    pipeline.cancel()
                await asyncio.shield(self.upstream.abort(decode, ex))
                raise
            except Exception:
                # Anything else broke the stream (app.py's error path reports it on the
                # stream): stop the derender calls and the engine's work for it too.
                for pipeline in pipelines.values():
                    pipeline.cancel()
                await asyncio.shield(self.upstream.abort(decode, ex))
                raise
            if not finished:
                # Decode may still be generating (a stalled stream): stop it.
                await asyncio.shield(self.upstream.abort(decode, ex))
            return response
