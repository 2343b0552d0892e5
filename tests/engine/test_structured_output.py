"""Grammar-constrained generation offline: the output parses, whatever the random model wants."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from llguidance import LLMatcher

from ember import LLM, SamplingParams
from ember.engine.structured_output import GrammarCompiler, apply_grammar_masks
from ember.models.config import ModelConfig
from ember.sampling_params import StructuredOutputsParams as SO

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "maximum": 99}},
    "required": ["color", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), max_model_len=512)


def gen(llm: LLM, so: SO, seed: int, **kw) -> str:
    params = SamplingParams(max_tokens=120, seed=seed, structured_outputs=so, **kw)
    out = llm.generate("hello", params)[0].outputs[0]
    assert out.finish_reason == "stop"
    return out.text


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(llm: LLM, seed: int) -> None:
    obj = json.loads(gen(llm, SO(json=json.dumps(SCHEMA)), seed))
    assert set(obj) == {"color", "n"} and obj["color"] in ("red", "green")
    assert isinstance(obj["n"], int) and obj["n"] <= 99


def test_regex_and_lark(llm: LLM) -> None:
    for seed in range(3):
        assert re.fullmatch(r"(yes|no) [0-9]{3}", gen(llm, SO(regex=r"(yes|no) [0-9]{3}"), seed))
        text = gen(llm, SO(lark='start: "call(" NAME ")"\nNAME: /[a-z]{1,8}/'), seed)
        assert re.fullmatch(r"call\([a-z]{1,8}\)", text)


def test_batch_mixes_constrained_and_free_rows(llm: LLM) -> None:
    free = SamplingParams(max_tokens=10, seed=1, ignore_eos=True)
    json_row = SamplingParams(
        max_tokens=120, seed=2, structured_outputs=SO(json=json.dumps(SCHEMA))
    )
    alone = llm.generate("hi", free)[0].outputs[0].token_ids
    outs = llm.generate(["hi", "hi"], [free, json_row])
    assert outs[0].outputs[0].token_ids == alone  # the mask touched only its own row
    json.loads(outs[1].outputs[0].text)


def test_preempted_request_keeps_its_grammar_state(tiny_model_dir) -> None:
    tight = LLM(str(tiny_model_dir("llama")), block_size=4, num_kv_blocks=12, max_model_len=48)
    so = SO(json=json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=30, seed=s, structured_outputs=so) for s in range(4)]
    outs = tight.generate([[5] * 12] * 4, params)
    for o in outs:
        json.loads(o.outputs[0].text)


def test_invalid_specs_raise(llm: LLM) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="invalid structured output spec"):
        llm.engine.core.grammar.matcher(SO(regex="(unclosed"))


def test_mask_matches_llguidance_logit_bias(tiny_model_dir) -> None:
    d: Path = tiny_model_dir("llama")
    compiler = GrammarCompiler.for_model(str(d), ModelConfig.from_dir(d))
    m = compiler.matcher(SO(json=json.dumps(SCHEMA)))
    for tok in compiler.tokenizer.tokenize_str('{"color":"re'):
        assert m.consume_token(tok)
    logits = torch.randn(2, compiler.vocab_size)
    masked = logits.clone()
    apply_grammar_masks(masked, [m, None])
    bias = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)[
        : compiler.vocab_size
    ]
    allowed = bias > 0
    assert allowed.any() and not allowed.all()
    assert torch.equal(torch.isfinite(masked[0]), allowed)
    assert torch.equal(masked[0][allowed], logits[0][allowed])
    assert torch.equal(masked[1], logits[1])
    assert isinstance(m, LLMatcher)
