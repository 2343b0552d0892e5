"""POST /tokenize and POST /detokenize, as vLLM has them: a text prompt or a conversation to the
token ids the completion routes would run (`vllm bench serve` probes /tokenize to align its prompt
lengths), and token ids back to text."""

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


class TokenizeHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def tokenize(self, raw: Request) -> Response:
        body = await _json_object(raw)
        # vLLM's body is a union told apart by its fields: `messages` makes it a conversation.
        model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        req = _validate(model, body)
        self.ctx.check_model(req.model)
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
        req = _validate(DetokenizeRequest, await _json_object(raw))
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
        return inputs.encode([text], add_special_tokens=req.add_special_tokens)[0]


def _json(body: dict[str, Any]) -> Response:
    # orjson, not FastAPI's encoder: a long prompt's ids are a list of 100k ints.
    return Response(orjson.dumps(body), media_type="application/json")


async def _json_object(raw: Request) -> dict[str, Any]:
    """The body as a JSON object, parsed strictly (orjson, as StrictJSONRoute): a 400 otherwise."""
    try:
        body = orjson.loads(await raw.body())
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
