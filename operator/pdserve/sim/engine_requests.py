"""A request's way into the simulated engine, whichever API it came by: the prompt checked, its
sequences planned (what the model says, how it finishes) and scheduled, the KV pulled first
when a peer prefilled it, injected faults applied; and its tokens read back out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from pdserve.sim.engine_config import EngineConfig, Faults
from pdserve.sim.engine_core import EngineCore, Sequence
from pdserve.sim.generation import filler, model_output
from pdserve.sim.http import HttpError
from pdserve.sim.kv_transfer import KvTransfer
from pdserve.sim.tokenizer import SimTokenizer


class EngineRequests:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: SimTokenizer,
        core: EngineCore,
        faults: Faults,
        kv: KvTransfer,
        shutting_down: asyncio.Event,
    ) -> None:
        self.config, self.tokenizer, self.core, self.faults = config, tokenizer, core, faults
        self.kv = kv
        self.shutting_down = shutting_down

    def plan(
        self,
        prompt_ids: list[int],
        params: Mapping[str, Any],
        index: int,
        adapter: str | None = None,
    ) -> tuple[list[int], str]:
        """What the model says (under LoRA `adapter`, None: the base) and how it finishes: its
        natural answer cut to the length asked, or, on an engine that detokenizes, at the first
        stop string."""
        output, finish = self._planned(prompt_ids, params, index, adapter)
        if self.config.detokenizes and (cut := self.stop_string_cut(output, params)) is not None:
            return output[:cut], "stop"
        return output, finish

    def stop_string_cut(self, output: list[int], params: Mapping[str, Any]) -> int | None:
        """How many of `output`'s tokens come before a stop string ends the answer (the token
        that completes it included: vLLM cuts the string from the text, not the tokens); None
        when none appears. As vLLM checks: on the text as skip_special_tokens detokenizes it,
        and not before min_tokens tokens."""
        stops = params.get("stop") or []
        wanted = [s.encode() for s in ([stops] if isinstance(stops, str) else stops) if s]
        if not wanted:
            return None
        skip = bool(params.get("skip_special_tokens", True))
        minimum = int(params.get("min_tokens") or 0)
        text = bytearray()
        for count, token in enumerate(output, 1):
            before = len(text)
            text += self.tokenizer.token_bytes(token, skip_special_tokens=skip)
            # Only a stop string this token completes (one ending in its bytes) counts now.
            if count >= minimum and any(w in text[max(0, before - len(w) + 1) :] for w in wanted):
                return count
        return None

    def _planned(
        self, prompt_ids: list[int], params: Mapping[str, Any], index: int, adapter: str | None
    ) -> tuple[list[int], str]:
        max_tokens = params.get("max_tokens")
        if max_tokens is None:
            max_tokens = self.config.max_model_len - len(prompt_ids)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise HttpError(
                400, "sampling_params.max_tokens must be a positive integer", "max_tokens"
            )
        seed = params.get("seed")
        if index:
            seed = (seed or 0) + index
        natural = model_output(
            self.tokenizer, prompt_ids, seed=seed, behaviour=self.config.behaviour, adapter=adapter
        )
        if params.get("ignore_eos"):
            body = natural[:-1]
            if len(body) < max_tokens:
                body += filler(self.tokenizer, prompt_ids, seed, max_tokens - len(body))
            return body[:max_tokens], "length"
        minimum = int(params.get("min_tokens") or 0)
        if len(natural) < minimum:
            natural = (
                natural[:-1]
                + filler(self.tokenizer, prompt_ids, seed, minimum - len(natural) + 1)
                + natural[-1:]
            )
        if len(natural) > max_tokens:
            return natural[:max_tokens], "length"
        return natural, "stop"

    def validate_prompt(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, list) or not token_ids:
            raise HttpError(400, "token_ids must be a non-empty list of token ids", "token_ids")
        vocab = self.tokenizer.vocab_size
        for position, token in enumerate(token_ids):
            if not isinstance(token, int) or not 0 <= token < vocab:
                raise HttpError(
                    400,
                    f"token_ids[{position}] = {token!r} is not in the vocabulary (0..{vocab - 1})",
                    "token_ids",
                )
        if len(token_ids) >= self.config.max_model_len:
            raise HttpError(
                400,
                f"This model's maximum context length is "
                f"{self.config.max_model_len} tokens. However, your request has "
                f"{len(token_ids)} input tokens.",
                "token_ids",
            )
        return token_ids

    async def start(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Mapping[str, Any],
        kv_params: Mapping[str, Any] | None,
        adapter: str | None = None,
    ) -> tuple[list[Sequence], bool]:
        """Create and schedule the request's sequences (under LoRA `adapter`, None: the base
        model); returns (sequences, remote_decode)."""
        if self.faults.http_5xx > 0:
            self.faults.http_5xx -= 1
            raise HttpError(500, "injected engine failure")
        if self.faults.hang > 0:
            self.faults.hang -= 1
            await self.shutting_down.wait()  # fault injection: no answer until shutdown
            raise HttpError(503, "engine shutting down")
        n = int(params.get("n") or 1)
        if n < 1 or n > self.config.scheduler.max_num_seqs:
            raise HttpError(
                400,
                f"n must be between 1 and max_num_seqs ({self.config.scheduler.max_num_seqs})",
                "n",
            )
        remote_decode = bool(kv_params and kv_params.get("do_remote_decode"))
        remote_prefill = bool(kv_params and kv_params.get("do_remote_prefill"))
        if remote_decode and self.config.role == "decode":
            raise HttpError(
                400,
                "this engine is a KV consumer (role decode); do_remote_decode needs a producer",
                "kv_transfer_params",
            )
        if remote_prefill and self.config.role == "prefill":
            raise HttpError(
                400,
                "this engine is a KV producer (role prefill); do_remote_prefill needs a consumer",
                "kv_transfer_params",
            )
        computed = 0
        if remote_prefill:
            assert kv_params is not None
            computed, failure = await self.kv.pull(kv_params, prompt_ids, whole_prompt=True)
            if failure is not None and self.config.transfer.load_failure_policy == "fail":
                raise HttpError(500, failure + " (kv_load_failure_policy=fail)")
            # recompute: prefill locally, slower but it answers
        elif (
            remote_decode
            and self.config.transfer.bidirectional
            and kv_params is not None
            and kv_params.get("remote_request_id")
        ):
            # An earlier turn's KV held by decode: reuse what still matches, compute the rest.
            computed, _ = await self.kv.pull(kv_params, prompt_ids, whole_prompt=False)
        sequences = []
        for index in range(n):
            output, finish = self.plan(prompt_ids, params, index, adapter)
            if remote_decode:
                output, finish = output[:1], "length"
            seq = Sequence(
                request_id=request_id if n == 1 else f"{request_id}-{index}",
                parent_id=None if n == 1 else request_id,
                prompt_ids=prompt_ids,
                output_ids=output,
                finish_reason=finish,
                arrival=time.monotonic(),
                computed=computed,
            )
            sequences.append(seq)
            self.core.add(seq)
        return sequences, remote_decode

    def abort(self, sequences: list[Sequence]) -> None:
        for seq in sequences:
            self.core.abort(seq.request_id)

    @staticmethod
    async def collect(seq: Sequence) -> tuple[list[int], str | None]:
        ids: list[int] = []
        while True:
            token, finish = await seq.queue.get()
            if token is not None:
                ids.append(token)
            if finish is not None:
                return ids, finish
