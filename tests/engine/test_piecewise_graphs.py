"""Piecewise CUDA graphs for steps with prompt tokens (ember/engine/piecewise_graphs.py): their
sizes and who takes them (here), and on a GPU the same tokens as the steps launched from Python,
with decodes and prompt chunks mixed in one step, prefix-cache hits and padding rows."""

from __future__ import annotations

import gc

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.config import EngineConfig
from ember.engine.piecewise_graphs import piecewise_sizes, supports_piecewise
from ember.models.deepseek_v3 import DeepseekV3ForCausalLM
from ember.models.llama import LlamaForCausalLM
from ember.models.qwen3_moe import Qwen3MoeForCausalLM


def test_sizes_cover_every_count_up_to_the_maximum() -> None:
    assert piecewise_sizes(0) == []
    assert piecewise_sizes(40) == [16, 32, 40]
    assert piecewise_sizes(64) == [16, 32, 64]
    assert piecewise_sizes(512) == [16, 32, 64, 128, 256, 384, 512]
    assert piecewise_sizes(300) == [16, 32, 64, 128, 256, 300]
    sizes = piecewise_sizes(1024)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 1024
    # Every step of 1..1024 tokens finds a size: under 16 tokens of padding up to 16, under 32
    # up to 64, under 128 past it.
    for n in range(1, 1025):
        size = next(s for s in sizes if s >= n)
        assert size - n < (16 if n <= 16 else 32 if n <= 64 else 128)


def test_only_models_that_opt_in_and_carry_no_draft_head_take_pieces() -> None:
    class Inner(torch.nn.Module):
        aux_layers: tuple[int, ...] = ()

    class Dense(torch.nn.Module):
        piecewise_graphs = LlamaForCausalLM.piecewise_graphs

        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()

    assert LlamaForCausalLM.piecewise_graphs and Qwen3MoeForCausalLM.piecewise_graphs
    assert DeepseekV3ForCausalLM.piecewise_graphs  # MLA splits at AttentionBackend.mla
    model = Dense()
    assert supports_piecewise(model)
    model.model.aux_layers = (2, 5)  # EAGLE-3 reads the hidden states of a step
    assert not supports_piecewise(model)
    assert not supports_piecewise(torch.nn.Linear(2, 2))


def test_a_negative_maximum_is_refused() -> None:
    with pytest.raises(ValueError, match="max_piecewise_tokens"):
        EngineConfig(model="m", max_piecewise_tokens=-1)


def test_the_cpu_engine_captures_no_pieces(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, num_kv_blocks=64)
    llm.generate([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2))
    runner = llm.engine.core.runner
    assert runner.piecewise.captured == {} and runner.piecewise.replays == 0


def test_a_dry_forward_splits_once_a_layer_and_fills_the_buffers(tiny_model_dir) -> None:
    """The split as start-up's dry run takes it (no capture, so it runs on the CPU too): one
    attention call a layer, each on its layer's KV cache, q/k/v handed to the fixed buffers and
    the fixed output returned to the model."""
    from ember.engine.piecewise_graphs import PiecewiseGraphs

    llm = LLM(str(tiny_model_dir("llama")), max_model_len=128, num_kv_blocks=64)
    runner = llm.engine.core.runner
    cfg = runner.config
    pieces = PiecewiseGraphs(runner.model, runner.backend, torch.device("cpu"))
    pieces.prepare(64)
    assert pieces.sizes == [16, 32, 64]
    pieces._ids[:32] = torch.arange(10, 42)
    pieces._pos[:32] = torch.arange(32)
    with torch.inference_mode():
        got = pieces._forward(32, runner.kv_cache, capture=False)
    assert got.pieces == []  # nothing captured in a dry run
    assert len(got.calls) == cfg.num_hidden_layers
    for i, call in enumerate(got.calls):
        assert call.kv_cache.data_ptr() == runner.kv_cache[:, i].data_ptr()
        assert call.scale == cfg.head_dim**-0.5
    assert got.hidden.shape == (32, cfg.hidden_size)
    buf = pieces._buffers
    assert buf is not None and buf.q.shape == (64, cfg.num_attention_heads, cfg.head_dim)
    assert buf.k.shape == buf.v.shape == (64, cfg.num_key_value_heads, cfg.head_dim)
    assert buf.q[:32].abs().sum() > 0 and buf.q[32:].abs().sum() == 0  # the size's rows only
    assert pieces.size_for(10) is None  # nothing captured: steps launch from Python


def test_an_mla_forward_splits_at_each_layers_latent_attention(tiny_model_dir) -> None:
    """DeepSeek-V3's layers split at their MLA call: each call keeps its layer's cache and
    kv_b_proj's halves, and q_nope, q_rope and the latent rows go to the fixed buffers."""
    from ember.engine.piecewise_graphs import PiecewiseGraphs, _MlaCall

    llm = LLM(str(tiny_model_dir("deepseek_v3")), max_model_len=128, num_kv_blocks=64)
    runner = llm.engine.core.runner
    cfg = runner.config
    pieces = PiecewiseGraphs(runner.model, runner.backend, torch.device("cpu"))
    pieces.prepare(32)
    pieces._ids[:20] = torch.arange(10, 30)
    pieces._pos[:20] = torch.arange(20)
    with torch.inference_mode():
        got = pieces._forward(20, runner.kv_cache, capture=False)
    assert len(got.calls) == cfg.num_hidden_layers
    for i, call in enumerate(got.calls):
        assert isinstance(call, _MlaCall)
        assert call.cache.data_ptr() == runner.kv_cache[:, i].data_ptr()
        attn = runner.model.model.layers[i].self_attn
        assert call.w_uk.data_ptr() == attn.kv_b_proj.weight.data_ptr()
    buf = pieces._buffers
    assert buf is not None
    h = cfg.num_attention_heads
    assert buf.q.shape == (32, h, cfg.qk_nope_head_dim)
    assert buf.k.shape == (32, h, cfg.qk_rope_head_dim)
    assert buf.v.shape == (32, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert buf.out.shape == (32, h, cfg.v_head_dim)
    assert buf.v[:20].abs().sum() > 0 and buf.v[20:].abs().sum() == 0
    llm.close()


def test_data_parallel_attention_takes_no_pieces(tiny_model_dir) -> None:
    from ember.distributed.state import ParallelState, use
    from ember.engine.piecewise_graphs import PiecewiseGraphs

    llm = LLM(str(tiny_model_dir("deepseek_v3")), max_model_len=128, num_kv_blocks=64)
    runner = llm.engine.core.runner
    with use(ParallelState(dp_attention=True)):
        pieces = PiecewiseGraphs(runner.model, runner.backend, torch.device("cpu"))
    pieces.prepare(64)
    assert pieces.sizes == []
    llm.close()


def _run(path: str, dtype: str, pieces: int) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens, the logits of every step launched from Python, and the steps replayed
    on pieces."""
    from tests.capture import captured_logits

    gc.collect()  # engines of earlier tests
    torch.cuda.empty_cache()
    llm = LLM(
        path,
        device="cuda",
        dtype=dtype,
        max_model_len=1024,
        max_num_seqs=16,
        num_kv_blocks=512,
        max_num_batched_tokens=96,  # prompts chunk; decodes ride in the same steps
        max_piecewise_tokens=pieces,
        kv_host_gb=0,  # no host tier: its background copies could reorder the two runs' steps
    )
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(10, 3000, (150,), generator=g).tolist()
    prompts = [torch.randint(10, 3000, (n,), generator=g).tolist() for n in (5, 37, 70, 130, 9)]
    prompts += [shared + [11, 12], shared + [13]]  # the second hits the first's cached prefix
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with captured_logits(llm) as seen:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    replays = llm.engine.core.runner.piecewise.replays
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out, seen, replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pieces_give_the_logits_of_python_launches(tiny_model_dir, arch: str, dtype: str) -> None:
    """The same steps (decodes beside prompt chunks, a prefix-cache hit) with and without the
    pieces: the logits of every step that samples from Python agree (padded GEMMs may round
    apart in bf16), and in fp32 every greedy token is the same."""
    path = str(tiny_model_dir(arch))
    eager, eager_logits, none = _run(path, dtype, pieces=0)
    pieces, piece_logits, replays = _run(path, dtype, pieces=96)
    assert none == 0
    assert replays > 0, "no step replayed the pieces"
    assert len(piece_logits) == len(eager_logits) > 0
    tol = 1e-4 if dtype == "float32" else 2e-2
    for k, (a, b) in enumerate(zip(piece_logits, eager_logits, strict=True)):
        assert a.shape == b.shape, f"step {k}"
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < tol, f"step {k}: {err}"
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            assert dtype != "float32", f"step {k}: greedy tokens differ in fp32"
            break  # a near tie rounded apart in bf16: the next steps' inputs differ
    if dtype == "float32":
        assert pieces == eager
