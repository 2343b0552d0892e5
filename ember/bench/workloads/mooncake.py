"""Mooncake trace replay: JSON lines of (timestamp, input_length, output_length, hash_ids), each
hash id naming one block of prompt tokens, so requests share exactly the prefixes the trace says."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ember.bench.records import PlannedRequest
from ember.bench.workloads.prompts import (
    DEFAULT_VOCAB,
    block_token_ids,
    check_replay_args,
    check_vocab,
    completion_request,
    fit_lengths,
    token_list,
)

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the published Mooncake traces."""


@dataclass(slots=True, frozen=True)
class MooncakeRow:
    """One line of a Mooncake trace."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake_rows(
    path: str | Path, *, max_requests: int | None = None, block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[MooncakeRow]:
    """The first `max_requests` rows of a trace, in file order (blank lines skipped)."""
    if max_requests is not None and max_requests < 0:
        raise ValueError(f"max_requests must be >= 0 or None, got {max_requests}")
    rows: list[MooncakeRow] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if max_requests is not None and len(rows) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                row = MooncakeRow(
                    timestamp_ms=float(d["timestamp"]),
                    input_length=int(d["input_length"]),
                    output_length=int(d["output_length"]),
                    hash_ids=tuple(int(h) for h in d["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace row: {e}") from e
            if not 0 <= row.input_length <= len(row.hash_ids) * block_size:
                raise ValueError(
                    f"{path}:{lineno}: input_length {row.input_length} does not fit "
                    f"{len(row.hash_ids)} blocks of {block_size} tokens"
                )
            rows.append(row)
    return rows


def ideal_cached_tokens(
    rows: Sequence[MooncakeRow], *, block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[int]:
    """Per row, the prompt tokens an infinite prefix cache that has seen every earlier row holds.

    Prefix semantics: block k counts only if hash_ids[:k+1] began an earlier row, so a repeat of a
    hash id after a different one does not count. A counted block gives the tokens of it both this
    row and an earlier one had: 512 for full blocks, fewer where either side's last block is partial.
    """
    # A trie of seen prefixes: (parent node, hash id) -> node; node 0 is the empty prefix.
    children: dict[tuple[int, int], int] = {}
    seen_tokens: list[int] = [0]
    result: list[int] = []
    for row in rows:
        node, cached, matching = 0, 0, True
        for k, hash_id in enumerate(row.hash_ids):
            tokens = min(block_size, row.input_length - k * block_size)
            if tokens <= 0:
                break
            child = children.get((node, hash_id))
            if child is None:
                child = len(seen_tokens)
                children[(node, hash_id)] = child
                seen_tokens.append(0)
            if matching:
                cached += min(tokens, seen_tokens[child])
                matching = seen_tokens[child] >= tokens
            seen_tokens[child] = max(seen_tokens[child], tokens)
            node = child
        result.append(cached)
    return result


def load_mooncake_trace(
    path: str | Path,
    *,
    model: str,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    vocab: tuple[int, int] = DEFAULT_VOCAB,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    max_model_len: int | None = None,
) -> list[PlannedRequest]:
    """The trace as `/v1/completions` requests of token-id prompts, sent at timestamp * time_scale.

    Each prompt is its row's blocks (`block_tokens`) cut to input_length; each request generates
    exactly output_length tokens. `time_scale` < 1 replays faster, 0 sends everything at once.
    Prompts are built up front: the whole published conversation trace (12k requests, 145M prompt
    tokens) takes about 10 s and 1.4 GB; `max_requests` bounds both. With `max_model_len`, rows
    longer than that are cut first (`fit_lengths`), so the ideal hit ratio is the cut trace's.
    """
    check_replay_args(time_scale, max_requests)
    check_vocab(vocab)
    rows = read_mooncake_rows(path, max_requests=max_requests, block_size=block_size)
    if max_model_len is not None:
        rows = [_fit_row(row, max_model_len) for row in rows]
    requests: list[PlannedRequest] = []
    cached = ideal_cached_tokens(rows, block_size=block_size)
    for i, row in enumerate(rows):
        blocks = row.hash_ids[: -(-row.input_length // block_size)]
        prompt = token_list(block_token_ids(blocks, block_size, vocab)[: row.input_length], vocab)
        requests.append(
            completion_request(
                f"mooncake-{i}",
                prompt,
                row.output_length,
                model=model,
                send_at=row.timestamp_ms / 1000 * time_scale,
                ideal_cached_tokens=cached[i],
            )
        )
    return requests


def _fit_row(row: MooncakeRow, limit: int) -> MooncakeRow:
    n, m = fit_lengths(row.input_length, row.output_length, limit)
    return dataclasses.replace(row, input_length=n, output_length=m)


def ideal_hit_ratio(requests: Iterable[PlannedRequest]) -> float:
    """sum(ideal_cached_tokens) / sum(prompt tokens) over trace-replay requests (0 when empty)."""
    cached = prompt = 0
    for r in requests:
        if r.ideal_cached_tokens is None:
            raise ValueError(f"request {r.request_id} has no ideal_cached_tokens (not a trace)")
        cached += r.ideal_cached_tokens
        prompt += len(r.body["prompt"])
    return cached / prompt if prompt else 0.0
