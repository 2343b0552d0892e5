"""POST /v1/chat/completions: render the chat template, generate, parse tool calls, and answer in
OpenAI's exact shapes, streamed (SSE chunks ending in `data: [DONE]`) or whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember.engine.async_llm import RequestStream
from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams, StructuredOutputsParams
from ember.server.errors import APIError
from ember.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, Tool
from ember.server.serving import (
    DONE,
    ServingContext,
    chat_logprobs,
    new_id,
    prepares_inline,
    prompt_logprobs_body,
    sse,
    stop_holdback,
    stream_error,
    usage,
    watch_disconnect,
)
from ember.server.tool_parsers import get_tool_parser
from ember.server.tool_parsers.base import ToolParser


@dataclass(slots=True)
class _Choice:
    """Streaming progress of one choice."""

    parser: ToolParser | None
    sent_chars: int = 0
    sent_tokens: int = 0
    tool_calls: int = 0
    done: bool = False


def tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template sees them."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def render_chat(
    ctx: ServingContext,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    chat_template_kwargs: dict[str, Any] | None,
) -> str:
    """The prompt text of a conversation (encode it without special tokens: the template has
    them). Blocking: call it off the event loop. /tokenize renders through here too, so the count
    it reports is the prompt the chat route runs."""
    try:
        return ctx.engine.tokenizer.apply_chat_template(
            [m.for_template() for m in messages],
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
    except (ValueError, TypeError, RecursionError) as e:
        raise APIError(f"cannot render the chat template: {e}", param="messages") from e


class ChatHandler:
    def __init__(self, ctx: ServingContext, tool_parser: str | None) -> None:
        self.ctx = ctx
        self.parser_cls = get_tool_parser(tool_parser) if tool_parser else None

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        req.check_vocab(ctx.engine.inputs.vocab_size)
        req.check_prompt_logprobs()
        ctx.check_prompt_chars(sum(m.num_chars for m in req.messages), "messages")
        with ctx.admit(req.n):
            cache_salt, kv_transfer = ctx.trusted_inputs(raw, req)
            if self._small(req):
                ids, params, parser, tools = self._prepare(req, cache_salt)
            else:  # templating, tokenizing or compiling a grammar takes seconds on a large body
                ids, params, parser, tools = await asyncio.to_thread(self._prepare, req, cache_salt)
            rid = new_id("chatcmpl")
            stream = await ctx.submit(rid, ids, params, cache_salt, kv_transfer)
        # Each choice streams through a parser of its own (they keep state).
        make_parser = (lambda: type(parser)(tools)) if parser is not None else None
        if req.stream:
            body = self._stream(req, model, rid, stream, raw, make_parser, stop_holdback(params))
            return StreamingResponse(body, media_type="text/event-stream")
        return await self._full(req, model, rid, stream, raw, make_parser)

    @staticmethod
    def _small(req: ChatCompletionRequest) -> bool:
        """A chat without tools or tool calls (an agent's schemas and arguments are large and
        uncounted here) and without a grammar, of at most INLINE_PREPARE_SIZE characters."""
        if req.tools or any(m.tool_calls for m in req.messages):
            return False
        fmt = req.response_format
        grammar = req.structured_outputs is not None or (fmt is not None and fmt.type != "text")
        return prepares_inline(sum(m.num_chars for m in req.messages), grammar)

    def _prepare(
        self, req: ChatCompletionRequest, cache_salt: str | None
    ) -> tuple[list[int], SamplingParams, ToolParser | None, list[dict[str, Any]] | None]:
        """The prompt's token ids, the sampling parameters, the tool parser and the tools.
        `cache_salt`: the namespace of the prompt's tokenization cache (the prefix cache's)."""
        ctx = self.ctx
        tools = tool_dicts(req.tools)
        text = render_chat(
            ctx, req.messages, tools, req.add_generation_prompt, req.chat_template_kwargs
        )
        ctx.check_prompt_chars(len(text), "messages")
        ids = ctx.engine.inputs.encode_chat(text, cache_salt)
        max_tokens = ctx.resolve_max_tokens(len(ids), req.requested_max_tokens, "messages")
        use_tools = bool(req.tools) and req.tool_choice != "none" and self.parser_cls is not None
        parser = self.parser_cls(tools) if use_tools and self.parser_cls is not None else None
        skip_special = parser.adjust_skip_special_tokens() if parser is not None else None
        try:
            structured = self._structured(req, parser)
            # A stream carries no prompt logprobs (vLLM's rule): none computed for it.
            prompt_logprobs = None if req.stream else req.prompt_logprobs
            params = req.sampling_params(
                max_tokens, req.num_logprobs, skip_special, structured, prompt_logprobs
            )
            if params.structured_outputs is not None:
                ctx.engine.grammar.validate(params.structured_outputs)
        except ValueError as e:
            raise APIError(str(e)) from e
        return ids, params, parser, tools

    def _structured(
        self, req: ChatCompletionRequest, parser: ToolParser | None
    ) -> StructuredOutputsParams | None:
        """The grammar that `tool_choice` (required or named) or `response_format` imposes."""
        choice = req.tool_choice
        if req.tools and choice not in (None, "auto", "none"):
            name = choice.function.name if isinstance(choice, NamedToolChoice) else None
            grammar = None
            if parser is not None:
                grammar = parser.forced_call_grammar(
                    name,
                    req.parallel_tool_calls is not False,
                    token_id=self.ctx.engine.tokenizer.token_to_id,
                )
            if grammar is None:
                raise APIError(
                    f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} "
                    "is not supported with this server's tool-call format",
                    param="tool_choice",
                )
            return StructuredOutputsParams(lark=grammar)
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json='{"type": "object"}')
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise APIError(
                "response_format json_schema needs json_schema.schema (an object)",
                param="response_format",
            )
        return StructuredOutputsParams(json=orjson.dumps(schema).decode())

    async def _full(
        self,
        req: ChatCompletionRequest,
        model: str,
        rid: str,
        stream: RequestStream,
        raw: Request,
        make_parser: Any,
    ) -> Response:
        final: RequestOutput | None = None
        async with watch_disconnect(raw, stream):
            try:
                async for out in self.ctx.observe(stream):
                    final = out
            finally:
                await stream.aclose()
        if final is None or not final.finished:
            raise APIError("the request was aborted", 499)
        choices = [self._choice(req, o, make_parser) for o in final.outputs]
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(final, self.ctx.speculates(req.speculative)),
            "system_fingerprint": None,
        }
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(final.prompt_logprobs)
        kv = self.ctx.kv_transfer_body(final, raw)
        if kv is not None:
            body["kv_transfer_params"] = kv
        return Response(orjson.dumps(body), media_type="application/json")

    def _choice(
        self, req: ChatCompletionRequest, o: CompletionOutput, make_parser: Any
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": o.text, "refusal": None}
        finish = o.finish_reason
        if make_parser is not None:
            extracted = make_parser().extract(o.text)
            if extracted.tool_calls:
                message["content"] = extracted.content
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in extracted.tool_calls
                ]
                if finish == "stop":
                    finish = "tool_calls"
        return {
            "index": o.index,
            "message": message,
            "logprobs": chat_logprobs(o, 0, len(o.token_ids), req.top_logprobs or 0),
            "finish_reason": finish,
        }

    async def _stream(
        self,
        req: ChatCompletionRequest,
        model: str,
        rid: str,
        stream: RequestStream,
        raw: Request,
        make_parser: Any,
        holdback: int,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }
        if include_usage:
            base["usage"] = None

        def chunk(index: int, delta: dict[str, Any], finish: str | None, logprobs: Any = None):
            c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return sse({**base, "choices": [c]})

        states = [_Choice(make_parser() if make_parser else None) for _ in range(req.n)]
        final: RequestOutput | None = None
        try:
            async with watch_disconnect(raw, stream):
                for i in range(req.n):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
                async for out in self.ctx.observe(stream):
                    final = out
                    for o in out.outputs:
                        for piece in self._advance(req, states[o.index], o, holdback):
                            yield chunk(o.index, *piece)
            if include_usage and final is not None and final.finished:
                yield sse(
                    {
                        **base,
                        "choices": [],
                        "usage": usage(final, self.ctx.speculates(req.speculative)),
                    }
                )
        except Exception as e:  # after the 200: end with an error event, never a hang
            yield stream_error(e)
        finally:
            await stream.aclose()
        yield DONE

    def _advance(
        self, req: ChatCompletionRequest, st: _Choice, o: CompletionOutput, holdback: int
    ) -> list[tuple[dict[str, Any], str | None, Any]]:
        """The deltas that bring one choice's client up to date."""
        if st.done:
            return []
        finished = o.finish_reason is not None
        end = len(o.text) if finished else max(st.sent_chars, len(o.text) - holdback)
        text = o.text[st.sent_chars : end]
        st.sent_chars = end
        logprobs = None
        if o.logprobs is not None and len(o.token_ids) > st.sent_tokens:
            logprobs = chat_logprobs(o, st.sent_tokens, len(o.token_ids), req.top_logprobs or 0)
        st.sent_tokens = len(o.token_ids)
        deltas: list[tuple[dict[str, Any], str | None, Any]] = []
        if st.parser is not None:
            parsed = [st.parser.feed(text)] if text else []
            if finished:
                parsed.append(st.parser.finish())
            for d in parsed:
                if d.content:
                    deltas.append(({"content": d.content}, None, None))
                if d.tool_calls:
                    calls = []
                    for tc in d.tool_calls:
                        call: dict[str, Any] = {"index": tc.index}
                        fn: dict[str, Any] = {"arguments": tc.arguments}
                        if tc.id is not None:
                            call["id"], call["type"] = tc.id, "function"
                        if tc.name is not None:
                            fn["name"] = tc.name
                            st.tool_calls += 1
                        call["function"] = fn
                        calls.append(call)
                    deltas.append(({"tool_calls": calls}, None, None))
        elif text:
            deltas.append(({"content": text}, None, None))
        if logprobs is not None:
            if deltas:
                first = deltas[0]
                deltas[0] = (first[0], first[1], logprobs)
            else:
                deltas.append(({}, None, logprobs))
        if finished:
            st.done = True
            reason = o.finish_reason
            if st.tool_calls and reason == "stop":
                reason = "tool_calls"
            deltas.append(({}, reason, None))
        return deltas
