"""The Llama-3.1-8B shape of benchmarks/spec_decode.py's `--verify-shape` (dummy bf16 weights, CUDA
graphs): a forward step of K + 1 tokens per request against a 1-token decode step over the paged KV,
and an EAGLE-3 draft step, so an 8B speedup follows from a measured acceptance.

A module of benchmarks/spec_decode.py (`--verify-shape`), not run on its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CONTEXT = 1024
"""The 8B shape's context per request."""


def verify_shape(quick: bool) -> dict[str, Any]:
    """Verify (K + 1 tokens a request) against decode (1), and an EAGLE-3 draft step, in ms."""
    from benchmarks.engine_gpu import SHAPES
    from ember.attention.triton_backend import TritonAttentionBackend

    dev, backend = torch.device("cuda"), TritonAttentionBackend()
    h = SHAPES["llama"]["hidden_size"]
    target = dummy_model(SHAPES["llama"], dev)
    draft = dummy_model({**SHAPES["llama"], "num_hidden_layers": 1, "vocab_size": 32000}, dev)
    fc = torch.nn.Linear(3 * h, h, bias=False, dtype=torch.bfloat16, device=dev)
    out: dict[str, Any] = {
        "shape": "llama-3.1-8b (dummy bf16)",
        "context": CONTEXT,
        "gpu": torch.cuda.get_device_name(),
        "attention": "decode kernel for 1 token, the paged prefill kernel for K + 1",
        "batches": {},
    }
    for batch in (1, 32):
        dec_ms, mode = time_step(step_fn(target, batch, 1, backend))
        draft_ms, _ = time_step(step_fn(draft, batch, 1, backend, fc))
        d: dict[str, Any] = {
            "decode_ms": dec_ms,
            "timing": mode,
            "eagle3_draft_step_ms": draft_ms,
            "k": {},
        }
        for k in range(1, 3 if quick else 9):
            v, _ = time_step(step_fn(target, batch, k + 1, backend))
            d["k"][k] = {
                "verify_ms": v,
                "ratio": v / dec_ms,
                "break_even_host": v / dec_ms,
                "break_even_eagle3": (v + k * draft_ms) / dec_ms,
                "max_speedup_host": (k + 1) * dec_ms / v,
            }
        out["batches"][batch] = d
        ratios = ", ".join(f"K={k} {e['ratio']:.2f}" for k, e in d["k"].items())
        print(f"8B shape batch {batch}: decode {dec_ms:.3f} ms ({mode}); verify/decode {ratios}")
    return out


def dummy_model(shape: dict[str, Any], dev: torch.device) -> tuple[torch.nn.Module, Any]:
    import tempfile

    from ember.models.config import ModelConfig
    from ember.models.loader import load_model

    path = Path(tempfile.mkdtemp())
    (path / "config.json").write_text(json.dumps(shape))
    mc = ModelConfig.from_dir(str(path))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = load_model(
        str(path), mc, dtype=dtype, device=dev, load_format="dummy", max_position=4096
    )
    return model, mc


def step_fn(
    model_cfg: tuple[torch.nn.Module, Any],
    batch: int,
    q: int,
    backend: Any,
    fc: torch.nn.Module | None = None,
) -> Any:
    """One forward step of `q` new tokens per request over CONTEXT cached ones (blocks scattered
    in the pool), with logits for every new token; `fc` first, as an EAGLE-3 draft runs it."""
    from ember.attention.context import ForwardContext
    from ember.attention.metadata import AttentionMetadata
    from ember.engine.model_runner import kv_cache_shape

    model, mc = model_cfg
    param = next(model.parameters())
    dev, bs = param.device, 16
    per = -(-(CONTEXT + q) // bs)
    kv = torch.zeros(kv_cache_shape(mc, batch * per, bs), dtype=param.dtype, device=dev)
    tables = torch.randperm(batch * per).view(batch, per)
    qsl = [i * q for i in range(batch + 1)]
    lens = [CONTEXT + q] * batch
    new = range(CONTEXT, CONTEXT + q)
    slots = [int(tables[b, p // bs]) * bs + p % bs for b in range(batch) for p in new]

    def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=dev)

    md = AttentionMetadata(
        query_start_loc=t(qsl, torch.int32),
        seq_lens=t(lens, torch.int32),
        block_tables=tables.to(dev, torch.int32),
        slot_mapping=t(slots, torch.int64),
        max_query_len=q,
        max_seq_len=CONTEXT + q,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
        num_decodes=batch if q == 1 else 0,
    )
    ctx = ForwardContext(md, kv, backend)
    ids = torch.randint(0, mc.vocab_size, (batch * q,), device=dev)
    positions = t(list(new) * batch, torch.int64)
    feats = torch.randn(batch * q, 3 * mc.hidden_size, dtype=param.dtype, device=dev)

    @torch.inference_mode()
    def step() -> torch.Tensor:
        if fc is not None:
            fc(feats)
        return model.compute_logits(model(ids, positions, ctx))

    return step


@torch.inference_mode()
def time_step(step: Any) -> tuple[float, str]:
    """Milliseconds of `step` as a CUDA graph replay (eager where it cannot be captured)."""
    from benchmarks.engine_gpu import median_ms

    step(), step()  # Triton compiles and autotunes outside the capture
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return median_ms(graph.replay), "cuda_graph"
    except RuntimeError as e:  # a step that reads host data cannot be captured
        torch.cuda.synchronize()
        return median_ms(step), f"eager ({str(e)[:80]})"


def predicted_speedup(r: dict[str, Any], v: dict[str, Any]) -> float | None:
    """The 8B speedup for this row's acceptance, at the verify cost of its mean draft length."""
    d = v["batches"].get(r["batch"])
    if d is None or r["mean_accepted_len"] is None or r["proposer"] == "none":
        return None
    k = min(max(round(r["mean_draft_len"]), 1), max(d["k"]))
    draft = k * d["eagle3_draft_step_ms"] if r["proposer"].startswith("eagle3") else 0.0
    return r["mean_accepted_len"] * d["decode_ms"] / (d["k"][k]["verify_ms"] + draft)


def print_verify_shape(v: dict[str, Any] | None) -> None:
    """The 8B shape's table (or why it was skipped), after the benchmark's."""
    if v and "skipped" in v:
        print(f"\n8B shape: skipped ({v['skipped']})")
    elif v:
        print(f"\n## Llama-3.1-8B shape, {CONTEXT} context: verify K+1 tokens against decode 1\n")
        print(
            "| batch | K | decode ms | verify ms | verify / decode = break-even accepted length "
            "(ngram, suffix) | break-even with an EAGLE-3 draft |"
        )
        print("|---|---|---|---|---|---|")
        for b, d in v["batches"].items():
            for k, e in d["k"].items():
                print(
                    f"| {b} | {k} | {d['decode_ms']:.3f} | {e['verify_ms']:.3f} | "
                    f"{e['ratio']:.3f} | {e['break_even_eagle3']:.2f} |"
                )
