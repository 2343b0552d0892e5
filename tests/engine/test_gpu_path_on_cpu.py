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


def _greedy(
    path: str, triton: bool, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str = "auto"
) -> dict[str, list]:
    monkeypatch.setenv("EMBER_TRITON_ON_CPU", "1" if triton else "0")
    config = EngineConfig(
        model=path,
        kv_cache_dtype=kv_cache_dtype,
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


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k2"])
def test_over_an_fp8_cache_the_triton_path_answers_as_the_torch_path(
    arch: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLA over an FP8 latent cache: the Triton writes (saturating), the MLA decode kernel and the
    expanded prefill read the same FP8 values as the PyTorch path. (A dense model's fresh prompt
    attends its own unrounded K and V through the Triton kernel and the cache's through PyTorch's,
    so its paths differ by FP8's rounding: tests/kernels/test_fp8_kv_attention.py checks its
    kernels on FP8 caches, tests/engine/test_kv_cache_dtype.py its engine on a GPU.)"""
    path = str(tiny_model_dir(arch))
    want = _greedy(path, False, monkeypatch, "fp8")
    got = _greedy(path, True, monkeypatch, "fp8")
    for rid in want:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]], rid
        for (_, lp_got), (_, lp_want) in zip(got[rid], want[rid], strict=True):
            assert lp_got == pytest.approx(lp_want, abs=1e-4)


def test_the_triton_backend_writes_where_told_and_slices_a_step_once(monkeypatch) -> None:
    """`out=` is written and returned; the metadata's slices are taken at a step's first layer
    and reused by its other layers, and a new step's metadata gets its own."""
    from ember.attention.metadata import AttentionMetadata
    from ember.attention.torch_backend import TorchAttentionBackend

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    layers = [torch.randn(16, 2, bs, kv_heads, dim, generator=g) for _ in range(2)]
    # Two decode rows over 5 and 3 cached tokens, then a fresh prompt of 4 and a chunk of 3
    # over 6 cached tokens: 9 query rows.
    qsl, lens = [0, 1, 2, 6, 9], [6, 4, 4, 9]
    tables = torch.tensor([[0, 1, 0], [2, 3, 0], [4, 5, 0], [6, 7, 8]], dtype=torch.int32)
    slots = [1 * bs + 1, 2 * bs + 3, 16, 17, 18, 19, 7 * bs + 2, 7 * bs + 3, 8 * bs]  # new rows

    def metadata() -> AttentionMetadata:
        return AttentionMetadata(
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            tables,
            torch.tensor(slots, dtype=torch.int64),
            4,
            9,
            qsl,
            lens,
            num_decodes=2,
        )

    q = torch.randn(9, heads, dim, generator=g)
    k = torch.randn(9, kv_heads, dim, generator=g)
    v = torch.randn(9, kv_heads, dim, generator=g)
    triton_be, ref = TritonAttentionBackend(), TorchAttentionBackend()
    md = metadata()
    for cache in layers:
        want = ref.forward(q, k, v, cache.clone(), md, 0.25)
        out = torch.full_like(q, float("nan"))
        got = triton_be.forward(q, k, v, cache.clone(), md, 0.25, out=out)
        assert got is out
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plan = triton_be._plan
    assert plan is not None and plan.metadata is md  # one plan for the step's layers
    assert [r.fresh for r in plan.runs] == [True, False]
    md2 = metadata()
    triton_be.forward(q, k, v, layers[0].clone(), md2, 0.25)
    assert triton_be._plan is not plan and triton_be._plan.metadata is md2
