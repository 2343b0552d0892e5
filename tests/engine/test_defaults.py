"""Defaults a user who sets nothing gets, and the offline path's final-only outputs."""

from __future__ import annotations

import pytest

from ember.engine.config import GPU_TOKEN_BUDGET, EngineConfig, default_token_budget
from ember.engine.input_processor import InputProcessor
from ember.engine.messages import EngineCoreOutput
from ember.engine.output_processor import OutputProcessor
from ember.models.config import ModelConfig
from ember.sampling_params import SamplingParams
from ember.tokenizer.tokenizer import Tokenizer


def test_gpu_token_budget_is_fixed_and_cpu_fits_a_whole_prompt():
    assert default_token_budget("cuda", 131072) == GPU_TOKEN_BUDGET == 16384
    assert default_token_budget("cuda:1", 2048) == 16384
    assert default_token_budget("cpu", 2048) == 8192
    assert default_token_budget("cpu", 32768) == 32768


def test_resolved_budget_uses_the_default_unless_set(tiny_model_dir):
    mc = ModelConfig.from_dir(tiny_model_dir("llama"))
    gpu = EngineConfig(model="x", device="cuda", max_model_len=1024, num_kv_blocks=64)
    assert gpu.resolve(mc).max_num_batched_tokens == 16384
    cpu = EngineConfig(model="x", max_model_len=1024, num_kv_blocks=64)
    assert cpu.resolve(mc).max_num_batched_tokens == 8192
    mine = EngineConfig(
        model="x", device="cuda", max_model_len=1024, max_num_batched_tokens=4096, num_kv_blocks=64
    )
    assert mine.resolve(mc).max_num_batched_tokens == 4096


def test_kv_pages_are_whole_prefill_tiles_on_a_gpu_unless_set():
    from ember.kernels.prefill_attention_tma import PAGE_BLOCK_N

    gpu = EngineConfig(model="x", device="cuda")
    assert gpu.block_size == 64 and gpu.block_size % PAGE_BLOCK_N == 0
    assert EngineConfig(model="x", device="cuda:1").block_size == 64
    assert EngineConfig(model="x").block_size == 16
    assert EngineConfig(model="x", device="cuda", block_size=16).block_size == 16
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(model="x", device="cuda", block_size=48)


def test_serve_takes_the_devices_block_size_unless_given():
    import argparse

    from ember.server.args import add_serve_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert engine_config_from_args(p.parse_args(["m", "--device", "cuda"])).block_size == 64
    args = p.parse_args(["m", "--device", "cuda", "--block-size", "32"])
    assert engine_config_from_args(args).block_size == 32
    assert engine_config_from_args(p.parse_args(["m"])).block_size == 16


def test_final_only_returns_finished_requests_with_the_same_text(tiny_model_dir):
    path = tiny_model_dir("llama")
    tok = Tokenizer.from_dir(path)
    inputs = InputProcessor(tok, ModelConfig.from_dir(path).vocab_size, 1024)
    ids = tok.encode("def main():\n    return")
    gen = tok.encode(" the answer is forty two")
    results = {}
    for final_only in (False, True):
        proc = OutputProcessor(tok)
        for rid in ("a", "b"):
            state, _ = inputs.process(rid, ids, SamplingParams(max_tokens=len(gen)))
            proc.add_request(state)
        seen = []
        for k, t in enumerate(gen):
            last = k == len(gen) - 1
            outs = [EngineCoreOutput("a", [t], finish_reason="length" if last else None)]
            outs.append(EngineCoreOutput("b", [t]))  # b never finishes here
            got, _ = proc.process(outs, final_only=final_only)
            seen.append(got)
        results[final_only] = seen
    # Every step reports both requests normally; final-only reports "a" once, when it ends.
    assert all(len(step) == 2 for step in results[False])
    assert [len(step) for step in results[True]] == [0] * (len(gen) - 1) + [1]
    final = results[True][-1][0]
    assert final.finished and final.request_id == "a"
    assert final.outputs[0].text == results[False][-1][0].outputs[0].text == tok.decode(gen)
