import pytest
import torch

from ember.models.config import ModelConfig, dtype_name, parse_dtype

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_defaults_fill_heads_and_head_dim() -> None:
    cfg = ModelConfig.from_dict(BASE)
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert not cfg.attention_bias and not cfg.qk_norm


def test_both_rope_spellings_read_the_same() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    old = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": scaling})
    new = ModelConfig.from_dict({**BASE, "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    assert old.rope_theta == new.rope_theta == 500000.0
    assert old.rope_scaling == new.rope_scaling == scaling
    plain = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    )
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_qwen_flags_and_moe_layers() -> None:
    q2 = ModelConfig.from_dict(
        {**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    )
    assert q2.attention_bias and not q2.qk_norm
    moe = ModelConfig.from_dict(
        {
            **BASE,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert moe.qk_norm
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, False, False]


@pytest.mark.parametrize(
    "bad,msg",
    [
        ({"architectures": []}, "names no architecture"),
        ({"hidden_size": None}, "hidden_size"),
        (
            {"rope_scaling": {"rope_type": "longrope", "factor": 4}},
            "unsupported rope scaling type 'longrope'",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4}},
            "rope scaling 'yarn' lacks original_max_position_embeddings",
        ),
    ],
)
def test_bad_configs_name_the_problem(bad: dict, msg: str) -> None:
    cfg = {**BASE, **bad}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=msg):
        ModelConfig.from_dict(cfg)


def test_dtypes() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("torch.float16") is torch.float16
    assert parse_dtype("auto", default=torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'int4'"):
        parse_dtype("int4")
    # The same names without torch (the API process's configs), and torch's dtypes as values.
    assert dtype_name("bf16") == "bfloat16" and dtype_name(torch.float16) == "float16"
    assert dtype_name(None) == "float32" and dtype_name("auto", default="bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="unsupported dtype 'int4'"):
        dtype_name("int4")


def test_a_deepseek_v3_config_reads_mla_and_routing(tmp_path) -> None:
    """The tiny DeepSeek-V3's config: MLA dims, grouped routing, the dense first layer; its paged
    KV is one latent vector a token (kv_lora_rank + qk_rope_head_dim), not K and V per head."""
    from ember.models.tiny import make_tiny

    cfg = ModelConfig.from_dir(make_tiny(tmp_path / "ds", "deepseek_v3"))
    assert cfg.uses_mla and cfg.q_lora_rank == 32 and cfg.kv_lora_rank == 32
    assert (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (16, 8, 16)
    assert (cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (8, 4, 2, 1)
    assert cfg.routed_scaling_factor == 2.5 and cfg.num_experts_per_tok == 2
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.kv_cache_dims == (1, 1, 40)
    plain = ModelConfig.from_dir(
        make_tiny(tmp_path / "q", "deepseek_v3", overrides={"q_lora_rank": None})
    )
    assert plain.q_lora_rank is None
    assert ModelConfig.from_dict(BASE).kv_cache_dims == (2, 4, 16)  # K and V of 4 heads
    with pytest.raises(ValueError, match="needs 'v_head_dim'"):
        ModelConfig.from_dict(
            {**BASE, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8}
        )
