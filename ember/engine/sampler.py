"""Batched token sampling on logits, following vLLM V1's sampler.

Runs unchanged on CPU and CUDA: no per-row Python work on the unseeded path and no host syncs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ember.sampling_params import SAMPLING_EPS, SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request; it must live on the device the logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass(slots=True)
class SamplingBatch:
    """Sampling state for the rows that sample this step, built once per step."""

    temperature: Tensor  # [B] float32; 0 marks a greedy row
    top_p: Tensor  # [B] float32
    top_k: Tensor  # [B] int64; 0 = off
    min_p: Tensor  # [B] float32
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    repetition_penalty: Tensor  # [B] float32
    generators: list[torch.Generator | None]  # None for unseeded and greedy rows
    all_greedy: bool
    all_random: bool
    no_penalties: bool
    no_top_p_top_k_min_p: bool
    output_token_counts: Tensor | None  # [B, V] int32; None if no penalties
    prompt_token_mask: Tensor | None  # [B, V] bool; None if no repetition penalty
    blocked_token_ids: list[list[int]]
    max_num_logprobs: int | None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        blocked: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatch:
        num_rows = len(params)
        for name, rows in (
            ("prompt_ids", prompt_ids),
            ("output_ids", output_ids),
            ("generators", generators),
            ("blocked", blocked),
        ):
            if len(rows) != num_rows:
                raise ValueError(f"{name} must have {num_rows} rows like params, got {len(rows)}.")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}.")

        greedy = [p.greedy for p in params]
        # One host-to-device copy for all float columns instead of six.
        floats = torch.tensor(
            [
                [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.repetition_penalty for p in params],
            ],
            dtype=torch.float32,
        ).reshape(6, num_rows)
        floats = _to_device(floats, device)
        temperature, top_p, min_p, presence, frequency, repetition = floats.unbind(0)
        top_k = _to_device(torch.tensor([p.top_k for p in params], dtype=torch.int64), device)

        no_repetition = all(p.repetition_penalty == 1.0 for p in params)
        no_penalties = no_repetition and all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params
        )
        counts = mask = None
        if not no_penalties:
            _check_token_ids(output_ids, vocab_size, "output_ids")
            flat = _to_device(_flat_index(output_ids, vocab_size), device)
            ones = torch.ones(flat.shape, dtype=torch.int32, device=device)
            counts = torch.zeros(num_rows * vocab_size, dtype=torch.int32, device=device)
            counts = counts.scatter_add_(0, flat, ones).view(num_rows, vocab_size)
        if not no_repetition:
            _check_token_ids(prompt_ids, vocab_size, "prompt_ids")
            flat = _to_device(_flat_index(prompt_ids, vocab_size), device)
            mask = torch.zeros(num_rows * vocab_size, dtype=torch.bool, device=device)
            mask = mask.index_fill_(0, flat, True).view(num_rows, vocab_size)

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(wanted) if wanted else None
        if max_num_logprobs is not None and max_num_logprobs > vocab_size:
            raise ValueError(
                f"logprobs must be at most vocab_size={vocab_size}, got {max_num_logprobs}."
            )
        _check_token_ids(blocked, vocab_size, "blocked")  # here, so the sampler need not

        return cls(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            # A greedy row never draws noise, so its generator state must not advance.
            generators=[None if g else gen for gen, g in zip(generators, greedy, strict=True)],
            all_greedy=all(greedy),
            all_random=not any(greedy),
            no_penalties=no_penalties,
            no_top_p_top_k_min_p=all(
                g or (p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0)
                for p, g in zip(params, greedy, strict=True)
            ),
            output_token_counts=counts,
            prompt_token_mask=mask,
            blocked_token_ids=blocked,
            max_num_logprobs=max_num_logprobs,
        )


@dataclass(slots=True)
class SamplerOutput:
    sampled: Tensor  # [B] int64
    logprobs: Tensor | None  # [B, 1 + k] float32: sampled token, then the top-k alternatives
    logprob_token_ids: Tensor | None  # [B, 1 + k] int64, same layout
    sampled_ranks: Tensor | None  # [B] int64; 1 = most likely


class Sampler:
    """Turns one step's logits into tokens: block, penalize, then greedy or random sampling."""

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        if fused_race(logits, batch):
            # One pass over the logits in their own dtype (ember.kernels.sampling); its noise is
            # seeded from torch's generator, so torch.manual_seed still fixes a run's tokens.
            from ember.kernels.sampling import gumbel_sample

            seed = int(torch.randint(2**31 - 1, (1,)))
            return SamplerOutput(gumbel_sample(logits, batch.temperature, seed), None, None, None)
        logits = logits.float()
        # vLLM's default "raw_logprobs": what the model said, before any processing.
        raw_logprobs = logits.log_softmax(-1) if batch.max_num_logprobs is not None else None
        if any(batch.blocked_token_ids):
            flat = _to_device(_flat_index(batch.blocked_token_ids, logits.shape[1]), logits.device)
            # Out of place: .float() returns the caller's tensor when it is already float32.
            logits = logits.view(-1).index_fill(0, flat, -math.inf).view_as(logits)
        if not batch.no_penalties:
            logits = _apply_penalties(logits, batch)
        sampled = self._sample(logits, batch)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        return _gather_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)

    def _sample(self, logits: Tensor, batch: SamplingBatch) -> Tensor:
        if batch.all_greedy:
            return logits.argmax(-1)
        greedy = None if batch.all_random else logits.argmax(-1)
        temperature = batch.temperature
        if not batch.all_random:
            temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        logits = logits / temperature.unsqueeze(1)
        if not batch.no_top_p_top_k_min_p:
            logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
            logits = _apply_min_p(logits, batch.min_p)
        sampled = _exponential_race(logits, batch.generators)
        if greedy is None:
            return sampled
        return torch.where(batch.temperature < SAMPLING_EPS, greedy, sampled)


def fused_race(logits: Tensor, batch: SamplingBatch) -> bool:
    """Every row samples plainly (a temperature and nothing else: no greedy row, penalty, top-k,
    top-p, min-p, blocked token, logprobs or seed of its own) and the logits are on a GPU: the
    fused kernel samples them."""
    return (
        logits.is_cuda
        and logits.dim() == 2
        and logits.stride(1) == 1
        and batch.all_random
        and batch.no_penalties
        and batch.no_top_p_top_k_min_p
        and batch.max_num_logprobs is None
        and not any(batch.blocked_token_ids)
        and all(g is None for g in batch.generators)
    )


def _to_device(host: Tensor, device: torch.device | str) -> Tensor:
    if torch.device(device).type == "cpu":
        return host
    # From pinned memory the copy is asynchronous; from pageable memory it would wait for the GPU.
    return host.pin_memory().to(device, non_blocking=True)


def _flat_index(rows: list[list[int]], vocab_size: int) -> Tensor:
    """Row-major indices into a flattened [len(rows), vocab_size] tensor, built on the host."""
    offsets = [i * vocab_size for i, ids in enumerate(rows) for _ in ids]
    token_ids = [t for ids in rows for t in ids]
    return torch.tensor(token_ids, dtype=torch.int64) + torch.tensor(offsets, dtype=torch.int64)


def _check_token_ids(rows: list[list[int]], vocab_size: int, name: str) -> None:
    bad = [t for ids in rows for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {vocab_size}).")


MAX_SCORED_LOGITS = 1 << 24
"""Logits (rows x vocabulary) `score_tokens` holds at once: 64 MiB in float32. A 2,048-token chunk
of a 49k vocabulary would take 400 MB whole; 128k, 1 GB."""


def score_tokens(
    hidden: Tensor,
    targets: Tensor,
    num_logprobs: int,
    compute_logits: Callable[[Tensor], Tensor],
    vocab_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Each hidden row's raw log-softmax at its target token, in the sampler's logprob layout:
    logprobs [R, 1 + k] and token ids [R, 1 + k] (the target, then the top `num_logprobs`), and the
    target's rank [R]. The float32 logits are made a slice of rows at a time."""
    rows = max(1, MAX_SCORED_LOGITS // vocab_size)
    parts = [
        _logprobs_at(
            compute_logits(hidden[i : i + rows]).float().log_softmax(-1),
            targets[i : i + rows],
            num_logprobs,
        )
        for i in range(0, len(targets), rows)
    ]
    logprobs, token_ids, ranks = (torch.cat(column) for column in zip(*parts, strict=True))
    return logprobs, token_ids, ranks


def _gather_logprobs(raw_logprobs: Tensor, sampled: Tensor, num_logprobs: int) -> SamplerOutput:
    return SamplerOutput(sampled, *_logprobs_at(raw_logprobs, sampled, num_logprobs))


def _logprobs_at(
    raw_logprobs: Tensor, tokens: Tensor, num_logprobs: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Logprobs and ids of each row's token then its top alternatives, and the token's rank."""
    token_logprob = raw_logprobs.gather(1, tokens.unsqueeze(1))
    top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    # Like vLLM, a tie with the token counts against it: rank = #{logprob >= the token's}.
    ranks = (raw_logprobs >= token_logprob).sum(-1)
    return (
        torch.cat([token_logprob, top_logprobs], dim=1),
        torch.cat([tokens.unsqueeze(1), top_ids], dim=1),
        ranks,
    )


def _apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    counts = batch.output_token_counts
    generated = counts > 0
    if batch.prompt_token_mask is not None:
        seen = batch.prompt_token_mask | generated
        penalty = torch.where(seen, batch.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    # OpenAI: logit -= count * frequency_penalty + (count > 0) * presence_penalty
    logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    return logits - batch.presence_penalty.unsqueeze(1) * generated


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask to -inf outside each row's top-k, then outside its nucleus; one sort serves both."""
    vocab_size = logits.shape[1]
    k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    kth_largest = logits_sort.gather(1, (vocab_size - k).unsqueeze(1))
    logits_sort.masked_fill_(logits_sort < kth_largest, -math.inf)
    # Ascending cumulative mass: drop a token if everything at or below it sums to <= 1 - p.
    probs_sum = logits_sort.softmax(-1).cumsum_(-1)
    outside = probs_sum <= 1.0 - top_p.unsqueeze(1)
    outside[:, -1] = False  # the most likely token always stays
    logits_sort.masked_fill_(outside, -math.inf)
    return logits_sort.scatter(1, logits_idx, logits_sort)


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); no softmax needed.
    threshold = logits.amax(-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, -math.inf)


def _exponential_race(logits: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """argmax(probs / q) with q ~ Exp(1) is a sample from probs, and needs no host sync. In log
    space, argmax(logits - log q), it needs no softmax either (a softmax over one 128k-vocab row
    took 33 us of a batch-1 step on an H100, benchmarks/results/profile_steps-*.json)."""
    q = torch.empty_like(logits).exponential_()
    # A seeded row draws from its own generator so its tokens don't depend on its neighbours.
    for row, generator in enumerate(generators):
        if generator is not None:
            q[row].exponential_(generator=generator)
    return (logits - q.log_()).argmax(-1)
