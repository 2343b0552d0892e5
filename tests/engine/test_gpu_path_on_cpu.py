"""The GPU path's wiring on the CPU: each tiny architecture runs through an engine whose model
layers take the Triton kernels (norms, rotary, KV write, paged decode and prefill attention,
SiLU-and-mul, the MoE router, routing, fused MoE and top-k sum, MLA decode and the expanded MLA
prefill) in Triton's interpreter, with the Triton attention backend, and its greedy tokens and
their logprobs equal those of the plain-PyTorch path on the same weights (fp32). Prompts are
chunked, mixed with decode rows, and long enough for the expanded MLA prefill and the shared
experts' cuBLAS path. On a GPU machine the GPU tests cover this for real."""

from __future__ import annotations

import os

import pytest
import torch

from ember.attention.triton_backend import TritonAttentionBackend
from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter run is for machines without a GPU",
)

PROMPTS = [[5, 9, 14, 3, 7] * 30, [11, 12, 13], [4, 8, 15, 16, 23, 42] * 7]


def _greedy(path: str, triton: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    monkeypatch.setenv("EMBER_TRITON_ON_CPU", "1" if triton else "0")
    config = EngineConfig(
        model=path,
        device="cpu",
        dtype="float32",
        num_kv_blocks=160,
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=160,
    )
    core = EngineCore(config, backend=TritonAttentionBackend() if triton else None)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, [], 6))
    out: dict[str, list] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            assert o.finish_reason != "error", o.stop_reason
            for token, logprobs in zip(o.new_token_ids, o.new_logprobs or [], strict=True):
                out.setdefault(o.request_id, []).append((token, logprobs[0][1]))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2"])
def test_the_triton_path_answers_as_the_torch_path(
    arch: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tiny_model_dir(arch))
    want = _greedy(path, False, monkeypatch)
    got = _greedy(path, True, monkeypatch)
    assert set(got) == {"r0", "r1", "r2"} and all(len(v) == 6 for v in got.values())
    for rid in want:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]], rid
        for (_, lp_got), (_, lp_want) in zip(got[rid], want[rid], strict=True):
            assert lp_got == pytest.approx(lp_want, abs=1e-4)
