"""Where a speculative step's host time goes: SmolLM2's shape with dummy weights on one GPU, batch 1
(and `--batch` more), a plain async decode step against a verify step of K drafts, each profiled
with cProfile over the engine core's steps (the Python functions that take the host's time) and
timed by phase (benchmarks/spec_phases.py). The drafts come from a proposer that always drafts K
tokens (the last token repeated), so every step verifies whatever the dummy weights sample; the
host work of a verify step does not depend on how many drafts land.

    python benchmarks/probes/spec_step_profile.py [--k 4] [--batch 1] [--context 3000] [--steps 200]
        [--only 0|K]   # one case per process (an engine's memory is not handed back in-process)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine_gpu import engine_config, random_prompts  # noqa: E402
from benchmarks.smollm2_gpu import SMOLLM2_SHAPE  # noqa: E402
from benchmarks.spec_phases import PhaseTimer, per_step_ms  # noqa: E402
from ember.engine.core import EngineCore  # noqa: E402
from ember.engine.messages import EngineCoreRequest  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402
from ember.spec_decode.config import SpeculativeConfig  # noqa: E402
from ember.spec_decode.proposer import HostProposer  # noqa: E402


class AlwaysDraft(HostProposer):
    """K drafts every step: the request's last token, repeated."""

    def add_request(self, request_id: str, prompt: Sequence[int], scope: str | None) -> None:
        pass

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        return [tokens[-1]] * max_tokens

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        pass


class _Engine:
    """The PhaseTimer's view of a bare core (it wraps `engine.core` and `engine.processor`)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.processor = self  # no detokenizer here: `process` is a no-op to wrap

    def process(self, *args: Any) -> None:
        return None


def profile_case(core: EngineCore, args: argparse.Namespace, k: int) -> dict[str, Any]:
    vocab = SMOLLM2_SHAPE["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    prompts = random_prompts(args.batch, args.context, vocab, 7 + k)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"p{k}-{i}", p, params, [], 100_000))
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    for _ in range(20):  # compile and settle
        core.step()
    timer = PhaseTimer(_Engine(core))  # type: ignore[arg-type]
    timer.reset()
    steps0 = core.num_steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):  # timed without the profiler first
        core.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = core.num_steps - steps0
    timed = per_step_ms(timer.take(), steps, wall)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        core.step()
    prof.disable()
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)
    core.abort_requests([f"p{k}-{i}" for i in range(args.batch)])
    for _ in range(3):
        core.step()
    return {
        "k": k,
        "steps": steps,
        "step_ms": timed,
        "profile": text.getvalue(),
    }


def replay_costs(core: EngineCore, reps: int = 50) -> list[dict[str, float]]:
    """Each captured graph's replay alone: the host's time in the launch call and until the GPU
    is done (medians over `reps`, the GPU idle before each)."""
    import statistics

    out = []
    for size, g in sorted(core.runner.graphs.graphs.items()):
        host, total = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            g.graph.replay()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        row = {
            "rows": size,
            "launch_ms": 1e3 * statistics.median(host),
            "gpu_ms": 1e3 * statistics.median(total),
        }
        print(row, flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--only", type=int, help="run only this case: 0 (plain) or K")
    ap.add_argument("--replay-costs", action="store_true", help="time each graph's replay too")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "spec_step.json"))
    args = ap.parse_args()
    model = Path(tempfile.mkdtemp())
    (model / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "cases": []}
    for k in (0, args.k) if args.only is None else (args.only,):
        spec = SpeculativeConfig("ngram", k, max_batch=10_000) if k else None
        cfg = engine_config(
            model,
            max_model_len=args.context + args.steps * (k + 1) + 64,
            max_num_seqs=max(args.batch, 8),
            gpu_memory_utilization=0.3,
            kv_host_gb=0,
            speculative=spec,
        )
        core = EngineCore(cfg)
        if k:
            assert core.spec is not None
            core.spec.host = AlwaysDraft()
        if args.replay_costs:
            out.setdefault("replay", {})[k] = replay_costs(core)
        case = profile_case(core, args, k)
        ms = case["step_ms"]
        print(f"\n=== k={k}: step {ms['period']:.3f} ms, host {ms['host']:.3f} ms: {ms}")
        print(case["profile"])
        out["cases"].append(case)
        core.close()
        del core
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
