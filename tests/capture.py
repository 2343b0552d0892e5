"""Record the logits an engine samples from: the hook the model-vs-transformers tests compare."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ember import LLM


@contextmanager
def captured_logits(llm: LLM) -> Iterator[list[torch.Tensor]]:
    """While open, every `compute_logits` call called from Python appends a copy of its output.

    CUDA graph replays do not call it from Python: in graph mode only eager steps are seen.
    """
    model = llm.engine.core.runner.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def wrapped(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        seen.append(logits.detach().clone())
        return logits

    model.compute_logits = wrapped
    try:
        yield seen
    finally:
        del model.compute_logits
