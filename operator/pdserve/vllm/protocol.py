"""Small pieces of vLLM's wire contract shared by the simulators, the gateway and the tests.

The bodies the Python gateway sends are built here: the prefill and decode requests of both
engine APIs, the derender calls and the aborts. The compiled data plane builds the same bodies
from the bytes it received (dataplane/render.go, main.go, bidirectional.go), held to these by
the shared cases in dataplane/testdata (engine_bodies.json, bidirectional_cases.json), which
the tests of both read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
"""vLLM's scale-out abort: served by `--tokens-only` and `--enable-scale-out` engines alike, and
guarded by --api-key like the rest of /inference (the legacy `/abort_requests` is served only by
--tokens-only engines, without the key)."""


def generate_request_id(request_id: str) -> str:
    """What a generate request is called on the engine: /inference/v1/generate names its work
    `generate-tokens-<id>`, <id> being the X-Request-Id header when one is sent, else the body's
    request_id. An abort must name that: the bare id aborts nothing."""
    return f"generate-tokens-{request_id}"


def prefill_handoff_params() -> dict[str, Any]:
    """kv_transfer_params of the request sent to a prefill engine (NixlConnector, P/D step 1):
    the prefill engine answers with where decode can pull the KV from."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def reuse_decode_kv_params(
    held: Mapping[str, Any], matched_tokens: int, block_size: int
) -> dict[str, Any]:
    """kv_transfer_params pointing prefill at the KV a decode engine still holds from the
    conversation's last turn (bidirectional KV), still asking prefill to hand off to decode.

    Prefill loads the first `remote_num_tokens` of its prompt from those blocks without
    comparing tokens (vLLM's NixlConnector), so they are cut to the whole blocks of the prefix
    the new prompt shares with the held turn: decode holds the turn as it generated it, and
    the next prompt's history can differ (a template that drops <think>, an edited message);
    loading past the shared prefix answers from the wrong context."""
    usable = min(int(held.get("remote_num_tokens") or 0), matched_tokens)
    blocks = usable // block_size
    return {
        **held,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_num_tokens": blocks * block_size,
        "remote_block_ids": _first_blocks(held.get("remote_block_ids"), blocks),
    }


def _first_blocks(block_ids: Any, count: int) -> Any:
    """The first `count` block ids, of one list or of each KV cache group's list."""
    if not isinstance(block_ids, list):
        return block_ids
    if block_ids and all(isinstance(group, list) for group in block_ids):
        return [group[:count] for group in block_ids]
    return block_ids[:count]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# ---- OpenAI-level engines ------------------------------------------------------------------------
def openai_path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def openai_prefill_body(request: Mapping[str, Any], handoff: Mapping[str, Any]) -> dict[str, Any]:
    """The client's request cut to prefill only: one token, one choice, not streamed."""
    body = {**request, "stream": False, "max_tokens": 1, "n": 1}
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for field in ("stream_options", "min_tokens"):
        body.pop(field, None)
    body["kv_transfer_params"] = handoff
    return body


def openai_decode_body(request: Mapping[str, Any], kv: Mapping[str, Any] | None) -> dict[str, Any]:
    """The client's request, with prefill's kv_transfer_params when there are any."""
    return {**request, **({"kv_transfer_params": kv} if kv else {})}


# ---- tokens engines (render servers in front) ----------------------------------------------------
def render_path(chat: bool) -> str:
    return "/v1/chat/completions/render" if chat else "/v1/completions/render"


def derender_path(chat: bool) -> str:
    return "/v1/chat/completions/derender" if chat else "/v1/completions/derender"


SAMPLING_DEFAULT_MAX_TOKENS = 16
"""vLLM's SamplingParams.max_tokens default, which its render server leaves out of the sampling
params it answers (msgspec's omit_defaults; vLLM 0.32)."""


def with_rendered_limit(generate: dict[str, Any]) -> dict[str, Any]:
    """The rendered generate request with the output limit render resolved written out.

    Render resolves every request's max_tokens as vLLM's own /v1/chat/completions does (the
    client's max_completion_tokens, else max_tokens, else the context left, each capped by the
    context left and the server's overrides), then serialises its SamplingParams without the
    fields equal to their defaults: a resolved 16 is left out. A tokens engine reads a missing
    max_tokens as not given and resolves its own limit, the whole context left (vLLM 0.32's
    /inference/v1/generate): a client's 16 would become ~2,000 tokens. Absent can only mean 16,
    so it is written back; the client's own number would skip render's caps."""
    params = generate["sampling_params"]
    if "max_tokens" in params:
        return generate
    return {**generate, "sampling_params": {**params, "max_tokens": SAMPLING_DEFAULT_MAX_TOKENS}}


def tokens_prefill_body(generate: Mapping[str, Any], handoff: Mapping[str, Any]) -> dict[str, Any]:
    """The rendered generate request cut to prefill only (one token, one choice, not
    streamed), with the handoff's kv_transfer_params."""
    # Copied down to what changes: the token ids (most of the body) are shared, not copied.
    body = dict(generate)
    body["stream"] = False
    body["stream_options"] = None
    params = body["sampling_params"] = dict(body["sampling_params"])
    params.update({"max_tokens": 1, "min_tokens": 0, "n": 1})
    body["kv_transfer_params"] = handoff
    # Older engines read it only from extra_args.
    params["extra_args"] = {**(params.get("extra_args") or {}), "kv_transfer_params": handoff}
    return body


def tokens_decode_body(generate: Mapping[str, Any], kv: Mapping[str, Any] | None) -> dict[str, Any]:
    """The rendered generate request, pulling prefill's KV when `kv` is given (else decode
    prefills itself)."""
    body = dict(generate)
    if kv is not None:
        body["kv_transfer_params"] = dict(kv)
        params = body["sampling_params"] = dict(body["sampling_params"])
        # Older engines read it only from extra_args.
        params["extra_args"] = {
            **(params.get("extra_args") or {}),
            "kv_transfer_params": dict(kv),
        }
    return body


class DerenderChatRequest(TypedDict):
    """A whole chat generate answer turned back into a ChatCompletionResponse."""

    stream: bool
    model: str
    generate_response: Mapping[str, Any]
    prompt_tokens: int
    prompt_token_ids: list[int]
    chat_request: Mapping[str, Any]


class DerenderCompletionRequest(TypedDict):
    """Whole completion answers turned back into a CompletionResponse: one generate answer per
    prompt (vLLM's multi-prompt shape; the gateway sends one prompt per request)."""

    stream: bool
    model: str
    generate_responses: list[Mapping[str, Any]]
    prompt_tokens: list[int]
    prompt_token_ids: list[list[int]]
    completion_request: Mapping[str, Any]


DerenderRequest = DerenderChatRequest | DerenderCompletionRequest


class ChunkChoice(TypedDict):
    index: int
    token_ids: list[int]
    finish_reason: str | None
    logprobs: None


class GenerateChunk(TypedDict):
    request_id: str
    choices: list[ChunkChoice]


class DerenderStreamRequest(TypedDict, total=False):
    """Tokens of one streamed choice turned into an OpenAI chunk; `stream_state` carries the
    detokenizer's state from the previous call of the same choice. The client's request goes
    as `chat_request` or `completion_request`, by route."""

    stream: bool
    model: str
    stream_state: Any
    generate_chunk: GenerateChunk
    prompt_tokens: int
    prompt_token_ids: list[int]
    chat_request: Mapping[str, Any]
    completion_request: Mapping[str, Any]


def derender_body(
    model: str,
    answer: Mapping[str, Any],
    prompt_ids: list[int],
    request: Mapping[str, Any],
    *,
    chat: bool,
) -> DerenderRequest:
    if chat:
        return {
            "stream": False,
            "model": model,
            "generate_response": answer,
            "prompt_tokens": len(prompt_ids),
            "prompt_token_ids": prompt_ids,
            "chat_request": request,
        }
    return {
        "stream": False,
        "model": model,
        "generate_responses": [answer],
        "prompt_tokens": [len(prompt_ids)],
        "prompt_token_ids": [prompt_ids],
        "completion_request": request,
    }


def derender_chunk_body(
    model: str,
    request_id: str,
    state: Any,
    choice: ChunkChoice,
    prompt_ids: list[int],
    request: Mapping[str, Any],
    *,
    chat: bool,
) -> DerenderStreamRequest:
    body: DerenderStreamRequest = {
        "stream": True,
        "model": model,
        "stream_state": state,
        "generate_chunk": {"request_id": request_id, "choices": [choice]},
        "prompt_tokens": len(prompt_ids),
        "prompt_token_ids": prompt_ids,
    }
    if chat:
        body["chat_request"] = request
    else:
        body["completion_request"] = request
    return body


def ends_on_stop_token(choice: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """Whether a generate choice's last token id is the stop token that ended it: vLLM keeps
    an EOS (stop_reason null) or a stop_token_ids hit (stop_reason the id) in `token_ids`,
    and `vllm serve` leaves it out of the text unless include_stop_str_in_output; derender
    would decode it into the content (vLLM 0.32)."""
    return (
        choice.get("finish_reason") == "stop"
        and not isinstance(choice.get("stop_reason"), str)
        and not params.get("include_stop_str_in_output")
        and bool(choice.get("token_ids"))
    )


def stop_string_of(choice: Mapping[str, Any], params: Mapping[str, Any]) -> str | None:
    """The stop string that ended a generate choice, when the text must end before it: the
    engine stops on the token that completes it, and derender decodes that whole token."""
    reason = choice.get("stop_reason")
    if choice.get("finish_reason") != "stop" or not isinstance(reason, str) or not reason:
        return None
    return None if params.get("include_stop_str_in_output") else reason


class AbortRequest(TypedDict):
    request_ids: list[str]


def abort_body(request_id: str) -> AbortRequest:
    """The abort of the generate request sent as `request_id` (its X-Request-Id)."""
    return {"request_ids": [generate_request_id(request_id)]}
