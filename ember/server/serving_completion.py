"""POST /v1/completions: text or token-id prompts (one or many), streamed or whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember.engine.async_llm import RequestStream
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.server.errors import APIError
from ember.server.protocol import CompletionRequest
from ember.server.serving import (
    DONE,
    ServingContext,
    completion_logprobs,
    join_logprobs,
    legacy_logprobs,
    merge_streams,
    new_id,
    prepares_inline,
    prompt_logprobs_body,
    sse,
    stop_holdback,
    stream_error,
    usage_body,
    watch_disconnect,
)


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        ctx = self.ctx
        model = ctx.check_model(req.model)
        req.check_vocab(ctx.engine.inputs.vocab_size)
        req.check_prompt_logprobs()
        if req.max_tokens == 0 and not req.echo:
            raise APIError(
                "max_tokens must be at least 1 (0 only with echo, to score the prompt)",
                param="max_tokens",
            )
        given = req.prompts()
        for p in given:  # what cannot fit is refused before any tokenizing
            if isinstance(p, str):
                ctx.check_prompt_chars(len(p), "prompt")
            elif len(p) >= ctx.engine.max_model_len:
                ctx.resolve_max_tokens(len(p), None, "prompt")
        rid = new_id("cmpl")
        cache_salt, kv_transfer = ctx.trusted_inputs(raw, req)
        if kv_transfer is not None and len(given) != 1:
            raise APIError("kv_transfer_params needs a single prompt", param="prompt")
        streams: list[RequestStream] = []
        with ctx.admit(len(given) * req.n):
            grammar = req.structured_outputs is not None
            if prepares_inline(sum(map(len, given)), grammar):
                prompts, all_params = self._prepare(req, given)
            else:  # tokenizing (or decoding for echo) a large batch takes seconds
                prompts, all_params = await asyncio.to_thread(self._prepare, req, given)
            try:
                for i, ((_, ids), params) in enumerate(zip(prompts, all_params, strict=True)):
                    streams.append(
                        await ctx.submit(f"{rid}-{i}", ids, params, cache_salt, kv_transfer)
                    )
            except BaseException:
                for s in streams:
                    await s.aclose()
                raise
        holdback = stop_holdback(all_params[0])
        if req.stream:
            body = self._stream(req, model, rid, prompts, streams, raw, holdback)
            return StreamingResponse(body, media_type="text/event-stream")
        return await self._full(req, model, rid, prompts, streams, raw)

    def _prepare(
        self, req: CompletionRequest, given: list[str | list[int]]
    ) -> tuple[list[tuple[str, list[int]]], list[SamplingParams]]:
        """Each prompt's (text for echo, token ids) and sampling parameters."""
        inputs = self.ctx.engine.inputs
        texts = [p for p in given if isinstance(p, str)]
        encoded = iter(inputs.encode(texts) if texts else [])
        prompts: list[tuple[str, list[int]]] = []
        for p in given:
            if isinstance(p, str):
                prompts.append((p, next(encoded)))
                continue
            # Checked before decoding for echo, which cannot take ids outside the vocabulary.
            try:
                inputs.check_token_ids(p)
            except ValueError as e:
                raise APIError(str(e), param="prompt") from e
            text = inputs.tokenizer.decode(p, skip_special_tokens=False) if req.echo else ""
            prompts.append((text, p))
        all_params: list[SamplingParams] = []
        for _, ids in prompts:
            if not ids:
                raise APIError("prompt is empty", param="prompt")
            # vLLM's default for completions is 16 tokens (chat's is the rest of the context).
            # Echo with max_tokens 0 generates one token, as vLLM does, and returns none.
            wanted = 1 if req.echo_only else (req.max_tokens or 16)
            max_tokens = self.ctx.resolve_max_tokens(len(ids), wanted, "prompt")
            try:
                params = req.sampling_params(
                    max_tokens, req.logprobs, prompt_logprobs=req.num_prompt_logprobs
                )
                # One grammar for every prompt: compiled (checked) once.
                if params.structured_outputs is not None and not all_params:
                    self.ctx.engine.grammar.validate(params.structured_outputs)
            except ValueError as e:
                raise APIError(str(e)) from e
            all_params.append(params)
        return prompts, all_params

    async def _collect(
        self, streams: list[RequestStream], raw: Request
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        observed = [self.ctx.observe(s) for s in streams]
        try:
            async with watch_disconnect(raw, *streams):
                async for item in merge_streams(observed):
                    yield item
        finally:
            for s in streams:
                await s.aclose()

    async def _full(
        self,
        req: CompletionRequest,
        model: str,
        rid: str,
        prompts: list[tuple[str, list[int]]],
        streams: list[RequestStream],
        raw: Request,
    ) -> Response:
        finals: dict[int, RequestOutput] = {}
        async for i, out in self._collect(streams, raw):
            finals[i] = out
        if len(finals) != len(streams) or not all(f.finished for f in finals.values()):
            raise APIError("the request was aborted", 499)
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, (text, ids) in enumerate(prompts):
            out = finals[i]
            prompt_tokens += len(ids)
            cached += out.num_cached_tokens
            for o in out.outputs:
                head = text if req.echo else ""
                lp = self._echo_logprobs(req, out, text) if req.echo else None
                body_text = head
                if not req.echo_only:
                    completion_tokens += len(o.token_ids)
                    body_text += o.text
                    tail = completion_logprobs(o, 0, len(o.token_ids), req.logprobs or 0, len(head))
                    lp = tail if lp is None else join_logprobs(lp, tail)
                choice = _choice(i * req.n + o.index, body_text, o.finish_reason)
                choice["logprobs"] = lp
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs)
                choices.append(choice)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage_body(
                prompt_tokens,
                completion_tokens,
                cached,
                sum(f.spec_draft_tokens for f in finals.values()),
                sum(f.spec_accepted_tokens for f in finals.values()),
                self.ctx.speculates(req.speculative),
            ),
            "system_fingerprint": None,
        }
        kv = self.ctx.kv_transfer_body(finals[0], raw)
        if kv is not None:
            body["kv_transfer_params"] = kv
        return Response(orjson.dumps(body), media_type="application/json")

    async def _stream(
        self,
        req: CompletionRequest,
        model: str,
        rid: str,
        prompts: list[tuple[str, list[int]]],
        streams: list[RequestStream],
        raw: Request,
        holdback: int,
    ) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base: dict[str, Any] = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        if include_usage:
            base["usage"] = None
        sent_chars: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in self._collect(streams, raw):
                finals[i] = out
                for o in out.outputs:
                    index = i * req.n + o.index
                    finished = o.finish_reason is not None
                    if index not in sent_chars:
                        sent_chars[index] = sent_tokens[index] = 0
                        if req.echo and not req.echo_only:
                            echo = _choice(index, prompts[i][0], None)
                            echo["logprobs"] = self._echo_logprobs(req, out, prompts[i][0])
                            yield sse({**base, "choices": [echo]})
                    if req.echo_only:  # the prompt alone, once its scores are in
                        if finished:
                            echo = _choice(index, prompts[i][0], o.finish_reason)
                            echo["logprobs"] = self._echo_logprobs(req, out, prompts[i][0])
                            yield sse({**base, "choices": [echo]})
                        continue
                    start = sent_chars[index]
                    end = len(o.text) if finished else max(start, len(o.text) - holdback)
                    text = o.text[start:end]
                    lp = None
                    if o.logprobs is not None and len(o.token_ids) > sent_tokens[index]:
                        echoed = len(prompts[i][0]) if req.echo else 0
                        lp = completion_logprobs(
                            o,
                            sent_tokens[index],
                            len(o.token_ids),
                            req.logprobs or 0,
                            echoed + start,
                        )
                    sent_chars[index], sent_tokens[index] = end, len(o.token_ids)
                    if text or lp or finished:
                        choice = _choice(index, text, o.finish_reason)
                        choice["logprobs"] = lp
                        yield sse({**base, "choices": [choice]})
            if include_usage and len(finals) == len(streams):
                prompt_tokens = sum(len(ids) for _, ids in prompts)
                completion = sum(len(o.token_ids) for f in finals.values() for o in f.outputs)
                completion = 0 if req.echo_only else completion
                cached = sum(f.num_cached_tokens for f in finals.values())
                drafted = sum(f.spec_draft_tokens for f in finals.values())
                accepted = sum(f.spec_accepted_tokens for f in finals.values())
                body = usage_body(
                    prompt_tokens,
                    completion,
                    cached,
                    drafted,
                    accepted,
                    self.ctx.speculates(req.speculative),
                )
                yield sse({**base, "choices": [], "usage": body})
        except Exception as e:  # after the 200: end with an error event, never a hang
            yield stream_error(e)
        yield DONE

    def _echo_logprobs(
        self, req: CompletionRequest, out: RequestOutput, text: str
    ) -> dict[str, Any] | None:
        """The echoed prompt's legacy logprobs (with `logprobs` asked): null for its first token."""
        if req.logprobs is None or out.prompt_logprobs is None:
            return None
        ids = out.prompt_token_ids
        first = self.ctx.engine.tokenizer.decode(ids[:1], skip_special_tokens=False)
        return legacy_logprobs(ids, out.prompt_logprobs, req.logprobs, 0, first)


def _choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
