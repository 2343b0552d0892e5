"""POST /tokenize and POST /detokenize, as vLLM has them: a text prompt or a conversation to the
token ids the completion routes would run (`vllm bench serve` probes /tokenize to align its prompt
lengths), and token ids back to text. Both are bounded as the completion routes are: a text that
cannot fit the context is refused before it is tokenized, and /detokenize takes at most
max_model_len ids (two 30 MB bodies once took the API process from 1.5 to 11.4 GB)."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from ember.server.errors import APIError, validation_error
from ember.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from ember.server.serving import ServingContext
from ember.server.serving_chat import render_chat, tool_dicts

M = TypeVar("M", bound=BaseModel)
DETOKENIZE_BYTES_PER_ID = 16
"""JSON bytes allowed per id of /detokenize's limit (an id and its separator take at most 12)."""


class TokenizeHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, raw: Request) -> Response:
        body = await _json_object(raw)
        # vLLM's body is a union told apart by its fields: `messages` makes it a conversation.
        model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        req = _validate(model, body)
        self.ctx.check_model(req.model)
        if isinstance(req, TokenizeCompletionRequest):
            self.ctx.check_prompt_chars(len(req.prompt), "prompt")
        else:
            self.ctx.check_prompt_chars(sum(m.num_chars for m in req.messages), "messages")
        # Templating and tokenizing a large body take seconds: off the event loop.
        ids = await asyncio.to_thread(self._ids, req)
        tokenizer = self.ctx.engine.tokenizer
        strs = [tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
        return _json(
            {
                "count": len(ids),
                "max_model_len": self.ctx.engine.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(self, raw: Request) -> Response:
        limit = self.ctx.engine.max_model_len
        # Each id takes at most 12 bytes of JSON ("4294967295, "): a longer body is refused
        # before it is parsed into millions of Python ints.
        body = await _json_object(raw, max_bytes=DETOKENIZE_BYTES_PER_ID * limit + 4096)
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > limit:
            raise APIError(
                f"tokens holds {len(tokens)} ids; at most max_model_len={limit} are detokenized",
                param="tokens",
            )
        req = _validate(DetokenizeRequest, body)
        self.ctx.check_model(req.model)
        inputs = self.ctx.engine.inputs
        try:
            inputs.check_token_ids(req.tokens)
        except ValueError as e:
            raise APIError(str(e).replace("prompt token ids", "tokens"), param="tokens") from e
        # As vLLM: special tokens stay in the text (it decodes a prompt, not an answer).
        text = await asyncio.to_thread(inputs.tokenizer.decode, req.tokens, False)
        return _json({"prompt": text})

    def _ids(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        inputs = self.ctx.engine.inputs
        if isinstance(req, TokenizeCompletionRequest):
            text = req.prompt
        else:
            text = render_chat(
                self.ctx,
                req.messages,
                tool_dicts(req.tools),
                req.add_generation_prompt,
                req.chat_template_kwargs,
            )
            self.ctx.check_prompt_chars(len(text), "messages")  # tools and template included
        return inputs.encode([text], add_special_tokens=req.add_special_tokens)[0]


def _json(body: dict[str, Any]) -> Response:
    # orjson, not FastAPI's encoder: a long prompt's ids are a list of 100k ints.
    return Response(orjson.dumps(body), media_type="application/json")


async def _json_object(raw: Request, max_bytes: int | None = None) -> dict[str, Any]:
    """The body as a JSON object, parsed strictly (orjson, as StrictJSONRoute): a 400 otherwise
    (a 413 over `max_bytes`)."""
    data = await raw.body()
    if max_bytes is not None and len(data) > max_bytes:
        raise APIError(f"the request body is over {max_bytes} bytes", 413, code="request_too_large")
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise APIError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def _validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from e
