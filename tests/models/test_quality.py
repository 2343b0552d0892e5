"""benchmarks/quality.py's ground, checked quickly: the text it scores is what
scripts/make_quality_text.py makes, and SmolLM2's perplexity on a few hundred of its tokens through
ember (prompt logprobs, a chunked prefill) equals transformers' within 0.1% in float32."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "benchmarks" / "data" / "stdlib_docstrings.txt"
NUM_TOKENS = 384


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the text is Python 3.11's docstrings")
def test_the_shipped_text_is_what_the_script_makes(tmp_path: Path) -> None:
    out = tmp_path / "text.txt"
    script = ROOT / "scripts" / "make_quality_text.py"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True, timeout=120)
    assert out.read_bytes() == TEXT.read_bytes()
    assert len(TEXT.read_text(encoding="utf-8").splitlines()) == 3000


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def test_smollm2_perplexity_equals_transformers(smollm2: Path) -> None:
    text = TEXT.read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(smollm2)(text, add_special_tokens=False)["input_ids"]
    ids = ids[:NUM_TOKENS]

    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    with torch.inference_mode():
        x = torch.tensor([ids])
        ref = hf(x).logits[0, :-1].float().log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
    del hf

    llm = LLM(str(smollm2), dtype="float32", max_model_len=512, max_num_batched_tokens=128)
    out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    scored = out.prompt_logprobs
    assert scored is not None and scored[0] is None and len(scored) == NUM_TOKENS
    got = [step[tok].logprob for tok, step in zip(ids[1:], scored[1:], strict=True)]

    assert max(abs(a - b) for a, b in zip(got, ref.tolist(), strict=True)) < 1e-3
    ppl, want = perplexity(got), perplexity(ref.tolist())
    assert 2.0 < want < 100.0  # the real weights, on English and code: not a random model
    assert abs(ppl - want) / want <= 1e-3
