"""`ember bench --url URL --workload agentic|trace|random [...]` and `ember bench compare A B`."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from ember.bench.fit import (
    AgenticSize,
    BenchError,
    ServerInfo,
    fit_requests,
    server_info,
    size_agentic,
    warn,
)
from ember.bench.spec_counters import SpecProbe
from ember.bench.tier_counters import TierProbe

USAGE = """ember bench --url URL --workload agentic|trace|random [options]
       ember bench compare A.json B.json"""


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ember bench", usage=USAGE, description=__doc__, allow_abbrev=False
    )
    g = p.add_argument_group("target", "the server under load")
    g.add_argument("--url", required=True, help="the server (or router) base URL")
    g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument("--api-key", default=None, help="sent as a bearer token (default: none)")
    g.add_argument(
        "--metrics-url",
        nargs="+",
        default=None,
        metavar="URL",
        help="servers whose /metrics count speculative decoding and the KV cache's hits, summed "
        "(default: --url; behind "
        "a router, which counts none, give the engines' URLs); ember's needs the cluster secret: "
        "EMBER_CLUSTER_SECRET, else a local ember up's own",
    )
    g = p.add_argument_group("load", "the workload and how fast it arrives")
    g.add_argument(
        "--workload",
        choices=["agentic", "trace", "random"],
        required=True,
        help="agentic sessions, a trace replay, or random prompts",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    g.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second")
    g.add_argument("--rates", default=None, help="a sweep, e.g. 1,2,4,8: one run per rate")
    g.add_argument("--max-requests", type=int, default=None, help="stop after N requests")
    g.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    g.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="a request with no end after S seconds fails as a timeout; requests still running "
        "S seconds after the last was sent are cut off and counted as timeouts too",
    )
    g.add_argument("--vocab", default="10:3000", help="token-id range for token prompts (lo:hi)")
    g = p.add_argument_group("report", "goodput and where the results go")
    g.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO, TTFT in ms")
    g.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO, TPOT in ms")
    g.add_argument("--out", default="bench-results", help="directory for JSON, tables and PNGs")
    g.add_argument("--name", default=None, help="file name stem (default: workload and time)")
    g.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    g = p.add_argument_group("agentic", "sessions of turns that share a system prompt")
    g.add_argument("--sessions", type=int, default=8, help="sessions run at once")
    g.add_argument("--turns", type=int, default=4, help="turns of each session")
    g.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    g.add_argument(
        "--system-tokens",
        type=int,
        default=3000,
        help="the shared system prompt's length in the server's tokens (measured by two probe "
        "requests; the whole workload is scaled down, with a warning, to fit max_model_len)",
    )
    g.add_argument("--max-tokens", type=int, default=256, help="tokens each turn generates")
    g.add_argument("--no-affinity", action="store_true", help="no x-session-affinity header")
    g = p.add_argument_group("trace", "a recorded trace replayed on its own timestamps")
    g.add_argument(
        "--trace-file",
        default=None,
        help="the trace (JSON lines or CSV); a checkout of ember ships the public Mooncake and "
        "Azure traces in benchmarks/data/traces/",
    )
    g.add_argument(
        "--trace-format",
        choices=["mooncake", "azure"],
        default="mooncake",
        help="the trace's format",
    )
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply trace timestamps")
    g.add_argument(
        "--block-size",
        type=int,
        default=512,
        help="prompt tokens per hash id of a Mooncake trace (the published traces: 512)",
    )
    g = p.add_argument_group("random", "random token prompts of given lengths")
    g.add_argument("--num-requests", type=int, default=100, help="requests to send")
    g.add_argument("--input-len", default="512", help="N or LO:HI")
    g.add_argument("--output-len", default="128", help="N or LO:HI")
    return p


def _span(text: str) -> int | tuple[int, int]:
    if ":" in text:
        lo, hi = text.split(":")
        return int(lo), int(hi)
    return int(text)


def warn_cut_rows(path: str, max_requests: int | None, limit: int | None, block_size: int) -> None:
    from ember.bench.workloads import read_mooncake_rows

    if limit is None:
        return
    rows = read_mooncake_rows(path, max_requests=max_requests, block_size=block_size)
    cut = sum(r.input_length + r.output_length > limit for r in rows)
    if cut:
        warn(
            f"{cut} of {len(rows)} requests did not fit the server's max_model_len {limit}: "
            "their prompts (and outputs beyond half the context) were cut to fit"
        )


def run_once(
    args: argparse.Namespace,
    info: ServerInfo,
    rate: float | None,
    seed: int,
    size: AgenticSize | None,
    probe: SpecProbe,
    tiers: TierProbe,
) -> dict[str, Any]:
    from ember.bench import workloads as w
    from ember.bench.metrics import summarize
    from ember.bench.runner import RunLimits, run_open_loop, run_sessions

    limits = RunLimits(
        max_requests=args.max_requests,
        duration_s=args.duration,
        grace_s=args.timeout,
        request_timeout_s=args.timeout,
        api_key=args.api_key,
        affinity=not args.no_affinity,
        progress=not args.no_progress,
    )
    lo, hi = (int(x) for x in args.vocab.split(":"))
    model = info.model
    if args.workload == "agentic":
        assert size is not None
        workload = w.AgenticWorkload(
            args.sessions,
            args.turns,
            system_words=size.system_words,
            user_words=size.user_words,
            tool_result_words=size.tool_result_words,
            max_tokens=size.max_tokens,
            think_time_s=args.think_time,
            rate=rate,
            affinity=not args.no_affinity,
            seed=seed,
            model=model,
        )
        probe.start()
        tiers.start()
        records, duration = asyncio.run(run_sessions(args.url, workload, limits))
    else:
        if args.workload == "trace":
            if not args.trace_file:
                raise ValueError("--workload trace needs --trace-file")
            if args.trace_format == "mooncake":
                planned = w.load_mooncake_trace(
                    args.trace_file,
                    time_scale=args.time_scale,
                    max_requests=args.max_requests,
                    vocab=(lo, hi),
                    model=model,
                    block_size=args.block_size,
                    max_model_len=info.max_model_len,  # cut rows before the ideal ratio
                )
                warn_cut_rows(
                    args.trace_file, args.max_requests, info.max_model_len, args.block_size
                )
            else:
                planned = w.load_azure_trace(
                    args.trace_file,
                    time_scale=args.time_scale,
                    max_requests=args.max_requests,
                    vocab=(lo, hi),
                    model=model,
                )
        else:
            planned = w.random_workload(
                args.num_requests,
                input_len=_span(args.input_len),
                output_len=_span(args.output_len),
                rate=rate,
                seed=seed,
                vocab=(lo, hi),
                model=model,
            )
        planned = fit_requests(planned, info.max_model_len)
        probe.start()
        tiers.start()
        records, duration = asyncio.run(run_open_loop(args.url, planned, limits))
    summary = summarize(
        records,
        duration,
        slo_ttft_s=args.slo_ttft / 1e3 if args.slo_ttft else None,
        slo_tpot_s=args.slo_tpot / 1e3 if args.slo_tpot else None,
    )
    summary["speculative"] = probe.finish()
    summary["kv_tiers"] = tiers.finish()
    return {"rate": rate, "records": records, "summary": summary}


def cmd_run(argv: list[str]) -> int:
    from ember.bench.report import markdown_table, plot_cdfs, plot_sweep, sweep_table, write_json

    args = run_parser().parse_args(argv)
    if args.block_size < 1 or args.timeout <= 0:
        raise ValueError("--block-size must be >= 1 and --timeout > 0")
    info = server_info(args.url, args.api_key)  # a server that is down fails here, in one line
    if args.model:
        info = ServerInfo(args.model, info.max_model_len)
    model = info.model
    size = None
    if args.workload == "agentic":
        size = size_agentic(
            args.url,
            args.api_key,
            info,
            system_tokens=args.system_tokens,
            turns=args.turns,
            max_tokens=args.max_tokens,
        )
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
    probe = SpecProbe(args.metrics_url or [args.url])
    tiers = TierProbe(args.metrics_url or [args.url])
    runs = []
    for i, rate in enumerate(rates):
        if len(rates) > 1:
            print(f"rate {rate}/s ...", file=sys.stderr)
        # Each rate of a sweep gets prompts of its own: the last rate's would all be cached.
        runs.append(run_once(args, info, rate, args.seed + i, size, probe, tiers))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    config = {k: v for k, v in vars(args).items() if k != "api_key"} | {"model": model}
    last = runs[-1]
    sweep = [{"rate": r["rate"], "summary": r["summary"]} for r in runs] if len(runs) > 1 else None
    records = [rec for r in runs for rec in r["records"]]
    write_json(out / f"{stem}.json", config=config, records=records, summary=last["summary"],
               sweep=sweep)  # fmt: skip
    table = sweep_table(sweep) if sweep else markdown_table(last["summary"])
    (out / f"{stem}.md").write_text(table + "\n")
    plot_cdfs(last["records"], out / f"{stem}-cdf.png")
    if sweep:
        plot_sweep(sweep, out / f"{stem}-sweep.png")
    print(table)
    print(f"\nwrote {out / stem}.json, .md and PNG plots")
    failed = [rec for rec in records if not rec.ok]
    if records and len(failed) == len(records):
        # A run that measured nothing is a failure, whatever wrote its report.
        print(
            f"ember bench: error: all {len(records)} requests failed, e.g. {failed[0].error}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_compare(argv: list[str]) -> int:
    from ember.bench.compare import compare_table, load_result

    p = argparse.ArgumentParser(prog="ember bench compare", allow_abbrev=False)
    g = p.add_argument_group("results", "two runs' JSON results, written by ember bench")
    g.add_argument("a", help="the first run's JSON")
    g.add_argument("b", help="the second run's JSON, compared with the first")
    args = p.parse_args(argv)
    print(
        compare_table(
            load_result(args.a), load_result(args.b), (Path(args.a).stem, Path(args.b).stem)
        )
    )
    return 0


def main(argv: list[str]) -> int:
    compare = bool(argv) and argv[0] == "compare"
    try:
        return cmd_compare(argv[1:]) if compare else cmd_run(argv)
    except (BenchError, ValueError, OSError) as e:  # a down server, a missing or foreign file
        print(f"ember bench{' compare' if compare else ''}: error: {e}", file=sys.stderr)
        return 1
