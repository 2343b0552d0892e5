"""DeepSeek-V3 (MLA over a paged latent cache, grouped-routing MoE) against transformers'
`DeepseekV3ForCausalLM` on tiny random checkpoints, in fp32: logits of the prefill and of every
decode step within 1e-4, whole and chunked, with prefix-cache hits; greedy output token-identical
to `generate`, batched. Variants: q through a LoRA or a plain q_proj, YaRN rope scaling (with the
softmax scale correction), more dense first layers and two shared experts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember import LLM, SamplingParams
from ember.models.tiny import make_tiny
from tests.capture import captured_logits
from tests.models.hf_reference import hf_greedy, hf_logits
from tests.models.test_vs_transformers import NEW_TOKENS, check_steps, random_prompt

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "original_max_position_embeddings": 64,
}
VARIANTS = {
    "q-lora": {},
    "plain-q": {"q_lora_rank": None},
    "yarn": {"rope_scaling": YARN, "max_position_embeddings": 256},
    # Two shared experts (Moonlight has two): the shared MLP splits into two stacked experts.
    "two-dense": {"first_k_dense_replace": 2, "num_hidden_layers": 4, "n_shared_experts": 2},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {
        name: make_tiny(tmp_path_factory.mktemp(name), "deepseek_v3", seed=5, overrides=ov)
        for name, ov in VARIANTS.items()
    }


def hf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_logits_match_transformers_every_step(model_dirs, variant: str, chunk: int | None) -> None:
    path = model_dirs[variant]
    hf = hf_model(path)
    vocab = hf.config.vocab_size
    llm = LLM(
        str(path), dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=chunk
    )
    kv = llm.engine.core.runner.kv_cache
    assert kv.shape[2:] == (1, 4, 1, 32 + 8)  # one latent plane: kv_lora_rank + qk_rope_head_dim
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with captured_logits(llm) as steps:
        # 150 tokens whole run the shared experts through cuBLAS (past FUSED_SHARED_MAX_TOKENS);
        # chunks and decode steps run them inside the fused MoE.
        prompt = random_prompt(1, 45 if variant not in ("yarn", "two-dense") else 150, vocab)
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)
        check_steps(steps, hf_logits(hf, prompt + tokens), len(prompt))
        # A second request sharing a long prefix reads its latents from the prefix cache.
        steps.clear()
        prompt2 = prompt[:33] + random_prompt(2, 9, vocab)
        out2 = llm.generate(prompt2, params)[0]
        assert out2.num_cached_tokens == 32
        tokens2 = out2.outputs[0].token_ids
        assert tokens2 == hf_greedy(hf, prompt2, NEW_TOKENS)
        check_steps(steps, hf_logits(hf, prompt2 + tokens2), len(prompt2))


def test_batched_greedy_is_token_identical_to_generate(model_dirs) -> None:
    path = model_dirs["q-lora"]
    hf = hf_model(path)
    prompts = [random_prompt(10 + i, n, hf.config.vocab_size) for i, n in enumerate([3, 17, 40, 9])]
    llm = LLM(str(path), dtype="float32", block_size=8, max_model_len=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    core = llm.engine.core
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks


def test_the_latent_cache_is_28x_smaller_for_kimi_k2() -> None:
    """Kimi K2's shape: 576 values a token and layer against K and V of 64 heads x 128 (its
    attention heads, were they MHA heads): 2 * 64 * 128 / 576 = 28.4x the KV tokens in the
    same memory."""
    from ember.models.config import ModelConfig

    kimi = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 384,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
    }
    cfg = ModelConfig.from_dict(kimi)
    planes, heads, dim = cfg.kv_cache_dims
    assert planes * heads * dim == 576
    assert pytest.approx(28.4, abs=0.05) == 2 * 64 * 128 / 576
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]


def test_bf16_model_keeps_the_router_in_float32(model_dirs) -> None:
    """As transformers keeps them: the gate's weight and the correction bias stay float32 in a
    bf16 model, equal to the checkpoint's values, while the other weights are bf16."""
    from safetensors.torch import load_file

    from ember.models.loader import load_model

    path = model_dirs["q-lora"]
    model = load_model(path, dtype=torch.bfloat16)
    disk = load_file(path / "model.safetensors")
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
    assert gates
    for gate in gates:
        assert gate.weight.dtype == torch.float32
        assert gate.e_score_correction_bias.dtype == torch.float32
    name = next(n for n in disk if n.endswith("mlp.gate.e_score_correction_bias"))
    param = dict(model.named_parameters())[name]
    assert torch.equal(param, disk[name])
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
