"""Azure LLM inference trace replay: CSV rows of (TIMESTAMP, ContextTokens, GeneratedTokens), the
lengths and arrival times of production requests, replayed with random token-id prompts."""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import numpy as np

from ember.bench.records import PlannedRequest
from ember.bench.workloads.prompts import (
    DEFAULT_VOCAB,
    check_replay_args,
    check_vocab,
    completion_request,
    random_tokens,
)

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_azure_timestamp(text: str) -> tuple[datetime, float]:
    """`2023-11-16 18:15:46.6805900` -> (the whole second, the fraction in seconds).

    The traces carry 7 fraction digits (100 ns), one more than `datetime` parses.
    """
    whole, _, fraction = text.strip().partition(".")
    if fraction and not fraction.isdigit():
        raise ValueError(f"bad fraction of a second in {text!r}")
    second = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return second, int(fraction) / 10 ** len(fraction) if fraction else 0.0


def load_azure_trace(
    path: str | Path,
    *,
    model: str,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    vocab: tuple[int, int] = DEFAULT_VOCAB,
    seed: int = 0,
) -> list[PlannedRequest]:
    """The trace as `/v1/completions` requests: ContextTokens random token ids (seeded), exactly
    GeneratedTokens out, sent at (TIMESTAMP - the first row's TIMESTAMP) * time_scale."""
    check_replay_args(time_scale, max_requests)
    check_vocab(vocab)
    rng = np.random.default_rng(seed)
    requests: list[PlannedRequest] = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: not an Azure LLM trace, missing columns {missing}")
        start: tuple[datetime, float] | None = None
        for row in reader:
            if max_requests is not None and len(requests) >= max_requests:
                break
            try:
                second, fraction = parse_azure_timestamp(row["TIMESTAMP"])
                context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{reader.line_num}: bad Azure trace row: {e}") from e
            if start is None:
                start = (second, fraction)
            offset = (second - start[0]).total_seconds() + (fraction - start[1])
            requests.append(
                completion_request(
                    f"azure-{len(requests)}",
                    random_tokens(rng, context, vocab),
                    generated,
                    model=model,
                    send_at=offset * time_scale,
                )
            )
    return requests
