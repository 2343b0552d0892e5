"""A run's report: the JSON result file, markdown tables, and latency plots (PNG)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember.bench.metrics import PERCENTILE_KEYS
from ember.bench.spec_counters import MEAN_ACCEPTED

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ember.bench.records import RequestRecord

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
"""Summary key and label of each latency, in report order."""
MISSING = "-"


def _jsonable(obj: Any) -> Any:
    # Strict JSON: NaN and infinities have no spelling, so they are stored as null.
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(
    path: str | Path,
    *,
    config: dict[str, Any],
    records: Sequence[RequestRecord],
    summary: dict[str, Any],
    sweep: list[dict[str, Any]] | None = None,
) -> Path:
    """Write one run as one JSON file: {"config", "summary", "records", "sweep"}; returns the path.

    `records` become dicts (`dataclasses.asdict`). A sweep is a list of entries, one per offered
    rate, each at least {"rate": float, "summary": dict}; any records in an entry are written the
    same way. NaN and infinite floats (a percentile of nothing, rate=inf) are written as null.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "summary": summary, "records": list(records), "sweep": sweep}
    out.write_text(json.dumps(_jsonable(doc), indent=1, allow_nan=False) + "\n")
    return out


def format_number(value: float | None, digits: int = 2) -> str:
    """`value` to `digits` decimals; None and NaN (nothing measured) print as "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return f"{value:.{digits}f}"


def format_percent(value: float | None) -> str:
    """A ratio in [0, 1] as a percentage with one decimal; None and NaN print as "-"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return MISSING
    return f"{100.0 * value:.1f}%"


def format_rate(rate: float | None) -> str:
    """An offered request rate; infinity (stored as null in JSON) means all requests at once."""
    if rate is None or math.isinf(rate):
        return "inf"
    return format_number(rate)


def _slo_text(summary: Mapping[str, Any]) -> str:
    parts = [
        f"{name} <= {format_number(summary.get(key), 1)} ms"
        for key, name in (("slo_ttft_ms", "TTFT"), ("slo_tpot_ms", "TPOT"))
        if summary.get(key) is not None
    ]
    return "SLO " + ", ".join(parts) if parts else "no SLO"


def markdown_table(summary: Mapping[str, Any]) -> str:
    """The summary as markdown: a latency table (mean/p50/p90/p99 in ms), then a line each for
    requests, throughput, goodput, errors and cache hits."""
    lines = ["| latency (ms) | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for key, label in LATENCIES:
        stats = summary.get(key) or {}
        cells = " | ".join(format_number(stats.get(p)) for p in PERCENTILE_KEYS)
        lines.append(f"| {label} | {cells} |")
    lines.append("")
    lines.append(
        f"- requests: {summary['requests']} sent, {summary['completed']} completed "
        f"in {format_number(summary['duration_s'])} s"
    )
    lines.append(
        f"- throughput: {format_number(summary['request_throughput'])} req/s, "
        f"{format_number(summary['output_throughput'])} output tok/s, "
        f"{format_number(summary['input_throughput'])} input tok/s"
    )
    lines.append(
        f"- goodput: {format_number(summary['goodput'])} req/s, "
        f"{summary['good_requests']} requests ({format_percent(summary['goodput_fraction'])}), "
        f"{_slo_text(summary)}"
    )
    kinds = summary.get("error_kinds") or {}
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1])
    detail = "; ".join(f"{n} x `{' '.join(kind.split())}`" for kind, n in ranked)
    lines.append(f"- errors: {summary['errors']}" + (f" ({detail})" if detail else ""))
    lines += _cache_lines(summary)
    lines += _tier_lines(summary.get("kv_tiers"))
    lines += _spec_lines(summary.get("speculative"))
    per_request = summary.get("mean_accepted_length_per_request")
    if per_request is not None:
        lines.append(
            "- speculative decoding: mean accepted length per request "
            f"{format_number(per_request)} (output tokens / forward steps, from each answer's "
            f"usage, over {summary['requests_with_accepted_length']} requests)"
        )
    return "\n".join(lines) + "\n"


def _cache_lines(summary: Mapping[str, Any]) -> list[str]:
    """Measured hits; for a trace, beside the ideal over the same requests: all sent (a failed one
    counts as all misses), then the completed ones only."""
    measured = format_percent(summary["cache_hit_ratio"])
    if summary.get("trace_requests") is None:  # no ideal counts (not a trace replay)
        return [f"- cache hit: {measured}"]
    sent, failed = summary["trace_requests"], summary["trace_failed"]
    return [
        f"- cache hit over all {sent} requests sent: "
        f"{format_percent(summary['sent_cache_hit_ratio'])} "
        f"(ideal {format_percent(summary['ideal_cache_hit_ratio'])}); "
        f"{failed} failed, counted as misses",
        f"- cache hit over the {sent - failed} completed: {measured} "
        f"(ideal {format_percent(summary['completed_ideal_cache_hit_ratio'])})",
    ]


TIER_NAMES = {"cpu": "host"}
"""The tiers as the report names them (metrics label the host tier by its medium, `cpu`)."""


def _tier_lines(tiers: Mapping[str, Any] | None) -> list[str]:
    """Where the hits were, as the server counted them over the run
    (`tier_counters.tier_summary`); nothing when the server reports none."""
    if tiers is None:
        return []
    parts = [
        f"{ {'cpu': 'host'}.get(medium, medium) } {format_percent(t['hit_ratio'])} of "
        f"{t['hits'] + t['misses']} blocks"
        for medium, t in tiers["tiers"].items()
    ]
    return [
        f"- server-counted prefix cache hit: {format_percent(tiers['prefix_hit_ratio'])} of "
        f"{tiers['prefix_queries']} prompt tokens"
        + (f"; KV tiers, of the blocks the GPU missed: {', '.join(parts)}" if parts else "")
    ]


def _spec_lines(spec: Mapping[str, Any] | None) -> list[str]:
    """Speculative decoding as the server counted it over the run (`spec_counters.spec_summary`);
    nothing when the server reports none."""
    if spec is None:
        return []
    if not spec["drafts"]:
        return ["- speculative decoding: no drafts verified during the run"]
    by_pos = ", ".join(format_percent(r) for r in spec["acceptance_rate_per_position"])
    return [
        "- speculative decoding: mean accepted length per verification step "
        f"{format_number(spec[MEAN_ACCEPTED])} (1 + accepted / drafts over "
        f"{spec['drafts']} drafts, pooled over the run, not a per-request mean); "
        f"{spec['accepted_tokens']} of {spec['draft_tokens']} draft tokens accepted "
        f"({format_percent(spec['acceptance_rate'])})",
        f"- draft acceptance by position (share of drafts): {by_pos or MISSING}",
    ]


def sweep_table(sweep: Sequence[Mapping[str, Any]]) -> str:
    """One markdown row per offered rate: throughput, TTFT and TPOT p50/p90, cache hits, errors,
    and the mean accepted length per verification step where the server reports it."""
    spec = any(e["summary"].get("speculative") is not None for e in sweep)
    lines = [
        "| rate (req/s) | req/s | out tok/s | TTFT p50 (ms) | TTFT p90 (ms) "
        "| TPOT p50 (ms) | TPOT p90 (ms) | cache hit | errors |"
        + (" accepted len/step |" if spec else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if spec else ""),
    ]
    for entry in sweep:
        s = entry["summary"]
        ttft, tpot = s.get("ttft_ms") or {}, s.get("tpot_ms") or {}
        cells = [
            format_rate(entry.get("rate")),
            format_number(s["request_throughput"]),
            format_number(s["output_throughput"]),
            format_number(ttft.get("p50")),
            format_number(ttft.get("p90")),
            format_number(tpot.get("p50")),
            format_number(tpot.get("p90")),
            format_percent(s["cache_hit_ratio"]),
            str(s["errors"]),
        ]
        if spec:
            cells.append(format_number((s.get("speculative") or {}).get(MEAN_ACCEPTED)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _figure(ncols: int, nrows: int, size: tuple[float, float]) -> tuple[Figure, list[Axes]]:
    # A bare Figure on the Agg canvas: no pyplot, so no global figure state and no display.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _latencies_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.ok]
    return {
        "TTFT": [r.ttft * 1000.0 for r in done if r.ttft is not None],
        "TPOT": [t * 1000.0 for r in done if (t := r.tpot) is not None],
        "ITL": [gap * 1000.0 for r in done for gap in r.itl],
        "E2E": [r.e2e * 1000.0 for r in done if r.e2e is not None],
    }


def _ecdf(values: Sequence[float], max_points: int = 2000) -> tuple[list[float], list[float]]:
    """Step points of the empirical CDF, from 0 at the smallest value; long runs are thinned to
    about `max_points` order statistics (a pooled ITL list can hold millions of gaps)."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return [], []
    stride = max(1, n // max_points)
    idx = list(range(0, n, stride))
    if idx[-1] != n - 1:
        idx.append(n - 1)
    return [ordered[0]] + [ordered[i] for i in idx], [0.0] + [(i + 1) / n for i in idx]


def plot_cdfs(
    records: Sequence[RequestRecord] | Mapping[str, Sequence[RequestRecord]], path: str | Path
) -> Path:
    """PNG of the empirical CDFs of TTFT, TPOT, ITL and E2E (ms), one panel each, completed
    requests only. Pass {label: records} to overlay several runs."""
    runs = dict(records) if isinstance(records, Mapping) else {"": records}
    fig, axes = _figure(2, 2, (10.0, 7.5))
    per_run = {label: _latencies_ms(recs) for label, recs in runs.items()}
    for ax, (_, name) in zip(axes, LATENCIES, strict=True):
        plotted = False
        for label, lat in per_run.items():
            xs, ys = _ecdf(lat[name])
            if not xs:
                continue
            ax.step(xs, ys, where="post", label=label or None)
            plotted = True
        if not plotted:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0.0, 1.02)
        ax.grid(True, alpha=0.3)
        if plotted and len(runs) > 1:
            ax.legend()
    return _save(fig, path)


def plot_sweep(
    sweep: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | Path,
) -> Path:
    """PNG of p90 TTFT and p90 TPOT (ms) against offered load (req/s), one panel each.

    Pass {label: sweep} to compare runs on one plot (colocated against disaggregated). Entries
    whose rate is infinite or null (all requests at once) have no place on the axis and are left
    out; a missing p90 leaves a gap in the line.
    """
    runs = dict(sweep) if isinstance(sweep, Mapping) else {"": sweep}
    fig, axes = _figure(2, 1, (11.0, 4.5))
    for ax, (key, name) in zip(axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")), strict=True):
        for label, entries in runs.items():
            points = sorted(
                (float(e["rate"]), _p90(e["summary"], key))
                for e in entries
                if e.get("rate") is not None and math.isfinite(e["rate"])
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=label or None)
        ax.set_title(f"p90 {name} against offered load")
        ax.set_xlabel("offered load (req/s)")
        ax.set_ylabel(f"p90 {name} (ms)")
        ax.set_ylim(bottom=0.0)
        ax.grid(True, alpha=0.3)
        if len(runs) > 1:
            ax.legend()
    return _save(fig, path)


def _p90(summary: Mapping[str, Any], key: str) -> float:
    value = (summary.get(key) or {}).get("p90")
    return math.nan if value is None else float(value)


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
