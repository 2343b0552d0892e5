"""ember's GGUF import checked against transformers: logits every step, tokenizer, chat template.

Shared by the GGUF model tests and the GGUF tokenizer tests.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from functools import cached_property
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ember import LLM, SamplingParams
from ember.models.gguf import import_gguf
from ember.tokenizer.tokenizer import Tokenizer
from tests.capture import captured_logits
from tests.models.hf_reference import hf_greedy, hf_logits

ATOL = 1e-4
NEW_TOKENS = 6
QUESTION = "What is the capital of France?"


class Imported:
    """A GGUF, its ember import, and transformers' model and tokenizer loaded from the GGUF."""

    def __init__(self, gguf_file: Path, out_dir: Path) -> None:
        self.gguf_file = gguf_file
        self.dir = import_gguf(gguf_file, out_dir, "float32")
        self.hf_tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)

    @cached_property
    def hf(self) -> PreTrainedModel:
        """Loaded on first use: transformers cannot load every GGUF ember can (see test_gguf)."""
        return AutoModelForCausalLM.from_pretrained(
            self.gguf_file.parent, dtype=torch.float32, gguf_file=self.gguf_file.name
        ).eval()


def check_logits_every_step(model_dir: Path, hf: PreTrainedModel, prompt: list[int]) -> None:
    """ember's greedy tokens equal `hf`'s, and its logits at every step are within ATOL."""
    llm = LLM(str(model_dir), dtype="float32", block_size=8, max_model_len=512)
    with captured_logits(llm) as steps:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
    assert tokens == hf_greedy(hf, prompt, NEW_TOKENS)
    ref = hf_logits(hf, prompt + tokens)
    assert len(steps) == NEW_TOKENS
    for j, logits in enumerate(steps):
        err = (logits[0] - ref[len(prompt) - 1 + j]).abs().max().item()
        assert err <= ATOL, f"step {j}: max |logit diff| {err:.2e} > {ATOL}"


def random_prompt(vocab_size: int, length: int = 45) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(10, vocab_size, (length,), generator=g).tolist()


def mixed_lines() -> list[str]:
    """A few thousand lines: Python source (with its docstrings' prose), unicode, emoji, whitespace
    runs, special tokens."""
    import argparse
    import email.message
    import http.client
    import pathlib

    sources = (textwrap, json.encoder, argparse, pathlib, http.client, email.message, inspect)
    code = "".join(inspect.getsource(m) for m in sources)
    lines = [line for line in code.splitlines() if line.strip()][:3000]
    lines += [
        "Hello, world! How's it going? I'm fine; we'll see. They'd've",
        "Ünïcödé façade naïve coöperate — “quotes” ‘single’ … ½ ¼ € £ ¥",
        "日本語のテキストと中文文本，한국어 텍스트。Привет, мир! Γειά σου κόσμε",
        "العربية עברית हिन्दी ไทย tiếng Việt",
        "emoji 😀😃😄 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ✅❌ 🤖🧠",
        "tabs\tand\t\tmore\t\t\ttabs",
        "    four spaces, then        eight, then trailing   ",
        "\n\n\nnewlines\r\nwindows\rmac\n",
        "   ",
        "",
        "numbers 1234567890 3.14159 -42 1e-5 0xdeadbeef 1_000_000",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|> mid <|im_end|>text<think>reasoning</think>",
        "<s>[INST] hi [/INST] <unk></s>",
        "URL https://example.com/path?q=1&r=2#frag mail@example.org",
        "zero\u200bwidth\u200cjoiner\u200d and nbsp\u00a0here",
        "combining e\u0301 a\u0308 vs precomposed é ä",
        "def f(x):\n    return {'a': [1, 2, 3], \"b\": (4, 5)}\n\n\n# comment",
        "x" * 300,
        " ".join(["repeat"] * 50),
    ]
    return lines


def check_tokenizer(model_dir: Path, hf_tok: PreTrainedTokenizerBase) -> None:
    """Encode, decode and the chat template of ember's import equal those of `hf_tok`."""
    tok = Tokenizer.from_dir(model_dir)
    lines = mixed_lines()
    for line in lines + ["\n".join(lines)]:
        want = hf_tok(line)["input_ids"]
        assert tok.encode(line) == want, f"encode differs on {line[:60]!r}"
        assert tok.decode(want) == hf_tok.decode(want, skip_special_tokens=True)
    conversations = [
        [{"role": "user", "content": QUESTION}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello! 👋"},
            {"role": "user", "content": "Name three colours."},
        ],
    ]
    for msgs in conversations:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert tok.eos_token_ids >= {hf_tok.eos_token_id}
