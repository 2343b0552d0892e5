"""`LLM`: offline batched generation in vLLM's shape (`generate`, `chat`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ember.engine.config import EngineConfig
from ember.engine.llm_engine import LLMEngine
from ember.models.resolve import resolve_model
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.tokenizer.tokenizer import Tokenizer

PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        """kwargs are EngineConfig's fields (dtype, device, max_model_len, block_size, ...)."""
        fields = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise TypeError(
                f"unknown LLM arguments: {unknown}; known: {sorted(fields - {'model'})}"
            )
        # A .gguf file is imported once into ember's cache (ember/models/resolve.py).
        self.engine = LLMEngine(EngineConfig(model=resolve_model(str(model)), **kwargs))
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine's threads and connections; the KV tiers' disk writes end first, so
        a new LLM on the same `kv_disk_dir` finds them."""
        self.engine.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        batch = _as_batch(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(
                    f"got {len(params)} sampling params for {len(batch)} prompts; "
                    "pass one, or one per prompt"
                )
        ids = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(
                conv,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any BOS; don't add special tokens twice. A conversation
            # resent with a new turn tokenizes only its end (ember/tokenizer/prefix_cache.py).
            ids = self.engine.inputs.encode_chat(text, None)
            prompts.append({"prompt_token_ids": ids, "prompt": text})
        return self.generate(prompts, sampling_params)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - done.keys():
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("engine went idle with requests unanswered")
            for out in self.engine.step(final_only=True):
                if out.request_id in wanted:
                    done[out.request_id] = out
        return [done[rid] for rid in ids]


def _as_batch(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
