"""Request bodies of the OpenAI API as pydantic models (the HTTP edge), and their translation into
engine sampling parameters. Unknown fields are ignored, as OpenAI does.

Every field is range-checked here to what the engine can represent, so no request reaches the core
with a value it cannot hold: integers are strict (no "5", no true), floats finite, token ids within
int32 (and the vocabulary: `check_vocab`), JSON objects at most MAX_JSON_DEPTH deep."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.responses import Response

from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.server.errors import APIError

MAX_N = 128
MAX_LOGPROBS = 20
"""Top alternatives a position may return (OpenAI's limit, vLLM's default max_logprobs)."""
MAX_PROMPTS = 1024
"""Prompts in one completions request (each is a sequence, times n, for admission)."""
MAX_STOP = 64
MAX_STOP_CHARS = 1024
"""A stream holds back as many characters as the longest stop string, so that bounds it too."""
MAX_STOP_TOKEN_IDS = 1024
MAX_TOOLS = 128
"""OpenAI's own limit on tools per request."""
MAX_JSON_DEPTH = 64
"""Nesting of any JSON object a request carries (schemas, tool parameters, template kwargs).
Measured: llguidance stops compiling a schema at 128 levels, orjson stops encoding at 255."""
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _depth_ok(value: Any) -> Any:
    """Reject JSON values nested past MAX_JSON_DEPTH (iteratively: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return value


JSONObject = Annotated[dict[str, Any], AfterValidator(_depth_ok)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class StrictJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """Request bodies parsed as strict JSON (orjson): a lone surrogate ("\\ud800"), NaN, Infinity
    or nesting past 1024 levels is a 400 here, where Python's json would hand them on to fail
    later (a surrogate cannot be tokenized nor written back out)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return route


class _Model(BaseModel):
    # strict: OpenAI rejects "5" for an integer and 1 for a boolean (floats still take ints);
    # no NaN or infinity reaches a sampler.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class FunctionDef(_Model):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.\-]+$")
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: NamedFunction


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Model):
    name: str
    arguments: str | JSONObject = "{}"


class MessageToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatMessage:
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id'")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        return self

    @property
    def num_chars(self) -> int:
        """Characters of text this message puts into the prompt (tool calls aside)."""
        if isinstance(self.content, list):
            text = sum(len(p.text) for p in self.content)
        else:
            text = len(self.content or "")
        return text + len(self.reasoning_content or "")

    def for_template(self) -> dict[str, Any]:
        """The dict a chat template sees: text parts joined, tool-call arguments as objects."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if isinstance(self.content, list):
            msg["content"] = "".join(p.text for p in self.content)
        else:
            msg["content"] = self.content
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in self.tool_calls]
        return msg


class StructuredOutputs(_Model):
    """vLLM's extension: constrain the output to a JSON schema, a regex or a Lark grammar."""

    json_schema: JSONObject | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None

    model_config = ConfigDict(
        extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True
    )

    def params(self) -> StructuredOutputsParams:
        schema = self.json_schema
        if isinstance(schema, dict):
            schema = json.dumps(schema)
        return StructuredOutputsParams(json=schema, regex=self.regex, lark=self.grammar)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONObject | None = None


class _Sampling(_Model):
    """Fields shared by chat and completions."""

    model: str | None = Field(default=None, max_length=1024)  # echoed in a 404: bounded
    # An output budget past the context is lowered to what the prompt leaves (resolve_max_tokens);
    # one past int32 is refused here, like every count, so no arithmetic downstream meets it.
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # and <= vocab: check_vocab
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: StopString | list[StopString] | None = Field(default=None, max_length=MAX_STOP)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    seed: int | None = Field(default=None, ge=-(2**63), le=INT64_MAX)
    """Sample i draws with seed + i (an int64 in the core): see `_check_seed`."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    structured_outputs: StructuredOutputs | None = None
    kv_transfer_params: JSONObject | None = None
    """Prefill/decode disaggregation (vLLM's field): set by the router, see KVTransferParams."""
    cache_salt: str | None = Field(default=None, max_length=256)
    """vLLM's field: prompts share cached prefix blocks only with requests of the same salt."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's field: score the prompt (each token's logprob and this many alternatives). The whole
    prompt is computed, without prefix-cache hits."""
    speculative: bool = True
    """ember's field: false keeps this request out of speculative decoding on a server that runs
    it (the output distribution is the same either way; false only spares the drafts' work)."""

    @model_validator(mode="after")
    def _check_seed(self) -> _Sampling:
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ValueError(f"seed + n - 1 must be at most {INT64_MAX} (sample i uses seed + i)")
        return self

    def check_prompt_logprobs(self) -> None:
        """vLLM's rule: a stream carries no prompt logprobs, so asking for alternatives is a 400."""
        if self.stream and self.prompt_logprobs:
            raise APIError(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )

    def check_vocab(self, vocab_size: int) -> None:
        """What the model's vocabulary bounds; a 400 naming the field otherwise."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise APIError(
                f"top_k must be -1, 0 or at most the vocabulary size {vocab_size}, got {self.top_k}",
                param="top_k",
            )
        bad = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if bad:
            raise APIError(
                f"stop_token_ids out of the vocabulary [0, {vocab_size}): {bad[:5]}",
                param="stop_token_ids",
            )

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        skip_special_tokens: bool | None = None,
        structured: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=(
                self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
            ),
            structured_outputs=structured
            or (self.structured_outputs.params() if self.structured_outputs else None),
            speculative=self.speculative,
        )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: JSONObject | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, "
                    "which is not among the request's tools"
                )
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs at least one tool")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens (OpenAI's and vLLM's rule)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    """0 only with echo: score the prompt and generate nothing (OpenAI's and vLLM's behaviour)."""
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.num_prompts > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return self

    @property
    def echo_only(self) -> bool:
        """Score the prompt only: the answer is the prompt, no output tokens (one is generated)."""
        return self.echo and self.max_tokens == 0

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt position to compute: echo with logprobs returns the prompt's
        logprobs ahead of the output's, as vLLM does."""
        asked = None if self.stream else self.prompt_logprobs  # a stream does not carry them
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, asked or 0)
        return asked

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or isinstance(p[0], int) else len(p)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TokenizeCompletionRequest(_Model):
    """vLLM's POST /tokenize for a text prompt (`vllm bench serve` probes it)."""

    model: str | None = Field(default=None, max_length=1024)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Model):
    """vLLM's POST /tokenize for a conversation: the prompt the chat route would run."""

    model: str | None = Field(default=None, max_length=1024)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    """vLLM's default: the chat template already has the special tokens."""
    chat_template_kwargs: JSONObject | None = None
    return_token_strs: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None

    # Refused rather than ignored: ignoring them would count a prompt other than the one asked for.
    @field_validator("continue_final_message")
    @classmethod
    def _no_continue(cls, v: bool) -> bool:
        if v:
            raise ValueError("continue_final_message is not supported")
        return v

    @field_validator("chat_template")
    @classmethod
    def _no_template(cls, v: str | None) -> str | None:
        if v is not None:
            raise ValueError("a chat template from the request is not accepted (as vLLM's default)")
        return v


class DetokenizeRequest(_Model):
    model: str | None = Field(default=None, max_length=1024)
    tokens: list[TokenId]
    """Within int32 here; within the vocabulary: checked by the handler."""
