"""quantization_config read as published: the schemes of Kimi K2.5, llm-compressor's presets and
DeepSeek's FP8, which layers they cover, and every config ember cannot serve refused by what is
wrong."""

from __future__ import annotations

import copy

import pytest

from ember.models.quant_config import WeightQuant, parse_quant_config

# A quantization_config in Kimi K2.5's scheme: INT4, group 32, symmetric on the routed experts;
# attention, the shared experts, the dense layers' MLPs and the LM head left in 16 bits.
KIMI_K25 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
}

FP8_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def test_kimi_k25_quantizes_the_routed_experts_only() -> None:
    q = parse_quant_config(KIMI_K25)
    int4 = WeightQuant(kind="int", bits=4, group_size=32, symmetric=True)
    assert q.scheme_for("model.layers.3.mlp.experts.17.gate_proj") == int4
    assert q.scheme_for("model.layers.3.mlp.experts.17.down_proj") == int4
    for dense in (
        "lm_head",
        "model.layers.3.self_attn.q_a_proj",
        "model.layers.3.self_attn.kv_b_proj",
        "model.layers.3.mlp.shared_experts.up_proj",
        "model.layers.0.mlp.gate_proj",  # the first, dense layer's MLP
        "model.layers.0.mlp.down_proj",
    ):
        assert q.scheme_for(dense) is None, dense
    assert "INT4 weights (group 32, symmetric)" in q.describe()


def test_fp8_presets_and_deepseek_blocks() -> None:
    q = parse_quant_config(FP8_DYNAMIC)
    s = q.scheme_for("model.layers.0.self_attn.q_proj")
    assert (s.kind, s.block_for(4096), s.act_group_for(4096)) == ("fp8", (1, 4096), 4096)
    assert q.scheme_for("lm_head") is None
    tensor = copy.deepcopy(FP8_DYNAMIC)
    tensor["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    assert parse_quant_config(tensor).scheme_for("x.o_proj").per_tensor
    block = copy.deepcopy(FP8_DYNAMIC)
    block["config_groups"]["group_0"]["weights"] |= {
        "strategy": "block",
        "block_structure": [128, 128],
    }
    block["config_groups"]["group_0"]["input_activations"] |= {
        "strategy": "group",
        "group_size": 128,
    }
    s = parse_quant_config(block).scheme_for("x.o_proj")
    assert (s.block, s.act_group) == ((128, 128), 128)
    ds = parse_quant_config(
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["model.layers.0.self_attn.o_proj"],
        }
    )
    s = ds.scheme_for("model.layers.5.mlp.experts.0.up_proj")
    assert (s.block, s.act_group, s.scale_name) == ((128, 128), 128, "weight_scale_inv")
    assert ds.scheme_for("lm_head") is None
    assert ds.scheme_for("model.layers.0.self_attn.o_proj") is None
    assert ds.scheme_for("model.layers.1.self_attn.o_proj") is not None


def test_fused_parts_must_share_a_scheme() -> None:
    q = parse_quant_config(KIMI_K25 | {"ignore": ["re:.*k_proj"]})
    with pytest.raises(ValueError, match=r"quantizes the parts of one fused layer differently"):
        q.scheme_of_parts(["a.q_proj", "a.k_proj", "a.v_proj"])


def _group(**weights) -> dict:
    cfg = copy.deepcopy(KIMI_K25)
    cfg["config_groups"]["group_0"]["weights"] |= weights
    return cfg


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq'"),
        (KIMI_K25 | {"format": "marlin-24"}, "format 'marlin-24' is not supported"),
        (KIMI_K25 | {"quantization_status": "frozen"}, "quantization_status 'frozen'"),
        (KIMI_K25 | {"kv_cache_scheme": {"num_bits": 8}}, "KV-cache quantization"),
        (KIMI_K25 | {"sparsity_config": {"format": "sparse-24"}}, "sparse weights"),
        (KIMI_K25 | {"config_groups": {}}, "no config_groups"),
        (_group(num_bits=3), "pack-quantized int of 3 bits"),
        (_group(num_bits=2), "pack-quantized int of 2 bits"),
        (_group(type="float"), "pack-quantized float of 4 bits"),
        (_group(group_size=0), "positive group_size, got 0"),
        (_group(group_size=None), "positive group_size, got None"),
        (_group(strategy="tensor"), "strategy 'tensor' is not supported"),
        (_group(actorder="group"), "actorder 'group'"),
        (_group(dynamic=True), "dynamic weight quantization"),
        (KIMI_K25 | {"ignore": "lm_head"}, "ignore must be a list"),
        (
            {
                **KIMI_K25,
                "config_groups": {
                    "g": {**KIMI_K25["config_groups"]["group_0"], "targets": "Linear"}
                },
            },
            r"targets must be a list",
        ),
        (
            {
                **KIMI_K25,
                "config_groups": {
                    "g": {
                        **KIMI_K25["config_groups"]["group_0"],
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            },
            r"W4A8",
        ),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]"),
        ({"quant_method": "fp8"}, "no weight_block_size"),
    ],
)
def test_unsupported_configs_are_refused_by_what_is_wrong(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quant_config(config)


def _fp8(weights: dict, acts: dict | None) -> dict:
    cfg = copy.deepcopy(FP8_DYNAMIC)
    cfg["config_groups"]["group_0"]["weights"] |= weights
    cfg["config_groups"]["group_0"]["input_activations"] = acts
    return cfg


TOKEN = FP8_DYNAMIC["config_groups"]["group_0"]["input_activations"]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_fp8({"num_bits": 4}, TOKEN), "float-quantized float of 4 bits"),
        (_fp8({"symmetric": False}, TOKEN), "asymmetric FP8 weights"),
        (_fp8({"strategy": "group", "group_size": 128}, TOKEN), "strategy 'group'"),
        (_fp8({"strategy": "block", "block_structure": [128]}, TOKEN), "block_structure"),
        (_fp8({}, TOKEN | {"dynamic": False}), "static activation scales"),
        (_fp8({}, TOKEN | {"strategy": "tensor"}), "dynamic strategy 'tensor'"),
        (_fp8({}, TOKEN | {"num_bits": 4}), "activations of 4 bits"),
    ],
)
def test_unsupported_fp8_schemes_are_refused(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quant_config(config)


def test_weight_only_fp8_keeps_16_bit_activations() -> None:
    s = parse_quant_config(_fp8({}, None)).scheme_for("a.q_proj")
    assert s.act_group is None and s.act_group_for(4096) == 0
    assert "16-bit activations" in s.describe()
