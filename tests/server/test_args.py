"""`ember serve`'s flags reach the engine's config."""

from __future__ import annotations

import argparse

from ember.server.args import add_serve_args, engine_config_from_args


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["model-dir", *argv])


def test_defaults_leave_async_scheduling_to_the_device() -> None:
    cfg = engine_config_from_args(parse())
    assert cfg.async_scheduling is None and not cfg.enforce_eager
    assert cfg.gpu_memory_utilization == 0.9 and cfg.enable_prefix_caching


def test_gpu_flags() -> None:
    cfg = engine_config_from_args(
        parse(
            "--device",
            "cuda",
            "--no-async-scheduling",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.5",
            "--no-prefix-caching",
        )
    )
    assert cfg.device == "cuda" and cfg.async_scheduling is False and cfg.enforce_eager
    assert cfg.gpu_memory_utilization == 0.5 and not cfg.enable_prefix_caching
    assert engine_config_from_args(parse("--async-scheduling")).async_scheduling is True


def test_piecewise_graphs_flag() -> None:
    """On by default up to 2,048 tokens (EngineConfig's default too); 0 turns them off; a
    negative count is refused."""
    import pytest

    from ember.engine.config import EngineConfig

    assert engine_config_from_args(parse()).max_piecewise_tokens == 2048
    assert EngineConfig(model="m").max_piecewise_tokens == 2048
    assert engine_config_from_args(parse("--max-piecewise-tokens", "0")).max_piecewise_tokens == 0
    with pytest.raises(ValueError, match="max_piecewise_tokens"):
        engine_config_from_args(parse("--max-piecewise-tokens", "-5"))


def test_kv_eviction_flag_and_a_bad_policy() -> None:
    import pytest

    from ember.engine.config import EngineConfig

    assert engine_config_from_args(parse()).kv_eviction == "next-use"
    assert engine_config_from_args(parse("--kv-eviction", "lru")).kv_eviction == "lru"
    with pytest.raises(SystemExit):  # argparse names the choices
        parse("--kv-eviction", "fifo")
    with pytest.raises(ValueError, match="kv_eviction must be one of next-use, lru"):
        EngineConfig(model="m", kv_eviction="fifo")
