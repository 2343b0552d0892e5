"""The engine as a library: tokenize and validate requests, step the core, return outputs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.output_processor import OutputProcessor, RequestState, SampleState
from ember.engine.request import Request, RequestStatus
from ember.engine.sampler import make_generator
from ember.models.config import ModelConfig
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.tokenizer.detokenizer import IncrementalDetokenizer
from ember.tokenizer.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if not Path(config.model).is_dir():
            raise FileNotFoundError(f"model directory {config.model!r} does not exist")
        # Cheap checks first: a bad config or tokenizer should fail before weights load.
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.core = EngineCore(config, self.model_config)
        self.max_model_len = self.core.resolved.max_model_len
        self.processor = OutputProcessor(self.tokenizer)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | dict[str, Any],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        if request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self._validate(ids, params)
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        samples: dict[str, SampleState] = {}
        reqs = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seed = None if params.seed is None else params.seed + i
            reqs.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=ids,
                    sampling_params=params,
                    eos_token_ids=self.tokenizer.eos_token_ids,
                    max_tokens=max_tokens,
                    cache_salt=cache_salt,
                    generator=None if seed is None else make_generator(seed, self.core.device),
                )
            )
            samples[child_id] = SampleState(
                i, params, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            )
        self.processor.add_request(RequestState(request_id, text, ids, samples))
        try:
            for r in reqs:
                self.core.add_request(r)
        except Exception:
            self.abort_request(request_id)
            raise

    def _tokenize(
        self, prompt: str | Sequence[int] | dict[str, Any]
    ) -> tuple[str | None, list[int]]:
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

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len}, "
                "which leaves no room for output"
            )
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")

    def abort_request(self, request_id: str) -> None:
        children = self.processor.child_ids(request_id)
        self.processor.abort_request(request_id)
        self.core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs, to_stop = self.processor.process(self.core.step())
        if to_stop:
            self.core.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        return outputs
