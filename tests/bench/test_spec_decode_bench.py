"""benchmarks/spec_decode.py's `--quick` path on the tiny llama (CPU): the baseline and n-gram
speculation run every prompt set and setting, greedy outputs agree, and the JSON holds the fields
the README's table is made from."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "spec_decode.py"
SETS = ("agentic", "code", "chat")
SETTINGS = ("greedy", "sampled")
K = 3


@pytest.fixture(scope="module")
def bench(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("spec_bench") / "spec.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--model",
        str(tiny_model_dir("llama")),
        "--quick",
        "--device",
        "cpu",
        "--batch-sizes",
        "2",
        "--proposers",
        f"ngram:{K}",
        "--verify-shape",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| set | batch | setting | proposer |" in done.stdout  # the table was printed
    return json.loads(out.read_text())


def rows(result: dict[str, Any], proposer: str) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["set"], r["setting"]): r for r in result["results"] if r["proposer"] == proposer}


def test_baseline_runs_every_set_and_setting(bench: dict[str, Any]) -> None:
    assert bench["gpu"].startswith("cpu-") and bench["dtype"] == "float32" and bench["quick"]
    assert bench["batch_sizes"] == [2] and set(bench["settings"]) == set(SETTINGS)
    assert bench["verify_shape"] == {"skipped": "GPU only"}
    assert bench["proposers"]["none"]["available"] is True
    for name in SETS:
        info = bench["prompt_sets"][name]
        assert info["prompts"] == 2 and 0 < info["mean_prompt_tokens"] <= info["max_prompt_tokens"]
    # The tiny model's template renders tools itself; the code prompt quotes a whole file.
    assert bench["prompt_sets"]["agentic"]["tools"] == "template"
    assert (
        bench["prompt_sets"]["code"]["mean_prompt_tokens"]
        > bench["prompt_sets"]["chat"]["mean_prompt_tokens"]
    )
    base = rows(bench, "none")
    assert set(base) == {(s, t) for s in SETS for t in SETTINGS}
    for r in base.values():
        assert r["batch"] == 2 and r["requests"] == 2 and r["rounds"] == 1
        assert 0 < r["output_tokens"] <= 2 * bench["max_tokens"][r["set"]]
        assert r["wall_s"] > 0 and r["tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["speedup"] == 1.0 and "greedy_match" not in r and r["errored_requests"] == 0
        assert "tokens" not in r  # the outputs are compared, not stored
        # The engine counts drafts (zero without a proposer), read as deltas over the run.
        assert r["drafts"] == 0 and r["mean_accepted_len"] is None
    # What the answers are, beside how fast they came.
    for name in SETS:
        answers = base[name, "greedy"]["answers"]
        assert isinstance(answers["sample"], str) and answers["sample"]
    assert 0 <= base["agentic", "greedy"]["answers"]["share_with_tool_call"] <= 1
    assert 0 <= base["code", "greedy"]["answers"]["share_with_code_block"] <= 1
    assert bench["failures"] == []


def test_ngram_matches_the_baseline_token_for_token(bench: dict[str, Any]) -> None:
    status = bench["proposers"][f"ngram:{K}"]
    assert status["method"] == "ngram" and status["k"] == K
    if not status["available"]:
        pytest.skip(f"the engine does not take speculative=ngram yet: {status['error']}")
    spec, base = rows(bench, f"ngram:{K}"), rows(bench, "none")
    assert set(spec) == set(base)
    for (name, setting), r in spec.items():
        assert r["speedup"] == pytest.approx(r["tok_s"] / base[name, setting]["tok_s"])
        assert r["errored_requests"] == 0 and r["output_tokens"] > 0
        assert r["drafts"] is not None and 0 <= r["accepted_tokens"] <= r["draft_tokens"]
        assert r["draft_tokens"] <= K * r["drafts"]
        if r["drafts"]:
            assert 1 <= r["mean_accepted_len"] <= K + 1
            assert sum(r["accepted_per_pos"]) == r["accepted_tokens"]
        if setting == "greedy":
            assert r["greedy_match"] is True and r["mismatched_requests"] == 0
        else:
            assert "greedy_match" not in r


def load_bench_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("spec_decode_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_a_mismatch_is_located_scored_and_told_from_a_tie(tiny_model_dir) -> None:
    """Each differing request's record names where it parts from the baseline and the baseline's
    top-2 logprob gap there; only the baseline's runner-up within TIE_GAP is a bf16 near tie."""
    from ember.entrypoints.llm import LLM
    from ember.sampling_params import SamplingParams

    sd = load_bench_module()
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=256, num_kv_blocks=64)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
    params = [SamplingParams(temperature=0.0, max_tokens=6)] * 2
    ref, _, errors = sd.generate(llm.engine, prompts, params, "ref")
    assert errors == 0 and [len(t) for t in ref] == [6, 6]
    assert sd.mismatches(llm.engine, prompts, ref, ref) == []
    # The baseline's best tokens at request 1's fourth position.
    scored = (
        llm.generate(
            [{"prompt_token_ids": prompts[1] + ref[1][:3]}],
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=sd.SCORED),
        )[0]
        .outputs[0]
        .logprobs[0]
    )
    top = sorted(scored, key=lambda t: -scored[t].logprob)
    best = scored[top[0]].logprob
    gap = best - scored[top[1]].logprob
    outsider = next(t for t in range(100) if t not in scored)
    cases = [(top[1], gap <= sd.TIE_GAP + 1e-6, gap)]
    if best - scored[top[-1]].logprob > sd.TIE_GAP:  # an unscored token is no near tie
        cases.append((outsider, False, None))
    for token, near, behind in cases:
        got = [ref[0], ref[1][:3] + [token] + ref[1][4:]]
        (m,) = sd.mismatches(llm.engine, prompts, ref, got)
        assert m["request"] == 1 and m["position"] == 3 and m["lengths"] == [6, 6]
        assert m["baseline_token"] == ref[1][3] == top[0] and m["spec_token"] == token
        assert m["spec_token_behind_best"] == (None if behind is None else pytest.approx(behind))
        assert m["baseline_top2_gap"] == pytest.approx(gap) and m["near_tie"] is near
