"""From token ids to what the user sees: incremental text, stop strings, logprobs (of the output and
of the prompt), and the fan-in of a request's `n` samples into one RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.engine.stop_strings import find_stop_string
from ember.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, TokenIdsView
from ember.tokenizer.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from ember.engine.messages import EngineCoreOutput, TokenLogprobs
    from ember.kv_transfer_params import KVTransferParams
    from ember.sampling_params import SamplingParams
    from ember.tokenizer.tokenizer import Tokenizer


@dataclass(slots=True)
class SampleState:
    """One of a request's n samples (one engine-core request)."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: dict[str, SampleState]
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    kv_transfer_params: KVTransferParams | None = None
    prompt_logprobs: PromptLogprobs | None = None
    """From the first sample whose output brings them (every sample scores the same prompt)."""

    @property
    def finished(self) -> bool:
        # A loop, not all() over a generator: called for every running request each step.
        for s in self.samples.values():  # noqa: SIM110
            if s.finish_reason is None:
                return False
        return True

    def to_output(self, finished: bool | None = None) -> RequestOutput:
        """The request as the user sees it now (`finished`: self.finished, when the caller has
        it). Built for every running request each step on the server path, so n = 1 (nearly
        every request) takes no sort and no sums."""
        samples = list(self.samples.values())
        if len(samples) > 1:
            samples.sort(key=lambda s: s.index)
        # A finished sample's list no longer grows: it goes out as it is.
        outs = [
            CompletionOutput(
                s.index,
                s.text,
                s.token_ids
                if s.finish_reason is not None
                else TokenIdsView(s.token_ids, len(s.token_ids)),
                s.cumulative_logprob,
                s.logprobs,
                s.finish_reason,
                s.stop_reason,
            )
            for s in samples
        ]
        if len(samples) == 1:
            draft, accepted = samples[0].spec_draft_tokens, samples[0].spec_accepted_tokens
        else:
            draft = sum(s.spec_draft_tokens for s in samples)
            accepted = sum(s.spec_accepted_tokens for s in samples)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            outs,
            self.finished if finished is None else finished,
            self.num_cached_tokens,
            kv_transfer_params=self.kv_transfer_params,
            prompt_logprobs=self.prompt_logprobs,
            spec_draft_tokens=draft,
            spec_accepted_tokens=accepted,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.parent_of: dict[str, str] = {}

    def add_request(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for child_id in state.samples:
            self.parent_of[child_id] = state.request_id

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return list(state.samples) if state else []

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state:
            for child_id in state.samples:
                self.parent_of.pop(child_id, None)

    def process(
        self, outputs: list[EngineCoreOutput], final_only: bool = False
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated requests and the core request ids that a stop string has ended.

        `final_only` returns finished requests only: the offline `LLM` waits for whole answers, and
        building a partial output of every running request each step costs host time (the token
        lists are copied) for nothing."""
        touched: dict[str, RequestState] = {}
        to_stop: list[str] = []
        for out in outputs:
            parent_id = self.parent_of.get(out.request_id)
            if parent_id is None:
                continue  # aborted meanwhile
            state = self.requests[parent_id]
            sample = state.samples[out.request_id]
            if sample.finish_reason is not None:
                continue
            state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            sample.spec_draft_tokens = max(sample.spec_draft_tokens, out.spec_draft_tokens)
            sample.spec_accepted_tokens = max(sample.spec_accepted_tokens, out.spec_accepted_tokens)
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None, *map(self._logprob_dict, out.prompt_logprobs)]
            if self._apply(sample, out) and out.finish_reason is None:
                to_stop.append(out.request_id)
            touched[parent_id] = state
        results = []
        for parent_id, state in touched.items():
            if state.finished:
                results.append(state.to_output(True))
                self.abort_request(parent_id)
            elif not final_only:
                results.append(state.to_output(False))
        return results, to_stop

    def _apply(self, s: SampleState, out: EngineCoreOutput) -> bool:
        """Add new tokens to a sample; True if a stop string ended it."""
        for k, tok in enumerate(out.new_token_ids):
            s.token_ids.append(tok)
            if out.new_logprobs is not None and s.params.logprobs is not None:
                self._add_logprobs(s, out.new_logprobs[k])
            if self._add_text(s, s.detok.push(tok)):
                return True
        if out.finish_reason is not None:
            # A sequence may end inside a multi-byte character; emit what was held back.
            if self._add_text(s, s.detok.flush()):
                return False
            s.finish_reason, s.stop_reason = out.finish_reason, out.stop_reason
        return False

    @staticmethod
    def _add_text(s: SampleState, delta: str) -> bool:
        """Append decoded text; on a stop string, cut the text and mark the sample stopped."""
        if not delta:
            return False
        s.text += delta
        if not s.params.stop:
            return False
        hit = find_stop_string(
            s.text, len(delta), s.params.stop, s.params.include_stop_str_in_output
        )
        if hit is None:
            return False
        s.text = s.text[: hit[0]]
        s.finish_reason, s.stop_reason = "stop", hit[1]
        return True

    def _add_logprobs(self, s: SampleState, entries: TokenLogprobs) -> None:
        if s.logprobs is None:
            s.logprobs, s.cumulative_logprob = [], 0.0
        s.logprobs.append(self._logprob_dict(entries))
        s.cumulative_logprob = (s.cumulative_logprob or 0.0) + entries[0][1]

    def _logprob_dict(self, entries: TokenLogprobs) -> dict[int, Logprob]:
        """One position's logprobs by token id; the chosen token keeps its own rank when it is
        also among the top alternatives."""
        step: dict[int, Logprob] = {}
        for tok, lp, rank in entries:
            if tok not in step:
                step[tok] = Logprob(
                    lp, rank, self.tokenizer.decode([tok], skip_special_tokens=False)
                )
        return step
