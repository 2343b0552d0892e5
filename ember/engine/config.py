"""Engine settings, checked once, with defaults that suit the CPU and the tiny model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.kv.eviction import POLICIES
from ember.models.config import DTYPE_BYTES, ModelConfig, dtype_name, kv_dtype_name, parse_dtype
from ember.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str | torch.dtype = "auto"
    device: str = "cpu"
    load_format: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    """Tokens a KV block (page) holds; None: the device's (`default_block_size`)."""
    num_kv_blocks: int | None = None
    """KV blocks to allocate; None sizes the pool from `kv_cache_memory_bytes`."""
    kv_cache_memory_bytes: int = 1 << 30
    kv_cache_dtype: str = "auto"
    """What the KV cache stores: "auto", the model's dtype; "fp8" (or "fp8_e4m3"), FP8 E4M3 at
    one byte an element, twice the tokens in the same memory (`ember.models.config.KV_CACHE_DTYPES`).
    Attention reads it back to the model's dtype."""
    enable_prefix_caching: bool = True
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    """On a GPU: the share of its memory ember may take (weights, activations, KV cache)."""
    enforce_eager: bool = False
    """On a GPU: no CUDA graphs (every kernel launched from Python)."""
    max_cuda_graph_batch: int = 256
    max_piecewise_tokens: int = 2048
    """On a GPU: steps with prompt tokens (a new turn beside running decodes, a prompt's chunk)
    of up to this many tokens replay piecewise CUDA graphs (everything but attention; capped by
    the token budget); 0 launches them from Python (ember/engine/piecewise_graphs.py)."""
    warmup: bool = True
    """On a GPU: at start-up, compile the Triton kernel variants of the batch shapes serving meets
    (ember/engine/warmup.py), in parallel, so that no request waits on a compilation. Off, only
    the profiled step's and the decode graphs' variants are compiled ahead."""
    async_scheduling: bool | None = None
    """Schedule and launch step N+1 while step N runs; None turns it on for a GPU only (on the CPU
    the forward pass blocks the host, so there is nothing to overlap)."""
    cpu_threads: int | None = None
    """Torch threads of a CPU engine core; None leaves one core free for the API process."""
    kv_role: str = "both"
    """Disaggregation: "prefill" leases finished prompts' KV to decode engines, "decode" reads it
    from them, "both" does everything itself."""
    kv_transport: str = "auto"
    """How KV moves between engines: "auto" (engines of one host, no network port: "shm" on the
    CPU, "cuda_ipc" on GPUs), "shm", "cuda_ipc", or "mooncake" (across hosts: TCP, RDMA or
    NVLink, listening on kv_host; the KV network must be private)."""
    kv_host: str = "127.0.0.1"
    """The address this engine's KV transport listens on, as peers reach it."""
    kv_lease_s: float = 30.0
    """How long a prefill engine holds a prompt's KV for a decode engine that does not come."""
    kv_timeout_s: float = 10.0
    """Decode role: how long a KV read, and then the lease's release, may take before the prompt is
    prefilled locally. Under the router's stall timeout, so a frozen prefill engine costs a decode
    stream this long, never its end."""
    kv_events: bool = False
    """Record the prefix cache's stored/evicted block hashes for the router's prefix index."""
    kv_eviction: str = "next-use"
    """Which cached block the GPU prefix cache, the host and the disk tier evict first: "next-use" (each
    block's predicted next use from its reuse so far, farthest first: keeps hits when agent
    sessions taking turns outnumber the cache) or "lru" (ember/kv/eviction.py)."""
    kv_host_gb: float | None = None
    """KV tier in host memory (pinned on a GPU machine), GiB; 0 turns it off. None: on a GPU
    min(32 GiB, 20% of RAM) (see `default_host_tier_bytes`); on the CPU off, since the KV cache
    already lives in RAM there and a copy of it would only halve what RAM holds."""
    kv_disk_dir: str | None = None
    """KV tier on local disk, kept across restarts; None: off."""
    kv_disk_gb: float = 64.0
    kv_store: str | None = None
    """HOST:PORT of a `mooncake_master`: the KV tier every engine shares; None: off."""
    kv_store_gb: float = 1.0
    """Memory this engine lends the shared store, GiB."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (ember/spec_decode): None is off."""
    tensor_parallel_size: int = 1
    """Devices (one process each) that split every layer: heads, MLP widths, vocabulary
    (ember/distributed, ember/engine/workers.py)."""
    enable_expert_parallel: bool = False
    """With tensor_parallel_size > 1: MoE layers split whole experts across the devices rather
    than each expert's width."""
    enable_dp_attention: bool = False
    """Multi-head latent attention (DeepSeek-V3, Kimi K2) data-parallel: each rank holds every
    head and attends to its own requests over a latent cache of its own, so N ranks cache N
    times the tokens (ember/engine/dp_attention.py); the MoE layers stay split as above."""
    cluster_secret: str = field(default="", repr=False)
    """Sent on a decode engine's lease releases (/kv/release is internal); kept out of logs."""

    def __post_init__(self) -> None:
        if self.block_size is None:
            self.block_size = default_block_size(self.device)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_piecewise_tokens < 0:
            raise ValueError(f"max_piecewise_tokens must be >= 0, got {self.max_piecewise_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(
                f"tensor_parallel_size must be in [1, 64], got {self.tensor_parallel_size}"
            )
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in [0.05, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_role not in ("both", "prefill", "decode"):
            raise ValueError(f"kv_role must be both, prefill or decode, got {self.kv_role!r}")
        if self.kv_timeout_s <= 0:
            raise ValueError(f"kv_timeout_s must be > 0, got {self.kv_timeout_s}")
        if self.kv_lease_s <= 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_eviction not in POLICIES:
            raise ValueError(
                f"kv_eviction must be one of {', '.join(POLICIES)}, got {self.kv_eviction!r}"
            )
        if self.kv_host_gb is not None and not 0 <= self.kv_host_gb < 1 << 20:
            raise ValueError(f"kv_host_gb must be >= 0, got {self.kv_host_gb}")
        if not 0 < self.kv_disk_gb < 1 << 30:
            raise ValueError(f"kv_disk_gb must be > 0, got {self.kv_disk_gb}")
        if not 0 < self.kv_store_gb < 1 << 20:
            raise ValueError(f"kv_store_gb must be > 0, got {self.kv_store_gb}")
        if self.enable_dp_attention and self.kv_host_gb is None:
            self.kv_host_gb = 0.0  # no host tier by default: it does not place requests' KV
        kv_dtype_name(self.kv_cache_dtype, "float32")  # ValueError: "unsupported kv_cache_dtype"
        if self.kv_store is not None:
            from ember.kv.tiers.store_master import split_address

            split_address(self.kv_store)  # ValueError: "expected HOST:PORT, got ..."

    def resolve(self, model_config: ModelConfig) -> ResolvedConfig:
        """Fill in what depends on the model: dtype, context length, token budget, KV blocks."""
        # Without torch: the API process resolves its engine's config too.
        dtype = dtype_name(self.dtype, default=model_config.dtype_name)
        max_len = self.max_model_len or model_config.max_position_embeddings
        budget = self.max_num_batched_tokens or default_token_budget(self.device, max_len)
        if budget < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {budget}")
        kv_dtype = kv_dtype_name(self.kv_cache_dtype, dtype)
        planes, heads, dim = model_config.rank_kv_cache_dims(self.tensor_parallel_size)
        block_bytes = (
            model_config.num_hidden_layers
            * planes
            * self.block_size
            * heads
            * dim
            * DTYPE_BYTES[kv_dtype]
        )
        min_blocks = -(-max_len // self.block_size)
        if self.num_kv_blocks is not None:
            num_blocks = self.num_kv_blocks
        else:
            wanted = -(-self.max_num_seqs * max_len // self.block_size)
            num_blocks = max(min(self.kv_cache_memory_bytes // block_bytes, wanted), min_blocks)
        if num_blocks < min_blocks:
            raise ValueError(
                f"{num_blocks} KV blocks of {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len={max_len}; raise num_kv_blocks or lower max_model_len"
            )
        return ResolvedConfig(dtype, max_len, budget, num_blocks, block_bytes, kv_dtype)


GPU_BLOCK_SIZE = 64
"""KV pages of a GPU engine: a key tile of the prefill attention kernels a page, so that a chunk
over a cached prefix loads each tile with one TMA copy (ember/kernels/prefill_attention_tma.py).
An agent's next turn over 32k cached tokens reached its first token in 66 ms against 92 ms with
pages of 16 (H100, `benchmarks/agent_turn.py`); decode and the mixed load were level or better.
What a page costs is up to 63 slots of a sequence's last page and prefix-cache hits in whole pages
(the last partial page of a conversation is computed again)."""

CPU_BLOCK_SIZE = 16


def default_block_size(device: str) -> int:
    """block_size when unset: GPU_BLOCK_SIZE on a GPU, CPU_BLOCK_SIZE on the CPU (where no kernel
    needs whole tiles and the tests' small prompts reuse more of their prefixes)."""
    return GPU_BLOCK_SIZE if device.startswith("cuda") else CPU_BLOCK_SIZE


GPU_TOKEN_BUDGET = 16384
"""Tokens a GPU step may take when the user sets none: vLLM's offline default. With 8,192 the
offline `LLM` ran the 256 x (1024 in, 256 out) load at 0.78x vLLM on an H100, with 16,384 at 0.95x
(measured side by side; docs/performance.md). Longer prompts are chunked."""


def default_token_budget(device: str, max_model_len: int) -> int:
    """max_num_batched_tokens when unset. On a GPU a fixed budget (chunked prefill takes longer
    prompts); on the CPU a whole prompt of max_model_len fits in one step."""
    if device.startswith("cuda"):
        return GPU_TOKEN_BUDGET
    return max(8192, max_model_len)


@dataclass(slots=True, frozen=True)
class ResolvedConfig:
    dtype_name: str
    """float32, float16 or bfloat16; `dtype` is torch's."""
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    kv_block_bytes: int
    kv_dtype_name: str
    """What the KV cache stores, as torch names it (the model's dtype, or float8_e4m3fn)."""

    @property
    def dtype(self) -> torch.dtype:
        """The engine's torch dtype (imports torch: the engine's side only)."""
        return parse_dtype(self.dtype_name)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's torch dtype: the engine's, or FP8 (`EngineConfig.kv_cache_dtype`)."""
        return parse_dtype(self.kv_dtype_name)
