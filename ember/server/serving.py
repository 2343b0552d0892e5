"""What chat and completions share: model and context checks, the engine call with latency
metrics, logprob and usage formatting, SSE framing."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from starlette.requests import Request

from ember.engine.async_llm import AsyncLLM, RequestStream
from ember.engine.core_client import EngineDeadError, RequestFailedError
from ember.kv_transfer_params import KVTransferParams
from ember.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from ember.sampling_params import SamplingParams
from ember.server.errors import APIError
from ember.server.kv_params import check_decode_leg, parse_kv_transfer, signed_body
from ember.server.metrics import ServerMetrics
from ember.server.middleware import caller_of
from ember.trust import cache_namespace, new_secret

DONE = b"data: [DONE]\n\n"
MIN_LOGPROB = -9999.0
INLINE_PREPARE_SIZE = 32_768
"""Prompt characters plus token ids up to which a request without a grammar is prepared on the
event loop (checked, templated, tokenized, its sampling parameters resolved: well under a
millisecond at this size) instead of in a worker thread. The hop costs more than such work: GIL
hand-offs with the loop, and a request's submission to the engine queued behind the parsing of
every request that arrived with it (256 token-id prompts sent at once reached the core in one
lump 0.2-0.4 s after the first while it idled; docs/performance.md). Larger prompts
(tokenizing megabytes takes seconds) and grammars (compiling one can too) still go to a thread."""


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def prepares_inline(size: int, grammar: bool) -> bool:
    """Whether a request of `size` prompt characters plus token ids is prepared on the event loop
    (INLINE_PREPARE_SIZE, read at each call)."""
    return not grammar and size <= INLINE_PREPARE_SIZE


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(out: RequestOutput, speculates: bool = False) -> dict[str, Any]:
    completion = sum(len(o.token_ids) for o in out.outputs)
    return usage_body(
        len(out.prompt_token_ids),
        completion,
        out.num_cached_tokens,
        out.spec_draft_tokens,
        out.spec_accepted_tokens,
        speculates,
    )


def usage_body(
    prompt: int,
    completion: int,
    cached: int,
    drafted: int = 0,
    accepted: int = 0,
    speculates: bool = False,
) -> dict[str, Any]:
    """OpenAI's usage object. With speculative decoding, `completion_tokens_details` says how
    many draft tokens stood and how many were rejected, in the fields OpenAI uses for its
    predicted outputs: a client sees per request what speculation saved (the output tokens that
    needed no forward pass of their own). `speculates`: the request could speculate (the details
    come even when nothing was drafted, so that a client's per-request average counts it)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if drafted or speculates:
        body["completion_tokens_details"] = {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        }
    return body


def stop_holdback(params: SamplingParams) -> int:
    """Characters a stream must hold back: they may yet turn out to begin a stop string."""
    return max((len(s) for s in params.stop or ()), default=1) - 1


class TrustedFields(Protocol):
    """The request fields whose meaning depends on who sent them."""

    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None


@dataclass(slots=True)
class ServingContext:
    engine: AsyncLLM
    metrics: ServerMetrics
    served_model_names: list[str]
    max_waiting: int
    reserved: int = field(default=0, init=False)
    """Sequences admitted but not yet submitted (their prompts are still being tokenized)."""
    secret: str = field(default_factory=new_secret, repr=False)
    """The cluster secret: signs the KV parameters this engine hands out, checks those it gets."""
    kv_peers: dict[str, str] = field(default_factory=dict)
    """`--kv-peers`: the origin of each prefill engine a decode engine may read KV from -> the URL
    that releases its leases (empty: any engine that signs with the cluster secret)."""

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def speculates(self, asked: bool) -> bool:
        """Whether a request that asked for speculation (the default) may get it here."""
        return asked and self.engine.config.speculative is not None

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.model_name
        raise APIError(
            f"The model `{model}` does not exist.",
            404,
            type="not_found_error",
            param="model",
            code="model_not_found",
        )

    def check_capacity(self, num_seqs: int = 1) -> None:
        """Admission counts sequences (prompts x n), not requests, against max_num_seqs +
        max_waiting: a request that could never fit is a 400, one that does not fit now a 429."""
        engine = self.engine
        if not engine.is_ready:
            raise APIError(
                engine.dead or "the engine is not ready", 503, headers={"Retry-After": "5"}
            )
        limit = (engine.ready.max_num_seqs if engine.ready else 0) + self.max_waiting
        if num_seqs > limit:
            raise APIError(
                f"this request needs {num_seqs} sequences (prompts x n); this server admits at "
                f"most {limit} at once",
                param="n",
                code="too_many_sequences",
            )
        # Every sample of every unfinished request (the output processor tracks each one).
        in_flight = engine.num_sequences + self.reserved
        if in_flight + num_seqs > limit:
            raise APIError(
                f"the server is over capacity ({in_flight} sequences in flight, limit {limit}); "
                "retry later",
                429,
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )

    @contextmanager
    def admit(self, num_seqs: int) -> Iterator[None]:
        """Check capacity and hold the sequences' places while their prompts are tokenized off
        the event loop, so requests arriving meanwhile cannot all pass the same check."""
        self.check_capacity(num_seqs)
        self.reserved += num_seqs
        try:
            yield
        finally:
            self.reserved -= num_seqs

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit max_model_len whatever it holds."""
        bound = self.engine.inputs.max_prompt_chars
        if num_chars > bound:
            raise APIError(
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"a prompt of {num_chars} characters cannot fit (the limit is {bound} characters)",
                param=param,
                code="context_length_exceeded",
            )

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        """The output budget, as vLLM's `get_max_tokens`: what was asked (or, unasked, the whole
        rest of the context), lowered to what the prompt leaves. Agent harnesses send a fixed
        max_tokens (OpenCode: 32000) on every turn, however long the conversation has grown, and
        whatever the model's context: a budget beyond the whole context is lowered too (vLLM
        refuses it, and OpenCode's every request failed against a context of 8,192). `param`
        names the prompt's field in the 400 for a prompt that leaves no room at all."""
        max_len = self.engine.max_model_len
        if prompt_len >= max_len:
            raise APIError(
                f"This model's maximum context length is {max_len} tokens. However, your prompt "
                f"has {prompt_len} tokens, which leaves no room for output.",
                param=param,
                code="context_length_exceeded",
            )
        room = max_len - prompt_len
        return room if requested is None else min(requested, room)

    def trusted_inputs(
        self, raw: Request, req: TrustedFields
    ) -> tuple[str | None, KVTransferParams | None]:
        """The request's prefix-cache salt (its tenant's namespace joined with its own `cache_salt`)
        and its KV transfer parameters, which count only from a peer with the cluster secret: a
        client's are dropped, as if it had sent none."""
        caller = caller_of(raw.scope)
        salt = cache_namespace(caller.namespace, req.cache_salt)
        if not caller.internal:
            return salt, None
        params = parse_kv_transfer(req.kv_transfer_params)
        return salt, check_decode_leg(params, self.secret, self.kv_peers)

    def kv_transfer_body(self, out: RequestOutput, raw: Request) -> dict[str, Any] | None:
        """A prefill leg's answer: where its KV waits, signed (see kv_params.signed_body)."""
        params = out.kv_transfer_params
        return None if params is None else signed_body(params, str(raw.base_url), self.secret)

    async def submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> RequestStream:
        """Submit to the engine; bad input raises APIError now. The caller owns the stream and
        must `aclose()` it (which aborts the request if it has not finished)."""
        remote_prefill = kv_transfer is not None and kv_transfer.do_remote_prefill
        for name in ("logprobs", "prompt_logprobs"):
            if remote_prefill and getattr(params, name) is not None:
                # The first token was sampled on the prefill engine, and the prompt scored there:
                # no logprobs kept (the router runs such requests on one engine).
                raise APIError(
                    f"{name} are not available for a request whose prompt was prefilled on "
                    "another engine (kv_transfer_params.do_remote_prefill)",
                    param=name,
                )
        try:
            return await self.engine.add_request(
                request_id, prompt, params, cache_salt, kv_transfer
            )
        except ValueError as e:
            raise APIError(str(e)) from e

    async def observe(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """The stream's outputs, observed for TTFT, ITL, end-to-end latency and token counts."""
        m = self.metrics
        arrival = stream.arrival
        seen, last = 0, arrival
        async for out in stream:
            now = time.monotonic()
            count = sum(len(o.token_ids) for o in out.outputs)
            if count > seen:
                if seen == 0:
                    m.ttft.observe(now - arrival)
                else:
                    gap = (now - last) / (count - seen)
                    for _ in range(count - seen):
                        m.itl.observe(gap)
                seen, last = count, now
            if out.finished:
                m.e2e.observe(now - arrival)
                m.prompt_tokens.inc(len(out.prompt_token_ids))
                m.generation_tokens.inc(count)
                for o in out.outputs:
                    m.request_finished(o.finish_reason or "abort")
            yield out


def chat_logprobs(o: CompletionOutput, start: int, end: int, top: int) -> dict[str, Any] | None:
    """OpenAI chat logprobs for output tokens [start, end)."""
    if o.logprobs is None:
        return None
    content = []
    for tok, step in zip(o.token_ids[start:end], o.logprobs[start:end], strict=True):
        chosen = step[tok]
        text = chosen.decoded_token or ""
        alts = sorted(((lp.rank or 0, t, lp) for t, lp in step.items()), key=lambda x: x[0])
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode()),
                    }
                    for rank, _, lp in alts
                    if rank >= 1
                ][:top],
            }
        )
    return {"content": content}


def completion_logprobs(
    o: CompletionOutput, start: int, end: int, top: int, text_offset: int
) -> dict[str, Any] | None:
    """Legacy completions logprobs for output tokens [start, end)."""
    if o.logprobs is None:
        return None
    return legacy_logprobs(o.token_ids[start:end], o.logprobs[start:end], top, text_offset)


def legacy_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[dict[int, Logprob] | None],
    top: int,
    text_offset: int,
    first_text: str = "",
) -> dict[str, Any]:
    """Legacy completions logprobs (tokens, token_logprobs, top_logprobs, text_offset) of tokens
    and their logprobs. A None step, the prompt's first token, has null logprobs and the text
    `first_text`."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    for tok, step in zip(token_ids, steps, strict=True):
        if step is None:
            text, lp, alts = first_text, None, None
        else:
            chosen = step[tok]
            text, lp = chosen.decoded_token or "", _finite(chosen.logprob)
            ranked = sorted(step.values(), key=lambda x: x.rank or 0)
            alts = {(x.decoded_token or ""): _finite(x.logprob) for x in ranked[: top + 1]}
        tokens.append(text)
        token_lps.append(lp)
        tops.append(alts if top else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def join_logprobs(head: dict[str, Any], tail: dict[str, Any] | None) -> dict[str, Any]:
    """Legacy logprobs of the prompt (echo) followed by the output's."""
    if tail is None:
        return head
    return {k: head[k] + tail[k] for k in head}


def prompt_logprobs_body(
    prompt_logprobs: PromptLogprobs | None,
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, None for the first, else its logprob and
    the alternatives' by token id ({"logprob", "rank", "decoded_token"})."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if step is None
        else {
            str(tok): {
                "logprob": _finite(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.decoded_token,
            }
            for tok, lp in step.items()
        }
        for step in prompt_logprobs
    ]


def _finite(logprob: float) -> float:
    """-inf (a token the model rules out) as OpenAI and vLLM write it: JSON has no infinity."""
    return max(logprob, MIN_LOGPROB)


def stream_error(e: BaseException) -> bytes:
    if isinstance(e, APIError):
        return sse(e.body())
    if isinstance(e, EngineDeadError):
        return sse(APIError(f"engine failure: {e}", 503).body())
    if isinstance(e, RequestFailedError):
        return sse(APIError(str(e), 500).body())
    return sse(APIError(f"internal error: {type(e).__name__}: {e}", 500).body())


@asynccontextmanager
async def watch_disconnect(raw: Request, *streams: RequestStream) -> AsyncIterator[None]:
    """While the body runs, a client hang-up aborts the requests (their blocks are freed at once)."""

    async def watch() -> None:
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                for stream in streams:
                    await stream.aclose()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the stream's index."""
    if len(streams) == 1:
        # One prompt, the common case: a task and a wait for every output cost the API process
        # ~27% of its CPU a streamed token (benchmarks/server_overhead.py, docs/performance.md).
        async for out in streams[0]:
            yield 0, out
        return
    pending: dict[asyncio.Task[RequestOutput], int] = {
        asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
