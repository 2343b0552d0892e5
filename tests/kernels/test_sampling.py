"""The fused sampler (ember.kernels.sampling) against softmax(logits / T): frequencies, chunking,
seeds, the rows it is used for, and the inputs it refuses. Interpreter on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from ember.engine.sampler import Sampler, SamplingBatch, fused_race
from ember.kernels import sampling
from ember.kernels.sampling import gumbel_sample
from ember.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def small_chunks(monkeypatch, device: str) -> None:
    """Chunks of 64 columns, one block each, on the CPU (the interpreter's cost is per program
    and block): many chunks a row cheaply."""
    if device == "cpu":
        monkeypatch.setattr(sampling, "BLOCK", 64)
        monkeypatch.setattr(sampling, "CHUNK", 64)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_match_softmax_across_chunks(
    device: str, small_chunks: None, temperature: float
) -> None:
    torch.manual_seed(int(temperature * 10))
    vocab = 3 * sampling.CHUNK + 37  # four chunks, the last one short
    # Six live tokens spread over the chunks, the rest far below them (and one -inf).
    live = torch.tensor([3, sampling.CHUNK - 1, sampling.CHUNK + 5, 2 * sampling.CHUNK, vocab - 1])
    row = torch.full((vocab,), -30.0)
    row[live] = torch.randn(len(live)) * 1.5
    row[7] = float("-inf")
    rows = 400 if device == "cpu" else 20000
    logits = row.expand(rows, vocab).contiguous().to(device)
    temps = torch.full((rows,), temperature, device=device)
    out = gumbel_sample(logits, temps, seed=1234).cpu()
    assert out.shape == (rows,) and out.dtype == torch.int64
    freq = torch.bincount(out, minlength=vocab).float() / rows
    expected = torch.softmax(row / temperature, -1)
    assert freq[7] == 0
    tol = 4.5 * (expected * (1 - expected) / rows).sqrt() + 2e-3  # ~4.5 sigma a token
    assert ((freq - expected).abs() <= tol).all(), (freq[live], expected[live])


def test_a_seed_draws_the_same_tokens_and_another_seed_others(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 500, device=device)
    temps = torch.ones(16, device=device)
    a = gumbel_sample(logits, temps, seed=7)
    assert torch.equal(a, gumbel_sample(logits, temps, seed=7))
    assert (a != gumbel_sample(logits, temps, seed=8)).float().mean() > 0.5
    assert ((a >= 0) & (a < 500)).all()


def test_a_near_zero_temperature_takes_the_argmax_in_any_chunk(
    device: str, small_chunks: None
) -> None:
    torch.manual_seed(2)
    vocab = 5 * sampling.CHUNK + 3
    logits = torch.randn(6, vocab, device=device)
    top = torch.tensor(
        [0, sampling.CHUNK, 2 * sampling.CHUNK + 9, 4 * sampling.CHUNK, vocab - 1, 77]
    )
    logits[torch.arange(6), top.to(device)] = 50.0
    out = gumbel_sample(logits, torch.full((6,), 1e-3, device=device), seed=3)
    assert out.cpu().tolist() == top.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_are_read_as_they_are(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    logits = torch.randn(8, 300, device=device).to(dtype)
    logits[:, 42] = 40.0
    out = gumbel_sample(logits, torch.full((8,), 0.01, device=device), seed=5)
    assert (out == 42).all()


def test_inputs_it_refuses_and_an_empty_batch(device: str) -> None:
    logits = torch.randn(4, 100, device=device)
    with pytest.raises(ValueError, match="contiguous rows"):
        gumbel_sample(logits.t(), torch.ones(100, device=device), 0)
    with pytest.raises(ValueError, match="temperature"):
        gumbel_sample(logits, torch.ones(3, device=device), 0)
    with pytest.raises(ValueError, match="temperature"):
        gumbel_sample(logits, torch.ones(4, device=device, dtype=torch.float64), 0)
    empty = gumbel_sample(logits[:0], torch.ones(0, device=device), 0)
    assert empty.shape == (0,)


def _batch(params: list[SamplingParams], device: str, generators=None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params=params,
        prompt_ids=[[1]] * n,
        output_ids=[[]] * n,
        generators=generators or [None] * n,
        blocked=[[]] * n,
        vocab_size=50,
        device=device,
    )


def test_the_fused_path_takes_only_plain_rows_on_a_gpu(device: str) -> None:
    plain = SamplingParams(temperature=0.7)
    logits = torch.zeros(2, 50, device=device)
    for params, generators in (
        ([plain, SamplingParams(temperature=0.0)], None),  # a greedy row
        ([plain, SamplingParams(temperature=0.7, top_k=5)], None),
        ([plain, SamplingParams(temperature=0.7, top_p=0.9)], None),
        ([plain, SamplingParams(temperature=0.7, presence_penalty=0.5)], None),
        ([plain, SamplingParams(temperature=0.7, logprobs=2)], None),
        ([plain, plain], [None, torch.Generator().manual_seed(3)]),  # a seeded row
    ):
        assert not fused_race(logits, _batch(params, device, generators))
    assert not fused_race(logits.t(), _batch([plain, plain], device))  # rows not contiguous
    assert fused_race(logits, _batch([plain, plain], device)) == (device == "cuda")


@needs_cuda
@pytest.mark.gpu
def test_the_sampler_on_a_gpu_matches_softmax_at_the_llama_vocabulary() -> None:
    """Sampler() end to end on bf16 logits of 128,256 columns (the fused path), against
    softmax(logits / T) on the likeliest tokens, many rows a step, several steps."""
    torch.manual_seed(11)
    vocab, rows, steps, temperature = 128256, 256, 16, 0.8
    row = torch.randn(vocab, device="cuda") * 2.5
    logits = row.to(torch.bfloat16).expand(rows, vocab).contiguous()
    batch = _batch([SamplingParams(temperature=temperature)] * rows, "cuda")
    assert fused_race(logits, batch)
    sampler = Sampler()
    out = torch.cat([sampler(logits, batch).sampled for _ in range(steps)]).cpu()
    n = rows * steps
    expected = torch.softmax(row.to(torch.bfloat16).float() / temperature, -1).cpu()
    freq = torch.bincount(out, minlength=vocab).float() / n
    top = expected.topk(20).indices
    tol = 4.5 * (expected[top] * (1 - expected[top]) / n).sqrt() + 1e-3
    assert ((freq[top] - expected[top]).abs() <= tol).all()
    assert freq.sum() == 1 and ((out >= 0) & (out < vocab)).all()
