"""The tiny checkpoints load cleanly in transformers and look like real hub checkpoints on disk."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ember.models import tiny
from ember.models.tiny import make_tiny

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}
PROMPT = "def tiny_model(x):\n    return x * 2  # 😀 你好"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def load_clean(path: Path) -> torch.nn.Module:
    """Load with transformers and fail on any missing/unexpected key or logged warning."""
    handler = _Records()
    logger = transformers.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        AutoTokenizer.from_pretrained(path)
    finally:
        logger.removeHandler(handler)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"] and not info["error_msgs"], info
    assert [r.getMessage() for r in handler.records] == []
    return model.eval()


def tensor_names(path: Path) -> dict[str, tuple[int, ...]]:
    names = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            keys = list(f.keys())  # safe_open handles are not iterable
            names.update({k: tuple(f.get_slice(k).get_shape()) for k in keys})
    return names


@torch.no_grad()
def logits(model: torch.nn.Module, path: Path) -> torch.Tensor:
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]
    return model(ids).logits[0]


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers_with_spread_logits(tiny_model_dir, arch: str) -> None:
    path = tiny_model_dir(arch)
    out = logits(load_clean(path), path)
    assert torch.isfinite(out).all()
    assert out.std(dim=-1).min() >= 1.0
    # Greedy decoding must not hinge on near-ties.
    top2 = out.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_config_fields(tiny_model_dir, arch: str) -> None:
    path = tiny_model_dir(arch)
    raw = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    arch_class = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }
    assert raw["architectures"] == [arch_class[arch]]
    assert raw["model_type"] == arch
    assert raw["vocab_size"] == len(tokenizer)
    assert raw["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert raw["tie_word_embeddings"] is (arch == "qwen3")
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["head_dim"]) == (64, 2, 16)
    assert (raw["num_attention_heads"], raw["num_key_value_heads"]) == (4, 2)
    config = AutoConfig.from_pretrained(path)
    assert config.rope_parameters["rope_theta"] == 10000.0
    if arch == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
            8,
            2,
            32,
        )
        assert config.norm_topk_prob is True
    generation = json.loads((path / "generation_config.json").read_text())
    assert set(generation["eos_token_id"]) == {
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def test_on_disk_names_are_the_hub_names(tiny_model_dir) -> None:
    moe = tensor_names(tiny_model_dir("qwen3_moe"))
    assert moe["model.layers.1.mlp.gate.weight"] == (8, 64)
    assert moe["model.layers.1.mlp.experts.7.gate_proj.weight"] == (32, 64)
    assert moe["model.layers.1.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert "model.layers.0.self_attn.q_norm.weight" in moe
    assert not any("gate_up_proj" in name for name in moe)

    qwen2 = tensor_names(tiny_model_dir("qwen2"))
    assert qwen2["model.layers.0.self_attn.k_proj.bias"] == (32,)
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2

    qwen3 = tensor_names(tiny_model_dir("qwen3"))
    assert "lm_head.weight" not in qwen3  # tied to the embedding, as on the hub
    assert qwen3["model.layers.0.self_attn.k_norm.weight"] == (16,)
    assert "lm_head.weight" in tensor_names(tiny_model_dir("llama"))


def test_transformers_fuses_moe_experts_in_memory(tiny_model_dir) -> None:
    path = tiny_model_dir("qwen3_moe")
    state = AutoModelForCausalLM.from_pretrained(path).state_dict()
    experts = "model.layers.0.mlp.experts"
    with safe_open(path / "model.safetensors", "pt") as f:
        gate = f.get_tensor(f"{experts}.3.gate_proj.weight")
        up = f.get_tensor(f"{experts}.3.up_proj.weight")
        down = f.get_tensor(f"{experts}.3.down_proj.weight")
    # gate_up_proj is [experts, 2 * moe_intermediate, hidden]: gate rows first, then up.
    assert torch.equal(state[f"{experts}.gate_up_proj"][3], torch.cat([gate, up]))
    assert torch.equal(state[f"{experts}.down_proj"][3], down)


def test_llama3_rope_scaling(tmp_path: Path) -> None:
    path = make_tiny(tmp_path, "llama", rope_scaling=LLAMA3_ROPE)
    raw = json.loads((path / "config.json").read_text())
    assert raw["rope_scaling"] == LLAMA3_ROPE and raw["rope_theta"] == 10000.0
    model = load_clean(path)
    assert model.config.rope_parameters == {**LLAMA3_ROPE, "rope_theta": 10000.0}
    assert torch.isfinite(logits(model, path)).all()


def test_sharded_index(tmp_path: Path, tiny_model_dir) -> None:
    path = make_tiny(tmp_path, "qwen3_moe", num_shards=2)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map.values()) == set(files)
    for file in files:
        with safe_open(path / file, "pt") as f:
            assert {k for k, v in weight_map.items() if v == file} == set(f.keys())
    total = 0
    for file in files:
        with safe_open(path / file, "pt") as f:
            keys = list(f.keys())
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
    assert index["metadata"]["total_size"] == total
    single = tiny_model_dir("qwen3_moe")
    assert set(weight_map) == set(tensor_names(single))
    assert torch.equal(logits(load_clean(path), path), logits(load_clean(single), single))


def test_many_shards_are_never_empty_and_remake_replaces_weights(tmp_path: Path) -> None:
    path = make_tiny(tmp_path, "llama", num_shards=5)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 5
    make_tiny(tmp_path, "llama")
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]


def test_deterministic_per_seed(tmp_path: Path, tiny_model_dir) -> None:
    again = make_tiny(tmp_path / "again", "qwen3")
    other = make_tiny(tmp_path / "other", "qwen3", seed=1)
    first = tiny_model_dir("qwen3")
    for name in ["tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"]:
        assert (again / name).read_bytes() == (first / name).read_bytes()
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()


def test_tokenizer_training_is_deterministic() -> None:
    # Bypass the cache: a second, fresh training run must give the same tokenizer.json.
    assert tiny._trained_tokenizer_json.__wrapped__() == tiny._trained_tokenizer_json()


@pytest.mark.parametrize("arch", ARCHS)
def test_small_on_disk(tiny_model_dir, arch: str) -> None:
    size = sum(p.stat().st_size for p in tiny_model_dir(arch).iterdir())
    assert size < 20 * 1024 * 1024


def test_tokenizer_vocabulary(tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3"))
    assert 2000 <= len(tokenizer) <= 4000
    for token in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</think>"]:
        assert tokenizer.convert_ids_to_tokens(tokenizer.convert_tokens_to_ids(token)) == token
    # Trained on Python source, so common keywords are single tokens.
    assert len(tokenizer(" return")["input_ids"]) == 1


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny arch 'gpt2'"):
        make_tiny(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="num_shards"):
        make_tiny(tmp_path, "llama", num_shards=0)
    with pytest.raises(ValueError, match="num_shards"):
        make_tiny(tmp_path, "llama", num_shards=10_000)


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None}], ids=["q-lora", "plain-q"])
def test_tiny_deepseek_v3_loads_in_transformers(tmp_path: Path, overrides: dict) -> None:
    """The tiny DeepSeek-V3 (MLA, grouped routing, a dense first layer, a shared expert) is a
    checkpoint transformers reads whole: every tensor used, none missing, the router's
    correction bias loaded; the logits are finite and spread (no near-constant output)."""
    from transformers import AutoModelForCausalLM

    d = make_tiny(tmp_path / "ds", "deepseek_v3", overrides=overrides)
    model, info = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info.values()), info
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "gate") and hasattr(layers[1].mlp, "gate")
    assert layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    attn = layers[0].self_attn
    has_lora = getattr(attn, "q_a_proj", None) is not None
    assert has_lora == (overrides.get("q_lora_rank", 32) is not None)
    logits = model(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.5
