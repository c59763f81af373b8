"""The simulated engine's KV handoff, our stand-in for NIXL: a producer holds a finished
prefill's blocks for the lease and answers POST /sim/kv/pull for them (unknown or expired blocks
are refused); a consumer pulls them and waits bytes / bandwidth + overhead. With bidirectional
transfer a decode engine holds its turn's KV (prompt + answer) for the next turn's prefill.

Expiry goes by the engine's own monotonic clock, time.perf_counter(), as vLLM's NIXL connector
does: a decode engine's remote_blocks_expiry_time is a reading of that clock (meaningless to any
other process), a prefill engine's is null.

One KvTransfer per data-parallel rank: as each of vLLM's DP ranks runs its own NIXL agent, its
kv_transfer_params name that rank's engine id, and a pull names it back so the server hands it
to the rank that holds the blocks (`EngineServer.kv_pull`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from aiohttp import web

from pdserve.sim.engine_config import EngineConfig, Faults, SimClock
from pdserve.sim.engine_core import EngineCore
from pdserve.sim.engine_metrics import RankMetrics
from pdserve.sim.http import error_response


@dataclass
class HeldBlocks:
    num_tokens: int
    expires_at: float  # time.perf_counter()
    token_ids: list[int] | None = None  # decode-side (bidirectional) holds know their tokens


class KvTransfer:
    """Blocks held for peers (they count against the scheduler's KV) and pulls from peers."""

    def __init__(
        self,
        config: EngineConfig,
        core: EngineCore,
        metrics: RankMetrics,
        faults: Faults,
        client: httpx.AsyncClient,
        engine_id: str,
    ) -> None:
        self.config, self.core, self.metrics, self.faults = config, core, metrics, faults
        self.client = client
        self.engine_id = engine_id  # this rank's NIXL engine id (EngineConfig.kv_engine_id)
        self.clock = SimClock(config.scheduler)
        self.held: dict[str, HeldBlocks] = {}

    # ---- producer side ---------------------------------------------------------------------------
    def expire_leases(self) -> None:
        now = time.perf_counter()
        for request_id, held in list(self.held.items()):
            if held.expires_at <= now:
                self.release(request_id)
                self.metrics.lease_expired()

    def release(self, request_id: str) -> None:
        held = self.held.pop(request_id, None)
        if held is not None:
            self.core.held_blocks -= -(-held.num_tokens // self.config.scheduler.block_size)

    def hold(
        self, request_id: str, num_tokens: int, *, token_ids: list[int] | None = None,
        lease: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Keep KV blocks for a peer to pull; returns the kv_transfer_params that point at them."""
        lease = self.config.transfer.lease_seconds if lease is None else lease
        self.release(request_id)
        expires_at = time.perf_counter() + lease * self.config.scheduler.time_scale
        self.held[request_id] = HeldBlocks(num_tokens, expires_at, token_ids)
        blocks = -(-num_tokens // self.config.scheduler.block_size)
        self.core.held_blocks += blocks
        return {
            "do_remote_prefill": token_ids is None,
            "do_remote_decode": False,
            "remote_block_ids": list(range(blocks)),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.config.advertise_host,
            "remote_port": self.config.port,
            "tp_size": 1,
            "remote_num_tokens": num_tokens,
            # vLLM: decode's time.perf_counter() + decoder_kv_blocks_ttl; null from prefill.
            "remote_blocks_expiry_time": None if token_ids is None else expires_at,
            "transfer_mode": "pull",
        }

    def give(self, body: Mapping[str, Any]) -> web.Response:
        """A peer's POST /sim/kv/pull for this rank: it takes the blocks held for a request."""
        self.expire_leases()
        request_id = str(body.get("remote_request_id"))
        if self.faults.expire_leases and request_id in self.held:
            self.release(request_id)
            self.metrics.lease_expired()
            return error_response(410, f"KV blocks of {request_id} expired")
        held = self.held.get(request_id)
        if held is None:
            return error_response(404, f"no KV blocks held for request {request_id}")
        self.release(request_id)
        return web.json_response(
            {
                "num_tokens": held.num_tokens,
                "bytes": held.num_tokens * self.config.transfer.bytes_per_token,
                "token_ids": held.token_ids,
            }
        )

    # ---- consumer side ---------------------------------------------------------------------------
    async def pull(
        self, params: Mapping[str, Any], prompt_ids: list[int], *, whole_prompt: bool
    ) -> tuple[int, str | None]:
        """Pull KV from a peer: (prompt tokens whose KV arrived, why it failed or None).
        whole_prompt: decode pulling prefill's KV (it must cover the prompt); otherwise prefill
        reusing decode's KV of an earlier turn (bidirectional), which only helps as far as the
        token ids agree: a template that strips <think> from history breaks the match early."""
        transfer = self.config.transfer
        started = time.monotonic()
        try:
            if self.faults.fail_transfers > 0:
                self.faults.fail_transfers -= 1
                raise RuntimeError("injected transfer failure")
            url = f"http://{params.get('remote_host')}:{params.get('remote_port')}/sim/kv/pull"
            response = await self.client.post(url, json={
                # The peer's server runs several ranks: the engine id names the one to ask.
                "remote_engine_id": params.get("remote_engine_id"),
                "remote_request_id": params.get("remote_request_id"),
                "remote_block_ids": params.get("remote_block_ids"),
            })  # fmt: skip
            if response.status_code != 200:
                message = response.json().get("error", {}).get("message", response.text)
                raise RuntimeError(f"peer refused: {message}")
            pulled = response.json()
            if whole_prompt:
                if pulled["num_tokens"] < len(prompt_ids) - 1:
                    raise RuntimeError("producer holds fewer tokens than the prompt")
                usable = len(prompt_ids)
            else:
                held = list(pulled.get("token_ids") or [])
                common = 0
                for mine, theirs in zip(prompt_ids, held, strict=False):
                    if mine != theirs:
                        break
                    common += 1
                block = self.config.scheduler.block_size
                usable = min(common - common % block, len(prompt_ids) - 1)
                self.metrics.reused(usable)
            seconds = usable * transfer.bytes_per_token / (transfer.bandwidth_gb_s * 1e9)
            seconds += transfer.overhead_ms / 1000 + transfer.poll_ms / 1000
            if self.faults.delay_transfers > 0:
                self.faults.delay_transfers -= 1
                seconds += self.faults.delay_ms / 1000
            await self.clock.sleep(seconds)
            self.metrics.transferred(
                self.clock.sim_seconds(time.monotonic() - started),
                usable * transfer.bytes_per_token,
            )
            return usable, None
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as error:
            self.metrics.transfer_failed()
            peer = f"{params.get('remote_host')}:{params.get('remote_port')}"
            return 0, f"KV transfer from {peer} failed: {error}"
