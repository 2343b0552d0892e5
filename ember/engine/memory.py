"""How many KV blocks fit on the GPU after the weights and a profiled worst-case step."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ember.models.loader import weight_bytes_by_kind

if TYPE_CHECKING:
    from ember.engine.config import EngineConfig, ResolvedConfig
    from ember.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


def size_kv_cache(
    runner: ModelRunner, r: ResolvedConfig, cfg: EngineConfig, used_before: int, total: int
) -> int:
    """KV blocks that fit under gpu_memory_utilization after the weights and a profiled step."""
    peak = runner.profile_peak_bytes(r.max_num_batched_tokens, r.max_model_len, cfg.max_num_seqs)
    weights = torch.cuda.memory_allocated(runner.device)
    # CUDA graphs' own pools and the sampler's buffers: a fixed reserve, as vLLM keeps.
    reserve = 512 << 20
    budget = int(total * cfg.gpu_memory_utilization) - used_before - weights - peak - reserve
    num_blocks = budget // r.kv_block_bytes
    min_blocks = -(-r.max_model_len // cfg.block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"not enough GPU memory for the KV cache: {budget / 2**30:.2f} GiB left after "
            f"weights ({weights / 2**30:.2f} GiB) and activations ({peak / 2**30:.2f} GiB) "
            f"holds {max(num_blocks, 0)} blocks, one sequence of max_model_len="
            f"{r.max_model_len} needs {min_blocks}; raise gpu_memory_utilization or lower "
            "max_model_len / max_num_batched_tokens"
        )
    runner.activation_peak_bytes = peak
    return int(num_blocks)


def log_memory(runner: ModelRunner, rank: int, size: int) -> None:
    """One line per device once the KV cache is allocated: this rank's weights, its profiled
    activation peak, its KV cache and what is left of the GPU (each rank of a tensor-parallel
    engine logs its own)."""
    dev = runner.device
    free, total = torch.cuda.mem_get_info(dev)
    kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
    weights = sum(weight_bytes_by_kind(runner.model).values())
    who = f"GPU {dev.index}" + (f" (rank {rank} of {size})" if size > 1 else "")
    log.info(
        "memory, %s: weights %.2f GiB, activation peak %.2f GiB, KV cache %.2f GiB, "
        "%.2f of %.2f GiB free",
        who,
        weights / 2**30,
        runner.activation_peak_bytes / 2**30,
        kv / 2**30,
        free / 2**30,
        total / 2**30,
    )
