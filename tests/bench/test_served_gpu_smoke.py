"""benchmarks/served_gpu.py's `--device cpu` path: ember served twice (a fresh start and a warm
one) on the tiny model, the same client and loads as on the GPU at toy sizes; the JSON holds every
number the issue's table is made from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_served_gpu_runs_ember_fresh_and_warm_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "served_gpu.py"), "--device", "cpu"]
    done = subprocess.run(
        [*cmd, "--engines", "ember"], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [written] = tmp_path.glob("served_gpu-cpu-*.json")  # <bench>-<hardware>-<date>.json
    report = json.loads(written.read_text())
    runs = report["engines"]["ember"]
    for kind in ("fresh", "warm"):
        run = runs[kind]
        assert run["ready_s"] > 0
        assert run["mixed"]["completed"] == 8 and run["mixed"]["errors"] == 0
        assert run["mixed"]["completion_tokens"] == 8 * 8  # ignore_eos: every token asked for
        assert run["b1_tpot_ms"] > 0
        # An agent's conversations of 64 and 160 tokens, each answered, then their next turns.
        assert set(run["agent"]) == {"64", "160"}
        assert 0 < run["short"]["min_s"] <= run["short"]["p50_s"] <= run["short"]["max_s"]
        assert all(t["first_turn_s"] > 0 and t["next_turn_s"] > 0 for t in run["agent"].values())
    # The sweep runs on the last (warm) start alone.
    assert "sweep" not in runs["fresh"]
    assert [s["rate"] for s in runs["warm"]["sweep"]] == [4.0, 8.0]
    assert runs["first_minute"]["requests"] == 8 and runs["first_minute"]["worst"] > 0
    assert runs["warm_again"]["requests"] == 8 and runs["warm"]["mixed_again"]["completed"] == 8
    assert "| mixed, output tok/s |" in done.stdout
    assert "| agent, 160 tokens: first / next turn |" in done.stdout
    assert "| a fresh 16-token prompt alone, TTFT p50 (min-max) |" in done.stdout


def test_a_variant_at_a_directory_runs_that_trees_ember(tmp_path: Path) -> None:
    """`VARIANT@DIR`: the variant's flags, and the ember package of the tree at DIR (a change's
    baseline in the same call), not the working directory's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import served_gpu

    tree = tmp_path / "base"
    (tree / "ember").mkdir(parents=True)
    (tree / "ember" / "__init__.py").write_text("")
    cmd = served_gpu.command(f"ember-no-host-tier@{tree}", "/models/m", 8000, "cpu")
    assert cmd[1:4] == ["-P", "-m", "ember.cli"] and cmd[cmd.index("--kv-host-gb") + 1] == "0"
    env = served_gpu.environment(f"ember@{tree}", tmp_path / "caches")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tree.resolve())
    found = subprocess.run(
        [sys.executable, "-P", "-c", "import ember; print(ember.__file__)"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.stdout.strip() == str(tree.resolve() / "ember" / "__init__.py"), found.stderr
    # Without a tree, the server imports what the environment gives it.
    plain = served_gpu.environment("ember", tmp_path / "caches")
    assert plain.get("PYTHONPATH") == os.environ.get("PYTHONPATH")


def test_weights_as_files_load_through_the_real_loader(tmp_path: Path) -> None:
    """`--weights files`: the random checkpoint has every weight a Llama model asks for, under
    the names Hugging Face checkpoints use, in one shard a layer with an index."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from served_gpu import write_weights

    from ember.models.config import ModelConfig
    from ember.models.loader import load_model

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    size = write_weights(tmp_path, cfg)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) == 2 + 2  # the embedding, a shard a layer, the norm and LM head
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == size
    model = load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.bfloat16)
    params = dict(model.named_parameters())
    assert sum(p.numel() * 2 for p in params.values()) == size
    assert all(torch.isfinite(p).all() for p in params.values())
    with pytest.raises(SystemExit, match="dense Llama-style or DeepSeek-V3"):
        write_weights(tmp_path, {**cfg, "num_experts": 8})


def _deepseek_cfg(quant: dict) -> dict:
    """A tiny DeepSeek-V3 shape (MLA, a dense first layer, 8 routed experts) in `quant`."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "vocab_size": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }


def test_moe_weights_as_files_in_kimi_k25s_int4_scheme_load(tmp_path: Path) -> None:
    """`--weights files --quant k25-int4` on a DeepSeek-V3 shape: MLA, a dense first layer, the
    router with its bias, routed experts packed in INT4 (compressed-tensors' names, `weight_shape`
    int64) and the rest bf16, as the scheme's ignore list says; the real loader takes it."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quant_schemes import KIMI_K25_INT4
    from safetensors import safe_open
    from served_gpu import _quantized, write_weights

    from ember.models.config import ModelConfig
    from ember.models.loader import load_model

    cfg = _deepseek_cfg(KIMI_K25_INT4)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_weights(tmp_path, cfg)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    expert = "model.layers.1.mlp.experts.3.down_proj"
    assert {f"{expert}.weight_packed", f"{expert}.weight_scale", f"{expert}.weight_shape"} <= names
    assert f"{expert}.weight" not in names
    for bf16 in (
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "lm_head.weight",
    ):
        assert bf16 in names, bf16
    with safe_open(str(tmp_path / index["weight_map"][f"{expert}.weight_shape"]), "pt") as f:
        assert f.get_tensor(f"{expert}.weight_shape").tolist() == [64, 32]
        assert f.get_tensor(f"{expert}.weight_shape").dtype == torch.int64
        assert f.get_tensor(f"{expert}.weight_packed").shape == (64, 4)
    assert not _quantized("model.layers.1.mlp.gate", KIMI_K25_INT4["ignore"])
    model = load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32)
    assert any("packed" in n for n, _ in model.named_parameters())
    with pytest.raises(SystemExit, match="pack-quantized INT4"):
        write_weights(tmp_path, {**cfg, "quantization_config": {"quant_method": "fp8"}})


def test_moe_weights_as_files_in_fp8_blocks_load(tmp_path: Path) -> None:
    """`--weights files --quant fp8-blocks` (Kimi K2's format, as DeepSeek-V3 publishes it):
    every Linear but the router and lm_head in e4m3 with a float32 `weight_scale_inv` a 128 x 128
    block; the real loader takes it."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from quant_schemes import DEEPSEEK_FP8
    from safetensors import safe_open
    from served_gpu import write_weights

    from ember.models.config import ModelConfig
    from ember.models.loader import load_model

    cfg = _deepseek_cfg(DEEPSEEK_FP8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_weights(tmp_path, cfg)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = {}
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / file), "pt") as f:
            shard[name] = f.get_tensor(name)
    for fp8 in (
        "model.layers.1.mlp.experts.3.down_proj",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.1.self_attn.kv_b_proj",
        "model.layers.1.self_attn.kv_a_proj_with_mqa",
        "model.layers.0.mlp.gate_proj",
    ):
        assert shard[f"{fp8}.weight"].dtype == torch.float8_e4m3fn, fp8
        assert shard[f"{fp8}.weight_scale_inv"].dtype == torch.float32
        assert shard[f"{fp8}.weight_scale_inv"].shape == (1, 1)  # one 128 x 128 block
        assert shard[f"{fp8}.weight"].float().abs().max() <= 448
    for bf16 in (
        "model.layers.1.mlp.gate.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.embed_tokens.weight",
    ):
        assert shard[bf16].dtype == torch.bfloat16, bf16
    model = load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32)
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())


def test_an_engine_named_again_runs_again_under_its_own_key(tmp_path: Path) -> None:
    """An A/B in alternating order: each repeat is a run of its own (its own key, so its own
    caches and a fresh start of its own), the engine's command unchanged."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from served_gpu import runs_of

    assert runs_of("ember,ember@.ab/base,ember@.ab/base,ember") == [
        ("ember", "ember"),
        ("ember@.ab/base", "ember@.ab/base"),
        ("ember@.ab/base#2", "ember@.ab/base"),
        ("ember#2", "ember"),
    ]
    assert runs_of("vllm") == [("vllm", "vllm")]


def test_cold_weights_evicts_every_shard_and_leaves_them_readable(tmp_path: Path) -> None:
    """`--cold-weights`: every safetensors file is written back and dropped from the page cache
    (its bytes counted); the files are unchanged and the other files untouched."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from served_gpu import evict_weights

    shards = {f"model-{i}.safetensors": os.urandom(4096 * (i + 1)) for i in range(3)}
    for name, data in shards.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text("{}")
    assert evict_weights(tmp_path) == sum(len(d) for d in shards.values())
    assert all((tmp_path / n).read_bytes() == d for n, d in shards.items())
    assert evict_weights(tmp_path / "missing") == 0


def test_the_start_up_lines_kept_include_the_loads_own(tmp_path: Path) -> None:
    """The JSON keeps the log's start-up lines: the phases, the read-ahead and the load that ran
    beside the start-up compile; not the rest of the log."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from served_gpu import startup_lines

    log = tmp_path / "server.log"
    log.write_text(
        "INFO:ember.engine.core:weights read ahead of the load: 16.1 of 16.1 GB in 2.5 s, done\n"
        "INFO:ember.engine.core:weights loaded in 1.5 s on a thread beside the start-up compile "
        "(0.0 s waited for after it)\n"
        "INFO:uvicorn:GET /health 200\n"
        "INFO:ember.engine.startup_clock:start-up: config 0.2 s, model 0.5 s, precompile 2.3 s\n"
    )
    kept = startup_lines(log)
    assert len(kept) == 3 and not any("uvicorn" in line for line in kept)
    assert any("beside the start-up compile" in line for line in kept)
