"""ember against Hugging Face transformers on the same tiny checkpoints, in fp32.

Logits of the prefill and of every decode step must match within 1e-4, also when the prompt is
chunked over several steps and when a second request starts from the prefix cache; greedy output
must be token-identical to `generate`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember import LLM, SamplingParams
from ember.models.tiny import make_tiny
from tests.capture import captured_logits
from tests.models.hf_reference import hf_greedy, hf_logits

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
ATOL = 1e-4
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    dirs = {a: tiny_model_dir(a) for a in ARCHS}
    scaled = tmp_path_factory.mktemp("llama3-rope")
    dirs["llama_rope_scaled"] = make_tiny(
        scaled,
        "llama",
        seed=3,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return dirs


def hf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (length,), generator=g).tolist()


def check_steps(steps: list[torch.Tensor], ref: torch.Tensor, prompt_len: int, row: int = 0):
    """Step j's logits (row `row`) against the reference at position prompt_len - 1 + j."""
    assert len(steps) == NEW_TOKENS
    for j, logits in enumerate(steps):
        got, want = logits[row], ref[prompt_len - 1 + j]
        err = (got - want).abs().max().item()
        assert err <= ATOL, f"step {j}: max |logit diff| {err:.2e} > {ATOL}"


@pytest.mark.parametrize("arch", ARCHS + ["llama_rope_scaled"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_logits_match_transformers_every_step(model_dirs, arch: str, chunk: int | None) -> None:
    path = model_dirs[arch]
    hf = hf_model(path)
    vocab = hf.config.vocab_size
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=chunk,
    )
    with captured_logits(llm) as steps:
        prompt = random_prompt(1, 45 if arch != "llama_rope_scaled" else 150, vocab)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate(prompt, params)[0]
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)
        check_steps(steps, hf_logits(hf, prompt + tokens), len(prompt))

        # A second request sharing a long prefix starts from the cache and still matches.
        steps.clear()
        prompt2 = prompt[:33] + random_prompt(2, 9, vocab)
        out2 = llm.generate(prompt2, params)[0]
        assert out2.num_cached_tokens == 32  # eight full blocks of four
        tokens2 = out2.outputs[0].token_ids
        assert tokens2 == hf_greedy(hf, prompt2, NEW_TOKENS)
        check_steps(steps, hf_logits(hf, prompt2 + tokens2), len(prompt2))

        # Same blocks after a different first block: the hash chain must not match them.
        steps.clear()
        prompt3 = random_prompt(3, 4, vocab) + prompt[4:33] + random_prompt(4, 5, vocab)
        out3 = llm.generate(prompt3, params)[0]
        assert out3.num_cached_tokens == 0
        tokens3 = out3.outputs[0].token_ids
        check_steps(steps, hf_logits(hf, prompt3 + tokens3), len(prompt3))
        # Run again: its own blocks hit, never the first request's equal-content ones.
        steps.clear()
        out3b = llm.generate(prompt3, params)[0]
        assert out3b.num_cached_tokens == 36 and out3b.outputs[0].token_ids == tokens3
        check_steps(steps, hf_logits(hf, prompt3 + tokens3), len(prompt3))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_is_token_identical_to_generate(model_dirs, arch: str) -> None:
    path = model_dirs[arch]
    hf = hf_model(path)
    prompts = [random_prompt(10 + i, n, hf.config.vocab_size) for i, n in enumerate([3, 17, 40, 9])]
    llm = LLM(str(path), dtype="float32", block_size=8, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
        assert out.outputs[0].finish_reason == "length"


def test_text_prompt_and_chat_use_the_tokenizer(model_dirs) -> None:
    path = model_dirs["qwen3"]
    llm = LLM(str(path), dtype="float32")
    hf = hf_model(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    out = llm.generate(
        "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    )[0]
    assert out.prompt_token_ids == tok("def fibonacci(n):")["input_ids"]
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, 5)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    msgs = [{"role": "user", "content": "hello"}]
    chat = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert (
        chat.prompt_token_ids
        == tok.apply_chat_template(
            msgs, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
