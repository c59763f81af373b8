"""The OpenAI request bodies the gateway accepts (`/v1/chat/completions`, `/v1/completions`),
checked at the boundary, before any render server or engine sees them.

The models describe the parameters the gateway or vLLM read, with vLLM's bounds (vLLM runs
the engines; its own checks would refuse the same values later, after a render or a prefill
was spent on them). Types are strict as in OpenAI's API: `"0.5"` is not a number, `1` is not
true. Parameters not listed here are allowed and forwarded untouched (vLLM accepts, and
ignores or uses, extras of its own and of newer OpenAI versions). Validation only checks: the
client's dict, not a dump of the model, is what goes upstream."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


@dataclass(frozen=True)
class Expected:
    """What a field must be, as its 400 says it: `temperature must be <text>`."""

    text: str


class InvalidRequest(ValueError):
    """A body the schema refuses: `param` names the field (`messages[0].role`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


Number = StrictFloat | StrictInt
Flag = Annotated[StrictBool | None, Expected("true or false")]
PositiveInt = Annotated[StrictInt | None, Field(ge=1), Expected("a positive integer")]
Penalty = Annotated[Number | None, Field(ge=-2, le=2), Expected("a number from -2 to 2")]
Probability = Annotated[Number | None, Field(ge=0, le=1), Expected("a number from 0 to 1")]
Text = Annotated[StrictStr | None, Expected("a string")]
Object = Annotated[dict[str, Any] | None, Expected("an object")]
NON_EMPTY_MESSAGES = "messages: must be a non-empty list"
"""The render servers' own words for it, which clients already see."""


class _Body(BaseModel):
    # Extras are allowed (see the module's doc); NaN and infinities (which Python's JSON
    # parser reads) are not numbers any engine can use.
    model_config = ConfigDict(
        extra="allow", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )


class StreamOptions(_Body):
    include_usage: Flag = None
    """A last chunk with the usage and no choices."""
    continuous_usage_stats: Flag = None
    """vLLM: the usage so far in every chunk."""


class Function(_Body):
    name: Annotated[StrictStr, Expected("a string")]
    description: Text = None
    parameters: Object = None
    """The arguments' JSON schema."""


class Tool(_Body):
    type: Annotated[StrictStr, Expected("a string")] = "function"
    function: Annotated[Function, Expected("an object with the function's name")]


class NamedFunction(_Body):
    name: Annotated[StrictStr, Expected("a string")]


class NamedToolChoice(_Body):
    type: Annotated[StrictStr, Expected("a string")] = "function"
    function: Annotated[NamedFunction, Expected("an object with the function's name")]


class ResponseFormat(_Body):
    type: Annotated[StrictStr, Expected("a string (text, json_object, json_schema...)")]
    json_schema: Object = None


class Message(_Body):
    role: Annotated[StrictStr, Expected("a string (system, user, assistant, tool...)")]
    content: Annotated[
        StrictStr | list[dict[str, Any]] | None,
        Expected("a string or a list of content parts"),
    ] = None
    """Text, or parts (text, images...) the render server or engine understands."""
    name: Text = None
    tool_call_id: Text = None
    tool_calls: Annotated[list[dict[str, Any]] | None, Expected("a list of tool calls")] = None


class Sampling(_Body):
    """What both endpoints share: the model, streaming, and vLLM's sampling parameters."""

    model: Text = None
    """Checked against the served model before the schema (404 for another)."""
    stream: Flag = None
    stream_options: Annotated[StreamOptions | None, Expected("an object")] = None
    max_tokens: PositiveInt = None
    n: PositiveInt = None
    """Choices per request."""
    best_of: PositiveInt = None
    """Candidates generated, the best `n` returned: at least `n`."""
    temperature: Annotated[Number | None, Field(ge=0), Expected("a non-negative number")] = None
    top_p: Annotated[Number | None, Field(gt=0, le=1), Expected("a number in (0, 1]")] = None
    top_k: Annotated[
        StrictInt | None, Field(ge=-1), Expected("an integer: -1 or 0 (off), or at least 1")
    ] = None
    """vLLM."""
    min_p: Probability = None
    """vLLM."""
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: Annotated[Number | None, Field(gt=0), Expected("a positive number")] = None
    """vLLM."""
    seed: Annotated[StrictInt | None, Expected("an integer")] = None
    stop: Annotated[
        StrictStr | list[StrictStr] | None, Expected("a string or a list of strings")
    ] = None
    stop_token_ids: Annotated[
        list[StrictInt] | None, Expected("a list of token ids (integers)")
    ] = None
    """vLLM."""
    logit_bias: Annotated[
        dict[str, Number] | None, Expected("an object of token ids to numbers")
    ] = None
    user: Text = None
    min_tokens: Annotated[StrictInt | None, Field(ge=0), Expected("a non-negative integer")] = None
    """vLLM: tokens generated before a stop or EOS may end the answer."""
    ignore_eos: Flag = None
    """vLLM."""
    skip_special_tokens: Flag = None
    """vLLM."""
    spaces_between_special_tokens: Flag = None
    """vLLM."""
    include_stop_str_in_output: Flag = None
    """vLLM."""
    echo: Flag = None
    prompt_logprobs: Annotated[
        StrictInt | None, Field(ge=-1), Expected("an integer, at least -1 (all)")
    ] = None
    """vLLM."""
    truncate_prompt_tokens: Annotated[
        StrictInt | None, Field(ge=-1), Expected("an integer, at least -1")
    ] = None
    """vLLM."""
    response_format: Annotated[ResponseFormat | None, Expected("an object with a type")] = None
    structured_outputs: Object = None
    """vLLM: a constraint on the output (json, regex, choice, grammar, structural_tag...)."""
    priority: Annotated[StrictInt | None, Expected("an integer")] = None
    """vLLM's priority scheduling."""
    conversation_id: Annotated[StrictStr | StrictInt | None, Expected("a string")] = None
    """pdserve: keeps a conversation's turns on the same engines."""

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> Sampling:
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise PydanticCustomError("best_of", "best_of must be at least n")
        return self


class ChatRequest(Sampling):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[Message], Field(validate_default=True)] = []
    """At least one."""
    max_completion_tokens: PositiveInt = None
    logprobs: Flag = None
    """Log probabilities of the output tokens."""
    top_logprobs: Annotated[
        StrictInt | None, Field(ge=-1), Expected("an integer, at least -1 (all)")
    ] = None
    """Alternatives per output token; above 0 needs `logprobs: true`."""
    tools: Annotated[list[Tool] | None, Expected("a list of tools")] = None
    tool_choice: Annotated[
        Literal["none", "auto", "required"] | NamedToolChoice | None,
        Expected('"none", "auto", "required" or an object naming a function'),
    ] = None
    parallel_tool_calls: Flag = None
    chat_template: Text = None
    """vLLM."""
    chat_template_kwargs: Object = None
    """vLLM: passed to the chat template (`enable_thinking`...)."""
    add_generation_prompt: Flag = None
    """vLLM."""
    continue_final_message: Flag = None
    """vLLM."""
    reasoning_effort: Text = None

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise PydanticCustomError("messages", NON_EMPTY_MESSAGES)
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if (self.top_logprobs or 0) > 0 and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs needs logprobs: true")
        return self


class CompletionRequest(Sampling):
    """`POST /v1/completions`."""

    prompt: Annotated[
        StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]] | None,
        Expected("a string, a list of strings, or token ids"),
    ] = None
    """Required unless vLLM's `prompt_embeds` is sent instead."""
    suffix: Text = None
    logprobs: Annotated[
        StrictInt | None, Field(ge=-1), Expected("an integer, at least -1 (all)")
    ] = None
    """Log probabilities of the this many most likely tokens at each position."""

    @model_validator(mode="after")
    def _a_prompt(self) -> CompletionRequest:
        if self.prompt is None and (self.model_extra or {}).get("prompt_embeds") is None:
            raise PydanticCustomError("prompt", "prompt is required")
        return self


GATEWAY_OWNED = ("kv_transfer_params", "ec_transfer_params")
"""What only the gateway may send an engine: where to pull (or hand off) a request's KV or
encoder cache. vLLM reads them from the request or from `vllm_xargs` (sampling params'
extra_args, where its engine looks), and a render server passes both on into the generate
request: from a client they would point an engine at any host, or hold its KV blocks."""


def gateway_owned(body: dict[str, Any]) -> str | None:
    """The first parameter of a body that sets what only the gateway may (GATEWAY_OWNED, at
    the top level or inside vllm_xargs), named as the client sent it; None when none."""
    for field in GATEWAY_OWNED:
        if body.get(field) is not None:
            return field
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        for field in GATEWAY_OWNED:
            if xargs.get(field) is not None:
                return f"vllm_xargs.{field}"
    return None


def logprobs_asked(body: dict[str, Any], *, chat: bool) -> str | None:
    """The parameter of a (valid) body that asks for log probabilities, if any."""
    if chat and (body.get("logprobs") or (body.get("top_logprobs") or 0) > 0):
        return "logprobs"
    if not chat and body.get("logprobs") is not None:
        return "logprobs"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    return None


STRUCTURED_FORMATS = frozenset({"json_schema", "json_object", "structural_tag"})
"""response_format types vLLM serves with structured outputs (`text` is none)."""
GUIDED_PARAMS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older structured-output parameters: read as extras (vLLM versions differ on them,
so their values are not checked here), only for whether they are set."""


@dataclass(frozen=True)
class NeedsTokenizer:
    """A parameter only an engine with a tokenizer serves (a `--tokens-only` engine refuses
    it): what the engine would have to do for it, and what a client can send instead."""

    param: str
    task: str
    instead: str


def needs_tokenizer(request: ChatRequest | CompletionRequest) -> NeedsTokenizer | None:
    """The first parameter of a (valid) request that needs the engine to detokenize (stop
    strings) or to constrain its output (structured outputs, which vLLM's render also makes of
    a forced tool call); None when a tokens-only engine serves it whole."""
    if request.stop is not None and request.stop != []:
        return NeedsTokenizer("stop", "apply stop strings", "use stop_token_ids")
    structured = "apply structured outputs (they need a tokenizer)"
    if request.response_format is not None and request.response_format.type in STRUCTURED_FORMATS:
        return NeedsTokenizer("response_format", structured, 'use response_format type "text"')
    if request.structured_outputs is not None:
        return NeedsTokenizer("structured_outputs", structured, "drop structured_outputs")
    extra = request.model_extra or {}
    for param in GUIDED_PARAMS:
        if extra.get(param) is not None:
            return NeedsTokenizer(param, structured, f"drop {param}")
    if isinstance(request, ChatRequest) and (
        request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)
    ):
        return NeedsTokenizer(
            "tool_choice",
            "force a tool call (vLLM forces one with structured outputs, which need a tokenizer)",
            'use tool_choice "auto"',
        )
    return None


# Which field a model-level check is about: its error carries this as its type.
_WHOLE_BODY_CHECKS = {"best_of", "top_logprobs", "prompt", "messages"}


def validate_request(body: dict[str, Any], *, chat: bool) -> ChatRequest | CompletionRequest:
    """The body as the schema reads it; InvalidRequest naming the first field it refuses."""
    schema = ChatRequest if chat else CompletionRequest
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        raise _invalid(schema, error) from None


def _invalid(schema: type[BaseModel], error: ValidationError) -> InvalidRequest:
    item = error.errors(include_url=False)[0]
    if item["type"] in _WHOLE_BODY_CHECKS:
        return InvalidRequest(item["msg"], item["type"])
    path, index, expected, inside_union = _field(schema, tuple(item["loc"]))
    if inside_union and expected is not None:
        return InvalidRequest(f"{path} must be {expected}", path)  # no member fits
    if item["type"] == "missing":
        return InvalidRequest(f"{path} is required", path)
    if item["type"] in ("model_type", "dict_type"):
        path, expected = path + index, "an object"  # a list's item: `messages[0]`
    if expected is None:
        return InvalidRequest(f"{path}: {item['msg']}", path)
    return InvalidRequest(f"{path} must be {expected}", path)


def _field(
    schema: type[BaseModel], loc: tuple[int | str, ...]
) -> tuple[str, str, str | None, bool]:
    """The client's name of the field an error is about (`messages[0].role`; pydantic's union
    member names cut off), the item index below it (`[2]` of `stop_token_ids[2]`: the field
    is named whole), what that field must be, and whether the error was about one member of
    a union (then the member's own complaint says less than the field's expectation)."""
    path, index, expected = "", "", None
    model: Any = schema
    for part in loc:
        if isinstance(part, int):
            index += f"[{part}]"
            continue
        fields = model.model_fields if _is_model(model) else {}
        if part not in fields:
            return path or "body", index, expected, True  # a union member's name
        info = fields[part]
        path, index = (f"{path}{index}.{part}" if path else part), ""
        expected = next((m.text for m in info.metadata if isinstance(m, Expected)), None)
        model = _inner_model(info.annotation)
    return path or "body", index, expected, False


def _is_model(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    """The model inside `Message`, `list[Message]`, `Tool | None`...: where a nested error's
    next field is looked up."""
    if _is_model(annotation):
        return annotation  # type: ignore[no-any-return]
    for arg in getattr(annotation, "__args__", ()):
        if (inner := _inner_model(arg)) is not None:
            return inner
    return None
