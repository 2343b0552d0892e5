"""Tests for SamplingParams: defaults, normalization, validation, greedy and clone."""

from __future__ import annotations

import pytest

from ember.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output


def test_normalizes_stop_stop_token_ids_and_top_k() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("n", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 2.01),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens=16
        ("logprobs", -1),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [2, -5]),
    ],
)
def test_invalid_value_raises_naming_parameter_and_value(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name) as info:
        SamplingParams(**{name: value})
    shown = "-5" if name == "stop_token_ids" else repr(value) if name == "stop" else str(value)
    assert shown in str(info.value)


def test_min_tokens_unbounded_when_max_tokens_is_none() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=1000).min_tokens == 1000


def test_boundary_values_are_accepted() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=2.0)
    SamplingParams(frequency_penalty=-2.0, repetition_penalty=1e-3, logprobs=0, max_tokens=1)


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 1e-6}, True),  # below the epsilon: treated as greedy
        ({"temperature": 1.5, "top_k": 1}, True),
        ({"temperature": 0.5}, False),
        ({"temperature": 1.0, "top_k": 2}, False),
    ],
)
def test_greedy(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


def test_clone_is_equal_and_owns_its_lists() -> None:
    p = SamplingParams(temperature=0.7, seed=3, stop=["x"], stop_token_ids=[5], logprobs=2)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(6)
    assert p.stop == ["x"] and p.stop_token_ids == [5]
