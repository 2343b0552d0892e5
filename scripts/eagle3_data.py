"""What scripts/train_eagle3.py learns from: the target's own answers to the prompts (generated
through ember's `LLM`), and at every position of prompt + answer the target's aux hidden states
and greedy next token (the labels); the draft vocabulary is the tokens it predicts most often."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.attention.torch_backend import TorchAttentionBackend
from ember.engine.model_runner import kv_cache_shape
from ember.entrypoints.llm import LLM
from ember.sampling_params import SamplingParams

if TYPE_CHECKING:
    import argparse
    from pathlib import Path

    from ember.attention.backend import AttentionBackend


@dataclass(slots=True)
class Sample:
    ids: torch.Tensor  # [S] prompt + answer
    aux: torch.Tensor  # [S, 3 * H]
    labels: torch.Tensor  # [S] the target's greedy next token after each position
    answer_start: int


Seq = tuple[list[int], int]
"""prompt + answer ids, and where the answer starts."""


def generate(model_dir: Path, args: argparse.Namespace) -> tuple[list[Seq], list[Seq]]:
    """The target's own answers: (training, held-out). The held-out prompts are answered greedily,
    as the replay decodes; training prompts get --samples answers at --temperature (sampled
    contexts, still scored against the target's greedy next tokens)."""
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    rows = rows[: args.max_prompts] if args.max_prompts else rows
    random.Random(args.seed).shuffle(rows)
    n_eval = max(1, int(len(rows) * args.eval_fraction)) if len(rows) > 1 else 0
    # A share of the GPU, so the training that follows finds the rest free.
    llm = LLM(
        str(model_dir),
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        gpu_memory_utilization=0.4,
    )
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
        sampled = SamplingParams(
            n=args.samples, temperature=args.temperature, max_tokens=args.max_new_tokens
        )
        held_out = llm.chat([r["messages"] for r in rows[:n_eval]], greedy) if n_eval else []
        train = llm.chat([r["messages"] for r in rows[n_eval:]], sampled)
    finally:
        llm.close()

    def seqs(outs: list) -> list[Seq]:
        return [
            (o.prompt_token_ids + c.token_ids, len(o.prompt_token_ids))
            for o in outs
            for c in o.outputs
        ]

    return seqs(train), seqs(held_out)


def attention(device: torch.device) -> AttentionBackend:
    """The engine's backend for the device (the PyTorch reference runs on the CPU only)."""
    if device.type == "cuda":
        from ember.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    return TorchAttentionBackend()


@torch.no_grad()
def target_states(
    target: torch.nn.Module,
    seqs: list[tuple[list[int], int]],
    device: torch.device,
    batch_tokens: int,
) -> list[Sample]:
    """A plain forward of each sequence (batched, over a throwaway paged cache)."""
    cfg, bs, backend = target.config, 16, attention(device)
    samples: list[Sample] = []
    groups: list[list[tuple[list[int], int]]] = []
    for seq in seqs:  # consecutive sequences, up to batch_tokens a forward
        if groups and sum(len(x) for x, _ in groups[-1]) + len(seq[0]) <= batch_tokens:
            groups[-1].append(seq)
        else:
            groups.append([seq])
    for batch in groups:
        # Each sequence gets consecutive blocks, so its slots are its positions plus an offset.
        lens = [len(x) for x, _ in batch]
        nbs = [-(-length // bs) for length in lens]
        first = list(itertools.accumulate(nbs, initial=0))
        qsl = list(itertools.accumulate(lens, initial=0))
        tables = [
            list(range(f, f + nb)) + [0] * (max(nbs) - nb)
            for f, nb in zip(first[:-1], nbs, strict=True)
        ]
        slots = [
            f * bs + p for f, length in zip(first[:-1], lens, strict=True) for p in range(length)
        ]
        n = first[-1]
        md = AttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
        )
        kv = torch.zeros(
            kv_cache_shape(cfg, n, bs), dtype=next(target.parameters()).dtype, device=device
        )
        ids = torch.tensor([t for s, _ in batch for t in s], device=device)
        pos = torch.cat([torch.arange(length, device=device) for length in lens])
        hidden = target(ids, pos, ForwardContext(md, kv, backend))
        labels = target.compute_logits(hidden).argmax(-1)
        aux = target.model.aux_hidden
        for j, (_, start) in enumerate(batch):
            a, b = qsl[j], qsl[j + 1]
            samples.append(Sample(ids[a:b].clone(), aux[a:b].float(), labels[a:b].clone(), start))
    return samples


def in_answer(sample: Sample) -> torch.Tensor:
    """Positions q whose label y_q is an answer token: answer_start <= q + 1 <= S - 1."""
    q = torch.arange(len(sample.ids), device=sample.ids.device)
    return (q + 1 >= sample.answer_start) & (q + 1 <= len(sample.ids) - 1)


def draft_vocab(samples: list[Sample], size: int, vocab: int) -> torch.Tensor:
    """The `size` target ids the target predicts most often in its answers, ascending."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s.labels[in_answer(s)].cpu(), minlength=vocab)
    # Ties (unseen tokens) go by id, so the choice is deterministic.
    order = sorted(range(vocab), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(sorted(order[:size]), dtype=torch.int64)
