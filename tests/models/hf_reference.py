"""transformers as the reference ember's models are checked against: greedy output and logits."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedModel


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """The `n` tokens transformers' `generate` picks greedily after `prompt`, EOS ignored."""
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens`, in float32: (len(tokens), vocab)."""
    return model(torch.tensor([tokens])).logits[0].float()
