"""From a user's prompt and sampling parameters to validated engine-core requests (one per sample)
and the front-end state that turns their tokens back into text."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ember.engine.messages import EngineCoreRequest
from ember.engine.output_processor import RequestState, SampleState
from ember.kv_transfer_params import KVTransferParams
from ember.sampling_params import SamplingParams
from ember.tokenizer.detokenizer import IncrementalDetokenizer
from ember.tokenizer.prefix_cache import PrefixTokenCache
from ember.tokenizer.tokenizer import Tokenizer

PromptType = str | Sequence[int] | dict[str, Any]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # No token covers more characters than the vocabulary's longest (byte-level BPE writes
        # one character per byte, so that is its length in bytes); twice that, at least 64, leaves
        # room for normalizers that shrink text. A longer text cannot fit max_model_len tokens.
        longest = max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=0)
        self.max_prompt_chars = max_model_len * max(64, 2 * longest)
        self.prompt_prefixes = PrefixTokenCache(tokenizer.backend)
        """Recent chat prompts' ids, so that a conversation's next turn tokenizes only its end."""

    def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text. `encode_batch` releases the GIL while it works (`encode` holds
        it: a 10 MB prompt froze the event loop for 22 s even from a worker thread)."""
        encoded = self.tokenizer.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encoded]

    def encode_chat(self, text: str, namespace: str | None) -> list[int]:
        """The ids of a rendered chat prompt (no special tokens added: the template has them),
        reusing the ids of the longest prefix it shares with a recent prompt of `namespace` (the
        request's prefix-cache salt: tenants never share entries). Equal to `encode([text],
        add_special_tokens=False)[0]` (ember/tokenizer/prefix_cache.py says why)."""
        return self.prompt_prefixes.encode(text, namespace)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Text and ids of a prompt given as text, token ids, or {'prompt'/'prompt_token_ids'}."""
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if prompt.get("prompt_token_ids") is not None:
                return text, [int(t) for t in prompt["prompt_token_ids"]]
            if not isinstance(text, str):
                raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
            return text, self.tokenizer.encode(text)
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of integer token ids")
        return None, list(prompt)

    def check_token_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        self.check_token_ids(ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len}, "
                "which leaves no room for output"
            )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> tuple[RequestState, list[EngineCoreRequest]]:
        text, ids = self.tokenize(prompt)
        self.validate(ids, params)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if kv_transfer is not None:
            if params.n != 1:
                raise ValueError("kv_transfer_params needs n=1")
            if kv_transfer.do_remote_decode:
                max_tokens = 1  # the prefill leg samples the first token; min_tokens still holds
            if (
                kv_transfer.do_remote_prefill
                and not 0 <= kv_transfer.first_token_id < self.vocab_size
            ):
                raise ValueError("kv_transfer_params.first_token_id is not a token id")
        now = time.monotonic()
        eos = sorted(self.tokenizer.eos_token_ids)
        samples: dict[str, SampleState] = {}
        core_reqs: list[EngineCoreRequest] = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            core_reqs.append(
                EngineCoreRequest(
                    request_id=child_id,
                    prompt_token_ids=ids,
                    sampling_params=params,
                    eos_token_ids=eos,
                    max_tokens=max_tokens,
                    seed=None if params.seed is None else params.seed + i,
                    cache_salt=cache_salt,
                    arrival_time=now,
                    kv_transfer=kv_transfer,
                )
            )
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            samples[child_id] = SampleState(i, params, detok)
        return RequestState(request_id, text, ids, samples, arrival_time=now), core_reqs
