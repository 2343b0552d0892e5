"""Tests for the batched sampler: greedy, seeding, truncation, penalties, blocking, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from ember.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    _apply_penalties,
    make_generator,
)
from ember.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda]),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def build(
    params: list[SamplingParams],
    vocab_size: int,
    device: str,
    prompt: list[list[int]] | None = None,
    output: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    blocked: list[list[int]] | None = None,
) -> SamplingBatch:
    empty = [[] for _ in params]
    return SamplingBatch.build(
        params,
        prompt or empty,
        output or empty,
        generators or [None] * len(params),
        blocked or empty,
        vocab_size,
        device,
    )


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs) -> SamplerOutput:
    batch = build(params, logits.shape[1], str(logits.device), **kwargs)
    return Sampler()(logits, batch)


def repeat_rows(values: list[float], rows: int, device: str) -> torch.Tensor:
    return torch.tensor(values, device=device).repeat(rows, 1)


def test_greedy_is_argmax(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50, device=device)
    batch = build([SamplingParams(temperature=0.0)] * 8, 50, device)
    assert batch.all_greedy and not batch.all_random
    out = Sampler()(logits, batch)
    assert out.sampled.dtype == torch.int64
    assert torch.equal(out.sampled, logits.argmax(-1))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_top_k_one_is_greedy_at_any_temperature(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 40, device=device)
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.0)] * 3
    for _ in range(20):
        out = sample(logits, params)
        assert torch.equal(out.sampled[0::2], logits[0::2].argmax(-1))


def test_mixed_batch_takes_argmax_only_for_greedy_rows(device: str) -> None:
    torch.manual_seed(2)
    logits = torch.zeros(400, 8, device=device)  # uniform: random rows spread out
    logits[:, 3] = 0.01  # greedy rows must pick 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 200
    sampled = sample(logits, params).sampled
    assert torch.all(sampled[0::2] == 3)
    assert len(set(sampled[1::2].tolist())) > 4


def seeded_tokens(seed: int, steps: int, device: str, neighbours: bool) -> list[int]:
    """Samples of one seeded row over several steps, alone or in a mixed batch."""
    logits_rng = torch.Generator().manual_seed(123)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=seed)
    generator = make_generator(seed, device)
    tokens = []
    for _ in range(steps):
        row = torch.randn(1, 64, generator=logits_rng).to(device)
        if not neighbours:
            tokens.append(sample(row, [params], generators=[generator]).sampled.item())
            continue
        others = torch.randn(3, 64).to(device)
        logits = torch.cat([others[:2], row, others[2:]])
        batch_params = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
            params,
            SamplingParams(temperature=0.7, seed=99),
        ]
        gens = [None, None, generator, make_generator(99, device)]
        tokens.append(sample(logits, batch_params, generators=gens).sampled[2].item())
    return tokens


def test_seeded_row_does_not_depend_on_its_batch(device: str) -> None:
    torch.manual_seed(3)
    alone = seeded_tokens(7, 30, device, neighbours=False)
    assert seeded_tokens(7, 30, device, neighbours=False) == alone  # fresh generator, same seed
    torch.manual_seed(4)  # the shared unseeded draw differs too
    assert seeded_tokens(7, 30, device, neighbours=True) == alone


def test_different_seeds_differ(device: str) -> None:
    assert seeded_tokens(1, 30, device, neighbours=False) != seeded_tokens(
        2, 30, device, neighbours=False
    )


def test_greedy_rows_do_not_keep_generators(device: str) -> None:
    params = [SamplingParams(temperature=0.0, seed=1), SamplingParams(seed=2)]
    gens = [make_generator(1, device), make_generator(2, device)]
    batch = build(params, 10, device, generators=gens)
    assert batch.generators == [None, gens[1]]


# probs 0.5, 0.3, 0.15, 0.05 then a long tail of near-zero tokens
KNOWN = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)] + [-30.0] * 12


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.7}, {0, 1}),  # 0.5 < 0.7 <= 0.8
        ({"top_p": 0.9}, {0, 1, 2}),  # 0.8 < 0.9 <= 0.95
        ({"min_p": 0.35}, {0, 1}),  # keep p >= 0.175
        ({"min_p": 0.2}, {0, 1, 2}),  # keep p >= 0.1
        ({"min_p": 0.05}, {0, 1, 2, 3}),  # keep p >= 0.025
        ({"top_k": 3, "top_p": 0.7}, {0, 1}),
        ({"top_k": 2, "min_p": 0.01}, {0, 1}),
    ],
)
def test_truncation_never_samples_outside_allowed_set(
    device: str, kwargs: dict, allowed: set[int]
) -> None:
    torch.manual_seed(5)
    logits = repeat_rows(KNOWN, 4000, device)
    sampled = sample(logits, [SamplingParams(**kwargs)] * 4000).sampled
    assert set(sampled.tolist()) == allowed


def test_truncation_is_per_row(device: str) -> None:
    torch.manual_seed(6)
    settings = [({"top_k": 1 + i % 3}, set(range(1 + i % 3))) for i in range(3)]
    settings.append(({"top_p": 1.0}, set(range(len(KNOWN)))))
    params = [SamplingParams(temperature=1.0, **kw) for kw, _ in settings] * 1000
    sampled = sample(repeat_rows(KNOWN, len(params), device), params).sampled.view(1000, 4)
    for col, (_, allowed) in enumerate(settings[:3]):
        assert set(sampled[:, col].tolist()) == allowed
    assert set(sampled[:, 3].tolist()) <= set(range(len(KNOWN)))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(device: str, temperature: float) -> None:
    torch.manual_seed(7)
    values = [1.0, 0.5, 0.0, -0.5, -1.0]
    draws = 20000
    sampled = sample(
        repeat_rows(values, draws, device), [SamplingParams(temperature=temperature)] * draws
    )
    counts = torch.bincount(sampled.sampled.cpu(), minlength=5).double()
    expected = torch.softmax(torch.tensor(values, dtype=torch.float64) / temperature, -1) * draws
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 25.0  # 4 degrees of freedom: p < 1e-4 under the null


def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)]
    batch = build(params, 5, "cpu", prompt=[[0, 1]], output=[[2, 2, 3]])
    assert batch.output_token_counts.tolist() == [[0, 0, 2, 1, 0]]
    assert batch.prompt_token_mask.tolist() == [[True, True, False, False, False]]
    # repetition: 2/2, -1*2, 0.5/2, 1/2, untouched -2
    # then minus 0.25*count and 0.5 if generated: token 2: 0.25-0.5-0.5, token 3: 0.5-0.25-0.5
    expected = torch.tensor([[1.0, -2.0, -0.75, -0.25, -2.0]])
    assert torch.allclose(_apply_penalties(logits, batch), expected)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"repetition_penalty": 1.25}, [1.6, -1.25, 0.4, 0.8, -2.0]),
        ({"presence_penalty": -1.0}, [2.0, -1.0, 1.5, 2.0, -2.0]),
        ({"frequency_penalty": 1.0}, [2.0, -1.0, -1.5, 0.0, -2.0]),
    ],
)
def test_each_penalty_alone(kwargs: dict, expected: list[float]) -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0]])
    batch = build([SamplingParams(**kwargs)], 5, "cpu", prompt=[[0, 1]], output=[[2, 2, 3]])
    assert (batch.prompt_token_mask is None) == ("repetition_penalty" not in kwargs)
    assert torch.allclose(_apply_penalties(logits, batch), torch.tensor([expected]))


def test_no_penalties_skips_the_count_tensors() -> None:
    batch = build([SamplingParams()], 5, "cpu", prompt=[[0]], output=[[1]])
    assert batch.no_penalties
    assert batch.output_token_counts is None and batch.prompt_token_mask is None


def test_penalty_changes_greedy_choice(device: str) -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]], device=device)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0)]
    assert sample(logits, params, output=[[0]]).sampled.item() == 1
    assert sample(logits, params, output=[[1]]).sampled.item() == 0


def test_blocked_ids_are_never_sampled(device: str) -> None:
    torch.manual_seed(8)
    logits = repeat_rows(KNOWN, 2000, device)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 1000
    blocked = [[0], [0, 1]] * 1000
    sampled = sample(logits, params, blocked=blocked).sampled
    assert torch.all(sampled[0::2] == 1)
    assert set(sampled[1::2].tolist()) == {2, 3}


def test_blocking_does_not_modify_callers_logits(device: str) -> None:
    logits = torch.randn(2, 10, device=device)
    before = logits.clone()
    sample(logits, [SamplingParams(temperature=0.0)] * 2, blocked=[[1, 2], [3]])
    assert torch.equal(logits, before)


def test_logprobs_are_raw_log_softmax_with_top_k_and_ranks(device: str) -> None:
    torch.manual_seed(9)
    logits = torch.randn(5, 30, device=device)
    params = [
        SamplingParams(temperature=1.3, logprobs=3, presence_penalty=1.0),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.8, top_k=10),
        SamplingParams(temperature=1.0, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, logprobs=1, min_p=0.1),
    ]
    output = [[1, 2], [], [4], [5, 5], []]
    out = sample(logits, params, output=output, blocked=[[0], [], [], [], [7]])
    ref = torch.log_softmax(logits.float(), -1)  # before penalties, blocking and temperature
    top_lp, top_ids = ref.topk(3, dim=-1)
    assert out.logprobs.shape == (5, 4) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    assert torch.allclose(out.logprobs[:, 0], ref.gather(1, out.sampled.unsqueeze(1)).squeeze(1))
    assert torch.allclose(out.logprobs[:, 1:], top_lp)
    order = ref.argsort(-1, descending=True)
    expected_ranks = (order == out.sampled.unsqueeze(1)).int().argmax(-1) + 1
    assert torch.equal(out.sampled_ranks, expected_ranks)
    assert out.sampled_ranks[1].item() == 1  # greedy without penalties picks the top token


def test_logprobs_zero_returns_only_the_sampled_token(device: str) -> None:
    logits = torch.randn(3, 12, device=device)
    out = sample(logits, [SamplingParams(logprobs=0)] * 3)
    assert out.logprobs.shape == (3, 1) and out.logprob_token_ids.shape == (3, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(10)
    logits = torch.randn(4, 64, device=device).to(dtype)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=5),
        SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.1),
        SamplingParams(temperature=1.0),
    ]
    gens = [None, make_generator(5, device), None, None]
    out = sample(
        logits, params, output=[[], [], [3], []], generators=gens, blocked=[[], [1], [], []]
    )
    assert out.sampled[0].item() == logits[0].float().argmax().item()
    assert torch.all((out.sampled >= 0) & (out.sampled < 64))
    assert out.logprobs.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(out.logprobs[:, 0], ref.gather(1, out.sampled.unsqueeze(1)).squeeze(1))


def test_empty_batch(device: str) -> None:
    out = sample(torch.empty(0, 10, device=device), [])
    assert out.sampled.shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"prompt": [[0]]}, "prompt_ids"),
        ({"output": [[0]]}, "output_ids"),
        ({"generators": [None]}, "generators"),
        ({"blocked": [[0]]}, "blocked"),
    ],
)
def test_build_rejects_row_count_mismatch(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        build([SamplingParams(), SamplingParams()], 10, "cpu", **kwargs)


@pytest.mark.parametrize(
    ("params", "kwargs", "name"),
    [
        (SamplingParams(repetition_penalty=1.1), {"prompt": [[10]]}, "prompt_ids"),
        (SamplingParams(presence_penalty=0.5), {"output": [[-1]]}, "output_ids"),
        (SamplingParams(), {"blocked": [[12]]}, "blocked"),
    ],
)
def test_build_rejects_out_of_vocab_ids(params: SamplingParams, kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        build([params], 10, "cpu", **kwargs)


def test_build_rejects_logprobs_above_vocab_size() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        build([SamplingParams(logprobs=11)], 10, "cpu")


def test_build_flags() -> None:
    batch = build([SamplingParams(temperature=0.0, top_p=0.5), SamplingParams()], 10, "cpu")
    assert not batch.all_greedy and not batch.all_random
    assert batch.no_penalties and batch.no_top_p_top_k_min_p  # greedy rows' top_p is moot
    assert batch.max_num_logprobs is None
    assert batch.temperature.tolist() == [0.0, 1.0]
    batch = build([SamplingParams(top_k=4, logprobs=2), SamplingParams(logprobs=5)], 10, "cpu")
    assert batch.all_random and not batch.no_top_p_top_k_min_p
    assert batch.max_num_logprobs == 5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_no_host_sync_on_cuda() -> None:
    logits = torch.randn(4, 1000, device="cuda", dtype=torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, seed=3),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5),
        SamplingParams(temperature=1.2),
    ]
    gens = [None, make_generator(3, "cuda"), None, None]
    prompt, output, blocked = [[1, 2]] * 4, [[3], [], [4, 4], []], [[0], [], [], [9]]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch.build(params, prompt, output, gens, blocked, 1000, "cuda")
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled.device.type == "cuda" and out.logprobs.shape == (4, 6)
