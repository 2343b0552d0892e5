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
