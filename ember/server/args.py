"""Command-line options of `ember serve` (kept apart so `ember --help` stays light)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ember.edge_limits import add_connection_limit_args
from ember.kv.eviction import POLICIES
from ember.kv.transport.factory import KINDS
from ember.spec_decode.config import HYBRID, METHODS, SpeculativeConfig

if TYPE_CHECKING:
    from ember.engine.config import EngineConfig


Group = argparse._ActionsContainer
"""What the `add_*_args` helpers add to: a parser or one of its argument groups."""


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`ember serve`'s flags, in the groups its --help shows."""
    g = p.add_argument_group("model", "what is served, and under which names")
    g.add_argument(
        "model",
        help="a Hugging Face-format model directory, a .gguf file (imported once), or a known "
        "model's name (smollm2)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model ids clients send; the first is the one answers carry (default: the "
        "model argument; for a known model's name, its directory's name)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="weights' and activations' dtype: auto (the checkpoint's), float32, bfloat16, float16",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="how weights load: the checkpoint's files, or dummy (random, for benchmarks)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length in tokens, prompt and output together (default: the model's own, "
        "config.json's max_position_embeddings)",
    )
    g.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="how tool calls are read from the output: hermes | kimi_k2 | none",
    )
    g.add_argument("--seed", type=int, default=0, help="the sampler's seed for unseeded requests")

    g = p.add_argument_group("server", "where the HTTP server listens, and how it logs and stops")
    g.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    g.add_argument("--port", type=int, default=8000, help="the port to listen on")
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    g.add_argument(
        "--log-level",
        default="info",
        help="debug | info | warning | error (the engine core's: $EMBER_LOG_LEVEL)",
    )

    add_trust_args(p.add_argument_group("security", "API keys, tenants and the cluster secret"))

    g = p.add_argument_group("limits", "what one client or request may take of the server")
    g.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests beyond max-num-seqs that may wait before 429",
    )
    g.add_argument(
        "--max-body-bytes",
        type=int,
        default=32 << 20,
        help="larger request bodies are refused with 413",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers before it is closed",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection stays open",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=4096,
        help="open connections at most (also bounded by the open-file limit); beyond: 503",
    )
    add_connection_limit_args(g)

    g = p.add_argument_group("engine", "batching, the KV cache and the prefix cache")
    g.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")
    g.add_argument(
        "--max-num-seqs", type=int, default=256, help="sequences the engine runs at once"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one engine step may take (default: 16384 on a GPU; on the CPU the larger "
        "of 8192 and max-model-len)",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens a KV block (page) holds (default: 64 on a GPU, 16 on the CPU)",
    )
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks on the device (default: sized from its free memory); a small number caps "
        "the GPU pool for tests and benchmarks of the KV tiers",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="what the KV cache stores: auto (the model's dtype) or fp8 (FP8 E4M3, twice the "
        "tokens in the same memory)",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads of a CPU engine core (default: all cores but one)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while the GPU runs step N (default: on for a GPU)",
    )

    g = p.add_argument_group("parallelism", "several devices per engine (docs/parallel.md)")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="devices the engine splits every layer across, one process each: heads, MLP widths "
        "and the vocabulary (GPUs cuda:0 .. N-1; on the CPU, processes; default: 1)",
    )
    g.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: each device holds whole experts (E / N of them) instead of every "
        "expert at 1 / N of its width",
    )
    g.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="MLA models (DeepSeek-V3, Kimi K2): each device attends to its own requests over a "
        "latent KV cache of its own, rather than to every request by heads with the whole cache "
        "on every device: N devices cache N times the tokens",
    )

    g = p.add_argument_group("GPU", "memory, CUDA graphs and kernel compilation on a GPU")
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the GPU's memory for weights, activations and the KV cache",
    )
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--max-piecewise-tokens",
        type=int,
        default=2048,
        help="GPU: steps with prompt tokens of up to this many tokens replay piecewise CUDA "
        "graphs (everything but attention); 0: launched from Python (default: 2048)",
    )
    g.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GPU: compile the kernels of the batch shapes serving meets at start-up, in "
        "parallel, so no request waits on a compilation (default: on)",
    )

    g = p.add_argument_group(
        "disaggregation", "prefill and decode engines, and how KV moves between them"
    )
    g.add_argument(
        "--role",
        default="both",
        choices=["both", "prefill", "decode"],
        help="disaggregation: prefill leases prompts' KV to decode engines, decode reads it",
    )
    add_kv_transport_arg(g)
    g.add_argument(
        "--kv-host", default="127.0.0.1", help="address peers reach this engine's KV transport at"
    )
    g.add_argument(
        "--kv-lease-s",
        type=float,
        default=30.0,
        help="seconds a prefill engine holds a prompt's KV for a decode engine",
    )
    g.add_argument(
        "--kv-timeout",
        type=float,
        default=10.0,
        help="decode: seconds a KV read (and its lease release) may take before the engine "
        "prefills the prompt itself; keep it under the router's --stall-timeout",
    )

    add_kv_tier_args(
        p.add_argument_group(
            "KV tiers", "where KV blocks evicted from the device go: host memory, disk, a store"
        )
    )
    add_speculative_args(
        p.add_argument_group(
            "speculative decoding", "draft tokens and verify them in one forward (off by default)"
        )
    )


def add_kv_transport_arg(p: Group) -> None:
    """`--kv-transport`, which `ember up` passes on to its engines."""
    p.add_argument(
        "--kv-transport",
        default="auto",
        choices=KINDS,
        help="how engines move KV: auto (engines of one host, no network port: shm on the CPU, "
        "cuda_ipc on GPUs), or mooncake across hosts (it listens on --kv-host, which must be a "
        "private network: Mooncake has no access control)",
    )


def add_kv_tier_args(p: Group) -> None:
    """The KV tiers below the GPU: host memory, local disk, a shared Mooncake Store."""
    p.add_argument(
        "--kv-host-gb",
        type=float,
        default=None,
        help="GiB of (pinned) host memory for KV blocks evicted from the device, the engine's "
        "over all its tensor-parallel ranks; 0: off (default: min(32, 20%% of RAM) on a GPU, "
        "off on the CPU)",
    )
    p.add_argument(
        "--kv-eviction",
        choices=POLICIES,
        default="next-use",
        help="which cached KV block the GPU prefix cache, the host and the disk tier evict first: "
        "next-use (the one whose next use, predicted from its reuse so far, is farthest: keeps "
        "hits when agent sessions outnumber the cache) or lru (default: %(default)s)",
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        help="a local directory for KV blocks, kept across restarts (default: off)",
    )
    p.add_argument("--kv-disk-gb", type=float, default=64.0, help="GiB the disk tier may use")
    p.add_argument(
        "--kv-store",
        default=None,
        metavar="HOST:PORT",
        help="a mooncake_master: the KV store every engine shares (default: off)",
    )
    p.add_argument(
        "--kv-store-gb",
        type=float,
        default=1.0,
        help="GiB of memory this engine lends the shared KV store",
    )


def add_speculative_args(p: Group) -> None:
    """Speculative decoding (ember/spec_decode): off unless --speculative names a proposer."""
    p.add_argument(
        "--speculative",
        default=None,
        choices=METHODS,
        help="draft tokens with this proposer and verify them in one target forward: ngram "
        "(prompt lookup), suffix (suffix trees over the request and recent answers), eagle3 "
        "(a draft head, --draft-model); the output distribution is the target's (default: off)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help="the most draft tokens verified per request and step, 1 to 16 (default: 8 for "
        "ngram and suffix, 4 for eagle3)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="DIR",
        help="eagle3: the draft head's checkpoint directory (config.json + safetensors)",
    )
    p.add_argument(
        "--speculative-hybrid",
        default=None,
        choices=HYBRID,
        help="eagle3: a host proposer beside the head; each request verifies, each step, the "
        "drafts expected to have more tokens stand (default: the head's alone)",
    )
    p.add_argument(
        "--speculative-max-batch",
        type=int,
        default=None,
        metavar="N",
        help="running requests above which the engine stops speculating, as verification then "
        "costs more than it saves (default: decided from measured step times on a GPU)",
    )


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """`--speculative ...` as the engine's config; None when --speculative is absent. A flag that
    needs another, or a value the config refuses, is a ValueError that names it."""
    method = args.speculative
    given = [
        flag
        for flag, value in (
            ("--num-speculative-tokens", args.num_speculative_tokens),
            ("--draft-model", args.draft_model),
            ("--speculative-max-batch", args.speculative_max_batch),
            ("--speculative-hybrid", args.speculative_hybrid),
        )
        if value is not None
    ]
    if method is None:
        if given:
            raise ValueError(f"{', '.join(given)} needs --speculative {'|'.join(METHODS)}")
        return None
    if args.draft_model is not None:
        if method != "eagle3":
            raise ValueError(f"--draft-model is for --speculative eagle3, not {method}")
        if not Path(args.draft_model).is_dir():
            raise ValueError(f"--draft-model {args.draft_model!r} is not a directory")
    k = args.num_speculative_tokens
    if k is not None and not 1 <= k <= 16:  # 0 would mean the method's default to the config
        raise ValueError(f"num_speculative_tokens must be in [1, 16], got {k}")
    return SpeculativeConfig(
        method=method,
        num_speculative_tokens=0 if k is None else k,
        draft_model=args.draft_model,
        max_batch=args.speculative_max_batch,
        hybrid=args.speculative_hybrid,
    )


def add_trust_args(p: Group) -> None:
    """Who may use which face: API keys (tenants) for /v1/*, the cluster secret for the rest."""
    p.add_argument(
        "--api-key",
        nargs="+",
        default=os.environ.get("EMBER_API_KEY", "").split() or None,
        help="API keys for /v1/* (each its own tenant and prefix-cache namespace); "
        "default: EMBER_API_KEY (whitespace-separated)",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help='API keys with tenant names: JSON {"KEY": "TENANT"} or lines KEY TENANT [CACHE_GROUP]',
    )
    p.add_argument(
        "--shared-cache",
        action="store_true",
        help="let all tenants share one prefix cache (off: each tenant hashes its own blocks)",
    )
    p.add_argument(
        "--cluster-secret",
        default=None,
        help="the secret ember's processes share for internal routes and KV transfer; default: "
        "EMBER_CLUSTER_SECRET, else a random one (the internal face is then closed)",
    )
    p.add_argument(
        "--require-secret",
        action="store_true",
        help="answer only requests that carry the cluster secret (all but /health): an engine "
        "behind a router, which is its only public face (ember up sets it on every engine)",
    )
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without the cluster secret (for a Prometheus scraper)",
    )
    p.add_argument(
        "--kv-peers",
        nargs="+",
        default=None,
        metavar="URL",
        help="a decode engine reads KV only from these prefill engines (their base URLs)",
    )


def engine_config_from_args(args: argparse.Namespace, cluster_secret: str = "") -> EngineConfig:
    """The engine's settings from `ember serve`'s arguments (torch-free: built, and so checked,
    before the engine core is spawned with them)."""
    from ember.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        cpu_threads=args.cpu_threads,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        max_piecewise_tokens=args.max_piecewise_tokens,
        warmup=args.warmup,
        async_scheduling=args.async_scheduling,
        kv_role=args.role,
        kv_transport=args.kv_transport,
        kv_host=args.kv_host,
        kv_lease_s=args.kv_lease_s,
        kv_timeout_s=args.kv_timeout,
        kv_events=True,
        kv_host_gb=args.kv_host_gb,
        kv_eviction=args.kv_eviction,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_gb=args.kv_disk_gb,
        kv_store=args.kv_store,
        kv_store_gb=args.kv_store_gb,
        speculative=speculative_config_from_args(args),
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_dp_attention=args.enable_dp_attention,
        cluster_secret=cluster_secret,
    )


@dataclass(frozen=True, slots=True)
class Prepared:
    """What `ember serve` settles before its engine core starts."""

    given: str  # the model as named on the command line (a .gguf is served under that name)
    secret: str
    configured: bool  # whether the secret came from a flag or the environment
    config: EngineConfig


def prepare_serve(args: argparse.Namespace) -> Prepared:
    """Settle, torch-free, what the engine core starts from: the model's path (a .gguf is
    imported once; `args.model` becomes its directory), the cluster secret, and the engine's
    config (a bad flag raises ValueError here, before anything starts)."""
    from ember.models.resolve import resolve_model
    from ember.trust import resolve_secret

    given = args.model
    secret, configured = resolve_secret(args.cluster_secret)
    if getattr(args, "require_secret", False) and not configured:
        raise ValueError(
            "--require-secret needs the cluster secret (--cluster-secret or "
            "EMBER_CLUSTER_SECRET): without it nothing could reach this engine"
        )
    args.model = resolve_model(given)
    return Prepared(given, secret, configured, engine_config_from_args(args, secret))
