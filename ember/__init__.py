"""ember: LLM serving for agents.

`from ember import LLM, SamplingParams` works as in vLLM; names load lazily so that importing a
low-level module (say `ember.kv.block_pool`) does not pull in the whole engine.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "ember.entrypoints.llm",
    "SamplingParams": "ember.sampling_params",
    "RequestOutput": "ember.outputs",
    "CompletionOutput": "ember.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
