"""Two benchmark runs side by side (`ember bench compare A.json B.json`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.bench.metrics import PERCENTILE_KEYS
from ember.bench.report import LATENCIES, format_number
from ember.bench.spec_counters import MEAN_ACCEPTED

if TYPE_CHECKING:
    from collections.abc import Mapping

# (label, summary key, decimals); the latency rows follow, built from LATENCIES.
_SCALARS: tuple[tuple[str, str, int], ...] = (
    ("requests", "requests", 0),
    ("completed", "completed", 0),
    ("errors", "errors", 0),
    ("duration (s)", "duration_s", 2),
    ("request throughput (req/s)", "request_throughput", 2),
    ("output throughput (tok/s)", "output_throughput", 2),
    ("input throughput (tok/s)", "input_throughput", 2),
    ("goodput (req/s)", "goodput", 2),
    ("goodput fraction", "goodput_fraction", 3),
    ("cache hit ratio", "cache_hit_ratio", 3),
    ("cache hit ratio, all sent", "sent_cache_hit_ratio", 3),
    ("ideal cache hit ratio", "ideal_cache_hit_ratio", 3),
)


def load_result(path: str | Path) -> dict[str, Any]:
    """Read a result file written by `ember.bench.report.write_json`."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not a JSON benchmark result ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
        raise ValueError(f"{p}: not an ember bench result (no 'summary' object)")
    return doc


def _ratio(a: Any, b: Any) -> str:
    if not isinstance(a, int | float) or not isinstance(b, int | float):
        return "-"
    if a == 0 or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{b / a:.2f}x"


def _rows(summary: Mapping[str, Any], spec: bool) -> list[tuple[str, Any, int]]:
    rows: list[tuple[str, Any, int]] = [(lbl, summary.get(k), d) for lbl, k, d in _SCALARS]
    if spec:  # either run was measured with speculative decoding's counters
        sd = summary.get("speculative") or {}
        rows.append(("mean accepted length per verification step", sd.get(MEAN_ACCEPTED), 2))
        rows.append(("draft acceptance rate", sd.get("acceptance_rate"), 3))
    for key, name in LATENCIES:
        stats = summary.get(key) or {}
        rows.extend((f"{name} {p} (ms)", stats.get(p), 2) for p in PERCENTILE_KEYS)
    return rows


def compare_table(
    a: Mapping[str, Any], b: Mapping[str, Any], names: tuple[str, str] = ("A", "B")
) -> str:
    """Markdown table of two results' summaries (as `load_result` returns them): each metric's
    value in A, in B, and B/A ("-" where either is missing or A is 0)."""
    spec = any(r["summary"].get("speculative") is not None for r in (a, b))
    rows_a, rows_b = _rows(a["summary"], spec), _rows(b["summary"], spec)
    name_a, name_b = names
    lines = [
        f"| metric | {name_a} | {name_b} | {name_b}/{name_a} |",
        "|---|---:|---:|---:|",
    ]
    for (label, va, digits), (_, vb, _) in zip(rows_a, rows_b, strict=True):
        lines.append(
            f"| {label} | {format_number(va, digits)} | {format_number(vb, digits)} "
            f"| {_ratio(va, vb)} |"
        )
    return "\n".join(lines) + "\n"
