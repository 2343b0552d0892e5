"""EAGLE-3 with a host proposer beside it (`SpeculativeConfig(..., hybrid="suffix")`,
`--speculative-hybrid`): each step each request verifies the drafts expected to have more tokens
stand, the host proposer's estimate against the head's measured mean. The choice, its settings,
and in the engine: greedy output equals no speculation whichever drafts a step verifies, and on
text that repeats the host proposer's drafts are taken for some steps and the head's for others."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ember import LLM, SamplingParams
from ember.cli import build_parser
from ember.engine.speculation import Speculator
from ember.server.args import speculative_config_from_args
from ember.spec_decode.config import SpeculativeConfig
from ember.spec_decode.proposer import HostProposer
from tests.spec_decode.test_eagle3 import write_head

K = 4


class _Fixed(HostProposer):
    """Drafts and an expectation set by the test."""

    def __init__(self, drafts: list[int], expected: float | None) -> None:
        self.drafts, self.expected = drafts, expected

    def add_request(self, request_id: str, prompt: Sequence[int], scope: str | None) -> None:
        pass

    def propose(self, request_id: str, tokens: Sequence[int], max_tokens: int) -> list[int]:
        return self.drafts

    def finish(self, request_id: str, output: Sequence[int]) -> None:
        pass

    def expected_accepted(self, request_id: str) -> float | None:
        return self.expected


def _speculator(hybrid: str = "suffix") -> Speculator:
    config = SpeculativeConfig("eagle3", K, draft_model="head", hybrid=hybrid)
    return Speculator(config, measure=False)


def _request(head_drafts: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", spec_token_ids=head_drafts)


def test_the_host_proposer_wins_when_it_expects_more_to_stand() -> None:
    spec = _speculator()
    assert spec.hybrid and spec.host is not None
    spec.host = _Fixed([1, 2, 3], 3.0)
    head = [7, 7, 7, 7]
    # The head unmeasured: its prior is half of K (2 tokens) a draft.
    assert spec.choose_host(_request(head), [1, 2, 3])
    spec.host.expected = 1.5
    assert not spec.choose_host(_request(head), [1, 2, 3])
    # Measured, the head keeps 3.5 of 4: a host estimate of 3 loses, 3.9 wins.
    spec.head_drafts, spec.head_accepted_tokens = 16, 56
    spec.host.expected = 3.0
    assert not spec.choose_host(_request(head), [1, 2, 3])
    spec.host.expected = 3.9
    assert spec.choose_host(_request(head), [1, 2, 3, 4])
    # No host drafts: the head's; no head drafts: the host's.
    assert not spec.choose_host(_request(head), [])
    assert spec.choose_host(_request([]), [1])


def test_a_host_proposer_without_an_estimate_is_judged_by_its_measured_rate() -> None:
    spec = _speculator("ngram")
    spec.host = _Fixed([1, 2, 3, 4], None)
    head = [7, 7, 7, 7]
    assert not spec.choose_host(_request(head), [1, 2, 3, 4])  # prior 0.5 x 4 = 2, not > 2
    spec.host_draft_tokens, spec.host_accepted_tokens = 40, 36  # 0.9 of its tokens stand
    assert spec.choose_host(_request(head), [1, 2, 3, 4])  # 3.6 > 2


def test_hybrid_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="goes beside eagle3"):
        SpeculativeConfig("suffix", hybrid="ngram")
    with pytest.raises(ValueError, match="goes beside eagle3"):
        SpeculativeConfig("eagle3", draft_model="head", hybrid="eagle3")
    args = build_parser().parse_args(
        ["serve", "m", "--speculative", "eagle3", "--draft-model", str(tmp_path)]
        + ["--speculative-hybrid", "suffix"]
    )
    config = speculative_config_from_args(args)
    assert config is not None and config.hybrid == "suffix"
    args = build_parser().parse_args(["serve", "m", "--speculative-hybrid", "ngram"])
    with pytest.raises(ValueError, match="--speculative-hybrid needs --speculative"):
        speculative_config_from_args(args)


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def head(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("eagle3-head"), llama)


def test_hybrid_greedy_equals_no_speculation_and_takes_both(llama: Path, head: Path) -> None:
    g = torch.Generator().manual_seed(5)
    # Prompts that repeat a run (the suffix trees find it) and prompts of fresh random tokens.
    runs = [torch.randint(10, 3000, (12,), generator=g).tolist() for _ in range(2)]
    prompts = [r * 4 for r in runs] + [torch.randint(10, 3000, (20,), generator=g).tolist()]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [
        o.outputs[0].token_ids for o in LLM(str(llama), dtype="float32").generate(prompts, params)
    ]
    spec = SpeculativeConfig("eagle3", K, draft_model=str(head), hybrid="suffix")
    llm = LLM(str(llama), dtype="float32", speculative=spec)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        speculator = llm.engine.core.spec
        assert speculator is not None
        assert got == want
        assert speculator.host_chosen > 0 and speculator.head_drafts > 0
        assert speculator.host_draft_tokens > 0
        core = llm.engine.core
        assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    finally:
        llm.close()
