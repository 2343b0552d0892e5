"""Speculative decoding on SmolLM2-135M-Instruct: tok/s, accepted length and speedup per proposer.

Three prompt sets, rendered with the model's chat template as the server renders them: agentic tool
calls (the `ember bench` agentic workload's sessions: system prompt, tool schemas, earlier tool calls
and results; the answer is a tool call), code editing (a file and a small change to make; the answer
quotes the file; benchmarks/data/spec_code_edit.jsonl) and free chat (benchmarks/data/spec_chat.jsonl).
For each set, batch size, setting (greedy; temperature 0.7 with top-p 0.95) and proposer (none,
ngram, suffix, eagle3 with `--draft-model`) it times the offline engine's generation over the batch
after warm-ups, reads the engine's speculation counters (mean accepted length = 1 + accepted tokens /
drafts) and divides by no speculation timed in the same cell. Greedy outputs must equal no
speculation's token for token: a mismatch is a failure in the table and the JSON, with the
baseline's top-2 logprob gap where they part (a near tie points at bf16 numerics, a wide gap at a
bug), and the exit status is 1.

Every timed run has a KV cache salt of its own, which is also the proposers' scope (their tenant):
no proposer learns a run's answers from its warm-ups or from another cell.

`--verify-shape` also times, on the Llama-3.1-8B shape (dummy bf16 weights, CUDA graphs), a forward
step of K + 1 tokens per request against a 1-token decode step at batch 1 and 32 over the paged KV
(1k context), K = 1..8, and an EAGLE-3 draft step (one 8B-wide layer, fc, a 32k-token head), so an 8B
speedup follows from a measured acceptance: accepted length x t(decode) / (t(verify) + t(draft)).

    python benchmarks/spec_decode.py [--model DIR|FILE.gguf] [--batch-sizes 1,8,32,64]
        [--proposers ngram,suffix] [--draft-model DIR] [--verify-shape] [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.result_names import result_path  # noqa: E402
from benchmarks.spec_phases import PhaseTimer, per_step_ms  # noqa: E402
from benchmarks.spec_prompts import answer_shape, prompt_sets  # noqa: E402
from benchmarks.spec_verify_shape import (  # noqa: E402
    predicted_speedup,
    print_verify_shape,
    verify_shape,
)
from ember.engine.llm_engine import LLMEngine  # noqa: E402
from ember.entrypoints.llm import LLM  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402
from ember.spec_decode.config import SpeculativeConfig  # noqa: E402
from ember.tokenizer.tokenizer import Tokenizer  # noqa: E402

SETTINGS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.7, "top_p": 0.95},
}
MAX_TOKENS = {"agentic": 128, "code": 512, "chat": 256}
QUICK_MAX_TOKENS = {"agentic": 12, "code": 16, "chat": 12}
MIN_REQUESTS = 8
"""A cell runs batches one after another until this many requests are done (batch 1: 8 prompts)."""
MIN_ROUNDS = 3
"""And at least this many batches: one batch of 64 agentic answers is ~0.3 s on an H100, and cells
that never drafted measured 0.74-1.26x of each other in one such round."""
_ids = itertools.count()

# -- timing one cell -----------------------------------------------------------------------------


def generate(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], salt: str
) -> tuple[list[list[int]], float, int]:
    """`LLM.generate` with a KV cache salt (the offline API takes none): token ids, wall time and
    how many requests the engine failed (finish reason "error")."""
    t0 = time.perf_counter()
    ids = [f"{salt}#{next(_ids)}" for _ in prompts]
    for rid, p, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp, cache_salt=salt)
    done: dict[str, list[int]] = {}
    errors = 0
    while len(done) < len(ids):
        if not engine.has_unfinished_requests():
            raise RuntimeError("engine went idle with requests unanswered")
        for out in engine.step(final_only=True):
            done[out.request_id] = list(out.outputs[0].token_ids)
            errors += out.outputs[0].finish_reason == "error"
    return [done[r] for r in ids], time.perf_counter() - t0, errors


COUNTERS = ("drafts", "draft_tokens", "accepted_tokens", "steps")


def spec_counters(engine: LLMEngine) -> dict[str, Any] | None:
    """The engine's speculation counters since start; None where its stats have none."""
    s = engine.core.stats()
    if not hasattr(s, "spec_drafts"):
        return None
    return {
        "drafts": s.spec_drafts,
        "draft_tokens": s.spec_draft_tokens,
        "accepted_tokens": s.spec_accepted_tokens,
        "steps": s.num_steps,
        "accepted_per_pos": list(s.spec_accepted_per_pos),
    }


def add_counts(total: dict[str, Any], before: dict | None, after: dict | None) -> None:
    """Add one run's counters (after - before) into `total`; None where the engine has none."""
    if before is None or after is None:
        total.update(dict.fromkeys(COUNTERS), accepted_per_pos=None)
        return
    for k in COUNTERS:
        total[k] = total.get(k, 0) + after[k] - before[k]

    def at(xs: list[int], i: int) -> int:
        return xs[i] if i < len(xs) else 0

    pos, a, b = (
        total.get("accepted_per_pos", []),
        after["accepted_per_pos"],
        before["accepted_per_pos"],
    )
    n = max(len(pos), len(a))
    total["accepted_per_pos"] = [at(pos, i) + at(a, i) - at(b, i) for i in range(n)]


@dataclass
class _Tally:
    """One proposer's timed runs in a cell, added up over its rounds."""

    tokens: list[list[int]] = field(default_factory=list)
    wall: float = 0.0
    errors: int = 0
    counts: dict[str, Any] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)


def measure(
    llms: dict[str, LLM],
    timers: dict[str, PhaseTimer],
    prompts: list[list[int]],
    batch: int,
    setting: str,
    max_tokens: int,
    cell: str,
    compile_cell: str | None,
    quick: bool,
) -> list[dict[str, Any]]:
    """Rounds of `batch` requests, each timed after warm-ups, one row per proposer. The proposers
    take turns round by round, each round starting with the next one, so a drift of the host's
    speed spreads over all of them. Warm-ups on a GPU: the same requests under a compile salt (a
    scope of their own) so that Triton compiles this round's shapes (a prefill over a cached
    prefix, decodes, verification) before the clock runs, not in the first engine to meet them;
    then one token under this round's salt, which puts the prompts in the prefix cache and shows
    the proposers no part of an answer."""
    rounds = 1 if quick else max(-(-MIN_REQUESTS // batch), MIN_ROUNDS)
    base = SamplingParams(max_tokens=max_tokens, **SETTINGS[setting])
    names = list(llms)
    tally = {name: _Tally() for name in names}
    for r in range(rounds):
        chunk = [prompts[(r * batch + i) % len(prompts)] for i in range(batch)]
        seeded = setting != "greedy"
        params = [replace(base, seed=r * batch + i) if seeded else base for i in range(batch)]
        one = [replace(p, max_tokens=1) for p in params]
        for name in names[r % len(names) :] + names[: r % len(names)]:
            engine, t, timer = llms[name].engine, tally[name], timers[name]
            salt = f"{cell}/{name}/r{r}"
            if compile_cell is not None:  # the timed run's shapes: a cached prefix, then decodes
                compile_salt = f"{compile_cell}/{name}"
                generate(engine, chunk, one, compile_salt)
                warm = [replace(p, max_tokens=min(16, max_tokens)) for p in params]
                generate(engine, chunk, warm, compile_salt)
            generate(engine, chunk, one, salt)
            before = spec_counters(engine)
            timer.reset()
            out, w, failed = generate(engine, chunk, params, salt)
            for k, v in timer.take().items():
                t.phases[k] = t.phases.get(k, 0.0) + v
            add_counts(t.counts, before, spec_counters(engine))
            t.tokens, t.wall, t.errors = t.tokens + out, t.wall + w, t.errors + failed
    return [summary(tally[name], rounds) | {"proposer": name} for name in names]


def summary(t: _Tally, rounds: int) -> dict[str, Any]:
    n_out, drafts = sum(len(x) for x in t.tokens), t.counts["drafts"]
    return {
        "requests": len(t.tokens),
        "errored_requests": t.errors,
        "rounds": rounds,
        "output_tokens": n_out,
        "wall_s": t.wall,
        "tok_s": n_out / t.wall,
        **t.counts,
        "mean_accepted_len": 1 + t.counts["accepted_tokens"] / drafts if drafts else None,
        "mean_draft_len": t.counts["draft_tokens"] / drafts if drafts else None,
        "step_ms": per_step_ms(t.phases, t.counts["steps"] or 0, t.wall),
        "tokens": t.tokens,
    }


TIE_GAP = 0.25
"""A greedy difference where the speculative run's token scores within this of the baseline's
best (the baseline's own logprobs there, top SCORED) is bfloat16 numerics (two steps of bf16 at
logits of 16-32: the verify rows run through other GEMM shapes and attention tiles), not a
verification bug."""
SCORED = 5


def mismatches(
    base: LLMEngine, prompts: list[list[int]], ref: list[list[int]], got: list[list[int]]
) -> list[dict[str, Any]]:
    """Where each differing request parts from the baseline, the baseline's top-2 logprob gap
    there and how far the speculative token's logprob is behind the best (the baseline engine
    scores prompt + the common prefix; None past its top SCORED), and whether it is a near tie."""
    found = []
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        if a == b:
            continue
        j = next(
            (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=SCORED)
        rid = f"diagnose#{next(_ids)}"
        base.add_request(rid, {"prompt_token_ids": prompts[i % len(prompts)] + a[:j]}, params)
        lp = None
        while base.has_unfinished_requests():
            for out in base.step(final_only=True):
                lp = out.outputs[0].logprobs
        scored = {t: v.logprob for t, v in lp[0].items()} if lp else {}
        top = sorted(scored.values(), reverse=True)
        best = top[0] if top else None
        gap = top[0] - top[1] if len(top) > 1 else None
        spec_token = b[j] if j < len(b) else None
        behind = None if best is None or spec_token not in scored else best - scored[spec_token]
        found.append(
            {
                "request": i,
                "position": j,
                "lengths": [len(a), len(b)],
                "baseline_token": a[j] if j < len(a) else None,
                "spec_token": spec_token,
                "baseline_top2_gap": gap,
                "spec_token_behind_best": behind,
                "near_tie": behind is not None and behind <= TIE_GAP + 1e-6,
            }
        )
    return found


# -- the proposers' engines ------------------------------------------------------------------------


def proposer_configs(args: argparse.Namespace) -> dict[str, SpeculativeConfig | None]:
    """ "name" or "name:K" per proposer; eagle3 joins when a draft model is given."""
    out: dict[str, SpeculativeConfig | None] = {"none": None}
    names = [p for p in args.proposers.split(",") if p]
    if args.draft_model and not any(p.startswith("eagle3") for p in names):
        names.append("eagle3")
    for item in names:
        method, _, k = item.partition(":")
        draft = args.draft_model if method == "eagle3" else None
        k_ = int(k or args.num_speculative_tokens)
        out[item] = SpeculativeConfig(method, k_, draft_model=draft, max_batch=args.spec_max_batch)
    return out


def open_engines(
    model: str, configs: dict[str, SpeculativeConfig | None], kw: dict[str, Any], sync: bool
) -> tuple[dict[str, LLM], dict[str, dict[str, Any]]]:
    """One LLM per proposer, all open at once, so each cell runs them back to back. `sync`: also
    "none/sync", no speculation without async scheduling (what a speculating step gives up)."""
    llms: dict[str, LLM] = {}
    status: dict[str, dict[str, Any]] = {}
    for name, spec in configs.items():
        status[name] = (
            {}
            if spec is None
            else {
                "method": spec.method,
                "k": spec.num_speculative_tokens,
                "draft_model": spec.draft_model,
            }
        )
        try:
            llms[name] = LLM(model, **kw, speculative=spec) if spec else LLM(model, **kw)
            status[name]["available"] = True
        except (TypeError, ValueError, NotImplementedError, ImportError) as e:
            status[name].update(available=False, error=f"{type(e).__name__}: {e}")
            print(f"proposer {name}: not run ({status[name]['error']})", flush=True)
    if sync:
        llms["none/sync"] = LLM(model, **kw, async_scheduling=False)
        status["none/sync"] = {"async_scheduling": False, "available": True}
    return llms, status


def run_sets(args: argparse.Namespace, out: dict[str, Any], save: Callable[[], None]) -> None:
    """Every cell into out["results"], saved after each (a run cut short keeps what it did)."""
    from ember.models.resolve import get_model, resolve_model

    model = resolve_model(args.model) if args.model else str(get_model("smollm2"))
    tok = Tokenizer.from_dir(model)
    limits = QUICK_MAX_TOKENS if args.quick else MAX_TOKENS
    # At least MIN_REQUESTS prompts: batch 1 runs that many different requests, not one 8 times.
    n = max(*args.batch_sizes, 1 if args.quick else MIN_REQUESTS)
    sets, info = prompt_sets(tok, n, args.sets.split(","), args.quick)
    longest = max(len(p) + limits[s] for s, ps in sets.items() for p in ps)
    top = max(args.batch_sizes)
    max_len = longest + 64  # room for a draft's lookahead past max_tokens
    kw = dict(
        device=args.device,
        dtype=args.dtype,
        max_model_len=max_len,
        max_num_seqs=top,
        max_cuda_graph_batch=top,
        num_kv_blocks=2 * top * -(-max_len // 16) + 64,
        kv_host_gb=0,
    )
    llms, status = open_engines(model, proposer_configs(args), kw, args.sync_baseline)
    timers = {name: PhaseTimer(llm.engine) for name, llm in llms.items()}
    out.update(model=model, prompt_sets=info, proposers=status, engine=kw)
    for name, llm in llms.items():  # whether the engine drafts at all with this proposer
        before, delta = spec_counters(llm.engine), {}
        probe = next(iter(sets.values()))[:2]
        greedy = [SamplingParams(temperature=0.0, max_tokens=16)] * len(probe)
        generate(llm.engine, probe, greedy, f"probe/{name}")
        add_counts(delta, before, spec_counters(llm.engine))
        status[name]["drafts_in_probe"] = delta["drafts"]
    for set_name, prompts in sets.items():
        for batch in args.batch_sizes:
            for setting in args.settings.split(","):
                cell = f"{set_name}/b{batch}/{setting}"
                rows = [
                    r | {"set": set_name, "batch": batch, "setting": setting}
                    for r in measure(
                        llms,
                        timers,
                        prompts,
                        batch,
                        setting,
                        limits[set_name],
                        cell,
                        f"{set_name}/b{batch}/compile" if args.device == "cuda" else None,
                        args.quick,
                    )
                ]
                compare(rows, llms["none"].engine, prompts)
                rows[0]["answers"] = answer_shape(tok, set_name, rows[0]["tokens"])
                for r in rows:
                    acc, ms = r["mean_accepted_len"], r["step_ms"]
                    print(
                        f"{cell} {r['proposer']}: {r['tok_s']:.0f} tok/s x{r['speedup']:.2f}"
                        + (f", accepted {acc:.2f}" if acc else "")
                        + (f"; step {ms['period']:.2f} ms, host {ms['host']:.2f}" if ms else "")
                        + (f" ({phase_list(ms)})" if ms else ""),
                        flush=True,
                    )
                    del r["tokens"]
                out["results"] += rows
                save()
    for llm in llms.values():
        llm.close()
    del llms
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()


def phase_list(ms: dict[str, float]) -> str:
    skip = ("period", "host")
    return ", ".join(f"{k} {v:.2f}" for k, v in ms.items() if k not in skip)


def compare(rows: list[dict[str, Any]], base_engine: LLMEngine, prompts: list[list[int]]) -> None:
    """Speedups over rows[0] (no speculation); greedy outputs checked against it."""
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tok_s"] / base["tok_s"]
        if r["setting"] != "greedy" or r is base:
            continue
        found = mismatches(base_engine, prompts, base["tokens"], r["tokens"])
        r["mismatched_requests"] = len(found)
        r["mismatches"] = found
        # Equal, or parted only at bf16 near ties (TIE_GAP); anything else fails the cell.
        r["greedy_match"] = all(m["near_tie"] for m in found)


# -- report ----------------------------------------------------------------------------------------


def checks(r: dict[str, Any]) -> str:
    """The table's verdict on a row: greedy equality with no speculation, and failed requests."""
    parts = []
    if r.get("greedy_match") is not None:
        n, of = r["mismatched_requests"], r["requests"]
        if not r["greedy_match"]:
            far = sum(not m["near_tie"] for m in r["mismatches"])
            parts.append(f"**FAIL** greedy differs in {n}/{of}, {far} not at a near tie")
        elif n:
            parts.append(f"greedy == none but {n}/{of} parted at bf16 near ties")
        else:
            parts.append("greedy == none")
    if r["errored_requests"]:
        parts.append(f"**FAIL** {r['errored_requests']} requests errored")
    return "; ".join(parts)


def print_table(out: dict[str, Any]) -> None:
    print(f"\n## Speculative decoding, {out.get('model', '')} on {out['gpu']} ({out['dtype']})\n")
    print(
        "| set | batch | setting | proposer | tok/s | speedup | mean accepted | drafts | "
        "step ms (host) | checks | 8B speedup |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in out["results"]:
        acc = "" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"
        p8, ms = r.get("predicted_8b_speedup"), r.get("step_ms")
        step = f"{ms['period']:.2f} ({ms['host']:.2f})" if ms else ""
        print(
            f"| {r['set']} | {r['batch']} | {r['setting']} | {r['proposer']} | {r['tok_s']:.0f} "
            f"| {r['speedup']:.2f} | {acc} | {'' if r['drafts'] is None else r['drafts']} "
            f"| {step} | {checks(r)} | {'' if p8 is None else f'{p8:.2f}'} |"
        )
    print_verify_shape(out.get("verify_shape"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--batch-sizes", help="comma-separated; default 1,8,32,64 (--quick: 1,2)")
    ap.add_argument("--sets", default="agentic,code,chat")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="greedy, sampled or both")
    ap.add_argument("--proposers", default="ngram,suffix", help="name or name:K, comma-separated")
    ap.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="K of a proposer given without :K (default 0: the engine's, 8 for ngram and "
        "suffix, 4 for eagle3)",
    )
    ap.add_argument("--draft-model", help="an EAGLE-3 draft checkpoint: adds the eagle3 proposer")
    ap.add_argument(
        "--spec-max-batch", type=int, help="SpeculativeConfig.max_batch (default: the engine's)"
    )
    ap.add_argument(
        "--sync-baseline",
        action="store_true",
        help="also run no speculation without async scheduling (the overlap's worth)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="default bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--verify-shape", action="store_true", help="also time the 8B verify step")
    ap.add_argument("--skip-sets", action="store_true", help="only the 8B shape")
    ap.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    ap.add_argument(
        "--out", help="JSON path (default benchmarks/results/spec_decode-<GPU or cpu>-<date>.json)"
    )
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.batch_sizes = [
        int(b) for b in (args.batch_sizes or ("1,2" if args.quick else "1,8,32,64")).split(",")
    ]
    cuda = args.device == "cuda"
    if not cuda:  # as the server's engine process does (ember/engine/core_proc.py)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    gpu = torch.cuda.get_device_name() if cuda else f"cpu-{platform.machine()}"
    out: dict[str, Any] = {
        "gpu": gpu,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "quick": args.quick,
        "batch_sizes": args.batch_sizes,
        "settings": SETTINGS,
        "max_tokens": QUICK_MAX_TOKENS if args.quick else MAX_TOKENS,
        "results": [],
    }
    dest = Path(args.out) if args.out else result_path("spec_decode", gpu)
    dest.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        keys = ("set", "batch", "setting", "proposer", "errored_requests")
        out["failures"] = [
            {k: r[k] for k in keys}
            | {k: r[k] for k in ("mismatched_requests", "mismatches") if k in r}
            for r in out["results"]
            if r.get("greedy_match") is False or r["errored_requests"]
        ]
        dest.write_text(json.dumps(out, indent=2, default=str))

    if args.verify_shape:  # first: its 8B weights leave the GPU before the engines take it
        out["verify_shape"] = verify_shape(args.quick) if cuda else {"skipped": "GPU only"}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        save()
    if not args.skip_sets:
        run_sets(args, out, save)
    if "batches" in out.get("verify_shape", {}):
        for r in out["results"]:
            r["predicted_8b_speedup"] = predicted_speedup(r, out["verify_shape"])
    save()
    print_table(out)
    print(f"\nwrote {dest}")
    if out["failures"]:
        print(f"FAIL: {len(out['failures'])} cells failed their checks (JSON: failures)")
        sys.exit(1)


if __name__ == "__main__":
    main()
