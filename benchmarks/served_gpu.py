"""`ember serve` against `vllm serve` on one GPU, each at its defaults, driven by the same client
(`ember bench`) with the same loads:

- mixed: 256 requests of 1024 prompt tokens and 256 output tokens, all sent at once: output tok/s;
- b1: one request at a time, 128 in, 512 out, three times: TPOT p50, and its fraction of the
  copy roofline (the bytes a step reads, the weights and the KV of its mean context, over the
  card's copy bandwidth measured in the same run, before the first start and after the last; the
  higher of the two is used);
- sweep: the mixed requests at Poisson rates (4, 8, 16 req/s): TTFT and TPOT p50/p90, done req/s,
  on the last start only (the warm one when both run);
- batches (not by default): 64 and then 256 requests of 128 in, 256 out, all sent at once:
  TPOT p50 (decode at about that batch);
- short: a fresh 128-token prompt alone, one output token, seven times (different prompts, one
  at a time): its time to answer (TTFT), median, least and most;
- agent: an agent's conversation of C tokens (8k, 16k, 32k), then three next turns each adding
  1,024 tokens (a prefix-cache hit on the C): seconds to answer a turn with one token, the
  median next turn's (`/v1/completions` with token ids, one request at a time);

each on a fresh start (empty compile caches: ember's Triton cache; vLLM's torch.compile, Inductor
and Triton caches) and again on a warm one (the same caches, the server restarted). A start's
seconds to ready are timed, and the first start's mixed requests are compared one by one with the
same requests on the warm start ("first minute": no request more than 5% slower, the goal).

`--quant` serves the shape in a scheme of benchmarks/quant_schemes.py (Kimi K2.5's INT4 experts,
W4A16, DeepSeek's FP8 blocks; `kimi_k2` is Kimi K2's dims, `--layers` as many as fit): both servers
make dummy weights in that format, so the same config.json is the same checkpoint.

The model is a shape of benchmarks/engine_gpu.py with dummy weights (`--weights files`: random
weights written as a checkpoint's safetensors, so that each start reads ~16 GB of files as a
user's does) and a word-level tokenizer
that spells every id of its vocabulary (so both servers detokenize whatever a random model emits).
vLLM comes from scripts/vllm_pack.sh's archives, unpacked by scripts/vllm_device_env.sh
($VLLM_SITE). `--device cpu` runs ember alone on its tiny model with tiny loads: a smoke test of
this script.

    python benchmarks/served_gpu.py [--shape llama] [--engines ember,vllm] [--loads mixed,b1,sweep,short,agent]
        [--starts fresh,warm] [--weights dummy|files [--cold-weights]] [--cold-libs]
        [--quant k25-int4|w4a16-g128|fp8-blocks] [--layers N]

An engine named twice in `--engines` runs twice (the second as `ENGINE#2`, with caches of its own).

Prints a table and writes
benchmarks/results/served_gpu-<GPU>-<date>.json (or $OUT/ when set).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_gpu import SHAPES, kv_bytes_per_token, weight_bytes_read  # noqa: E402
from quant_schemes import KIMI_K2, SCHEMES  # noqa: E402
from result_names import result_path  # noqa: E402

from ember.cluster import stop_processes  # noqa: E402
from ember.kv.tiers.store_master import free_port  # noqa: E402


@dataclass(frozen=True)
class Loads:
    mixed: tuple[int, int, int]  # requests, input, output
    b1: tuple[int, int, int]
    sweep_rates: str
    vocab: str
    agent: tuple[tuple[int, ...], int, int] = ((8192, 16384, 32768), 1024, 3)
    """(conversation lengths, tokens a next turn adds, next turns)."""
    batches: tuple[tuple[int, ...], int, int] = ((64, 256), 128, 256)
    """(batch sizes, input, output): B requests sent at once, their TPOT p50 (decode at ~B)."""
    short: tuple[int, int] = (7, 128)
    """(prompts, tokens): fresh prompts alone, one output token each."""


def b1_bytes(cfg: dict, loads: Loads) -> float:
    """Bytes a step of the b1 load reads: every weight a token touches (not the embedding table)
    and the KV of the load's mean context (its prompt and half its output)."""
    _, prompt, output = loads.b1
    return weight_bytes_read(cfg, 1) + (prompt + output / 2) * kv_bytes_per_token(cfg)


def roofline_fracs(report: dict) -> None:
    """Each run's b1 TPOT against the copy roofline of the report's ceilings (the higher copy
    rate measured, so the fraction errs low)."""
    bw = max(report["copy_bytes_per_s"])
    floor_s = report["b1_bytes"] / bw
    for runs in report["engines"].values():
        for run in runs.values():
            if isinstance(run, dict) and run.get("b1_tpot_ms"):
                run["b1_roofline_frac"] = floor_s / (run["b1_tpot_ms"] / 1e3)


GPU_LOADS = Loads((256, 1024, 256), (3, 128, 512), "4,8,16", "10:120000")
CPU_LOADS = Loads(
    (8, 48, 8), (2, 16, 8), "4,8", "10:300", ((64, 160), 32, 2), ((4,), 16, 8), (3, 16)
)


def word_tokenizer(model_dir: Path, vocab: int) -> None:
    """A tokenizer.json whose word-level vocabulary spells every id below `vocab` (t0, t1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "t1",
        "eos_token": "t2",
        "model_max_length": 1 << 20,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


ALL_SHAPES = {
    **SHAPES,
    "kimi_k2": {k: v for k, v in KIMI_K2.items() if k != "quantization_config"},
}
"""engine_gpu's shapes and Kimi K2's (its dims in bf16; `--quant fp8-blocks` as published)."""


def shape_config(shape: str, quant: str | None, layers: int | None) -> dict:
    """config.json of `shape`, in the `quant` scheme of benchmarks/quant_schemes.py (a
    `quantization_config` both servers read; their dummy weights are then packed INT4 or FP8
    tensors), with `layers` decoder layers if given."""
    cfg = dict(ALL_SHAPES[shape])
    if quant is not None:
        cfg["quantization_config"] = SCHEMES[quant]
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    return cfg


def model_dir(shape: str, cfg: dict | None = None) -> Path:
    """A model directory of `shape` (its config `cfg`, else the shape's own) with a word-level
    tokenizer and no weights."""
    d = Path(tempfile.mkdtemp(prefix=f"served-{shape}-"))
    cfg = dict(ALL_SHAPES[shape] if cfg is None else cfg)
    cfg.setdefault("bos_token_id", 1)
    cfg.setdefault("eos_token_id", 2)
    (d / "config.json").write_text(json.dumps(cfg))
    word_tokenizer(d, cfg["vocab_size"])
    return d


def _packed_int4(cfg: dict) -> tuple[int, list[str]] | None:
    """(group size, ignore list) of a compressed-tensors pack-quantized INT4 scheme, or None for
    bf16 weights or FP8 blocks (`_fp8_blocks`); another scheme is refused."""
    quant = cfg.get("quantization_config")
    if quant is None or _fp8_blocks(cfg) is not None:
        return None
    weights = quant["config_groups"]["group_0"]["weights"] if "config_groups" in quant else {}
    if quant.get("format") != "pack-quantized" or weights.get("num_bits") != 4:
        raise SystemExit(
            "--weights files: bf16, pack-quantized INT4 (--quant k25-int4, w4a16-g128) or "
            "FP8 blocks (--quant fp8-blocks)"
        )
    return weights["group_size"], quant.get("ignore", [])


def _fp8_blocks(cfg: dict) -> tuple[int, int] | None:
    """The block (rows, cols) of a DeepSeek-V3 style FP8 scheme (`quant_method` fp8 with
    `weight_block_size`), or None."""
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8" or "weight_block_size" not in quant:
        return None
    rows, cols = quant["weight_block_size"]
    return rows, cols


def _quantized(module: str, ignore: list[str]) -> bool:
    """Whether a Linear `module` is in the scheme: a projection or the LM head that no `ignore`
    entry names (a name, or `re:` and a regex matched from the start)."""
    last = module.rsplit(".", 1)[-1]
    if not (last.endswith("_proj") or last == "lm_head"):
        return False  # norms, embeddings, the router
    for entry in ignore:
        if entry.startswith("re:") and re.match(entry[3:], module):
            return False
        if not entry.startswith("re:") and (module == entry or module.endswith("." + entry)):
            return False
    return True


def write_weights(d: Path, cfg: dict, device: str = "cpu", seed: int = 0) -> int:
    """Random weights of a dense Llama-style or a DeepSeek-V3 (MLA + MoE) shape under a Hugging
    Face checkpoint's names, one safetensors shard a layer (a start then reads real files, as a
    user's does, instead of making dummy weights in place; and a MoE's router then spreads the
    tokens over the experts as trained weights do, where vLLM's dummy weights send every token
    to the same few). bf16, or in the config's pack-quantized INT4 scheme: a quantized Linear is
    random packed words (every nibble equally likely) with bf16 scales that give its weights a
    std of 1/sqrt(fan_in), plus its `weight_shape`; or in FP8 blocks as DeepSeek-V3 publishes
    them (every Linear but lm_head: e4m3 `weight` and a float32 `weight_scale_inv` a block).
    Made on `device` a layer at a time, so the host holds one layer. Returns the bytes written."""
    import torch
    from safetensors.torch import save_file

    from ember.models.tiny import _deepseek_layer

    deepseek = "kv_lora_rank" in cfg
    if cfg.get("num_experts") and not deepseek:
        raise SystemExit("--weights files: dense Llama-style or DeepSeek-V3 shapes only")
    int4 = _packed_int4(cfg)
    fp8 = _fp8_blocks(cfg)
    gen = torch.Generator(device).manual_seed(seed)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        std = gain / in_features**0.5
        t = torch.randn(out_features, in_features, generator=gen, device=device) * std
        return t.to(torch.bfloat16)

    def norm(size: int) -> torch.Tensor:
        t = 1.0 + 0.1 * torch.randn(size, generator=gen, device=device)
        return t.to(torch.bfloat16)

    def dense_layer(p: str) -> dict[str, torch.Tensor]:
        head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
        q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
        inter = cfg["intermediate_size"]
        return {
            f"{p}.input_layernorm.weight": norm(hidden),
            f"{p}.self_attn.q_proj.weight": linear(q, hidden),
            f"{p}.self_attn.k_proj.weight": linear(kv, hidden),
            f"{p}.self_attn.v_proj.weight": linear(kv, hidden),
            f"{p}.self_attn.o_proj.weight": linear(hidden, q, gain=0.5),
            f"{p}.post_attention_layernorm.weight": norm(hidden),
            f"{p}.mlp.gate_proj.weight": linear(inter, hidden),
            f"{p}.mlp.up_proj.weight": linear(inter, hidden),
            f"{p}.mlp.down_proj.weight": linear(hidden, inter, gain=0.5),
        }

    def packed(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shard with its scheme's Linears as compressed-tensors packs them (or in FP8
        blocks)."""
        if fp8 is not None:
            return fp8_blocks(shard, *fp8)
        if int4 is None:
            return shard
        group, ignore = int4
        out = {}
        for name, t in shard.items():
            module = name.removesuffix(".weight")
            if not name.endswith(".weight") or not _quantized(module, ignore):
                out[name] = t
                continue
            n, k = t.shape
            words = torch.randint(
                -(2**31), 2**31, (n, k // 8), generator=gen, device=device, dtype=torch.int64
            )
            std = float(t.float().std())  # the bf16 weight's, whose place this takes
            scale = torch.full((n, k // group), std / 4.6, device=device)  # nibbles' std: 4.6
            out[f"{module}.weight_packed"] = words.to(torch.int32)
            out[f"{module}.weight_scale"] = scale.to(torch.bfloat16)
            out[f"{module}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
        return out

    def fp8_blocks(shard: dict[str, torch.Tensor], bn: int, bk: int) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in shard.items():
            module = name.removesuffix(".weight")
            # Every Linear (kv_a_proj_with_mqa too) but the router, the embedding and lm_head.
            skip = ("embed_tokens", "lm_head", ".mlp.gate")
            if not name.endswith(".weight") or t.dim() != 2 or module.endswith(skip):
                out[name] = t
                continue
            n, k = t.shape
            # One scale for the whole tensor, written per block: values of std 64 in e4m3
            # (its largest finite value is 448), as a checkpoint's blocks would be.
            scale = float(t.float().std()) / 64
            out[name] = (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            blocks = (-(-n // bn), -(-k // bk))
            out[f"{module}.weight_scale_inv"] = torch.full(blocks, scale, device=device)
        return out

    layers = cfg["num_hidden_layers"]

    def shards() -> Iterator[dict[str, torch.Tensor]]:
        """Made as they are written: the host holds one shard at a time."""
        yield {"model.embed_tokens.weight": linear(vocab, hidden, gain=0.25 * hidden**0.5)}
        for i in range(layers):
            p = f"model.layers.{i}"
            if deepseek:
                yield packed(_deepseek_layer(p, i, cfg, linear, norm, gen))
            else:
                yield packed(dense_layer(p))
        last = {"model.norm.weight": norm(hidden)}
        if not cfg.get("tie_word_embeddings"):
            last["lm_head.weight"] = linear(vocab, hidden, gain=0.25 * hidden**0.5)
        yield packed(last)

    count = layers + 2  # the embedding, a shard a layer, the final norm and LM head
    weight_map, total = {}, 0
    for n, shard in enumerate(shards()):
        name = f"model-{n + 1:05d}-of-{count:05d}.safetensors"
        shard = {k: v.contiguous().cpu() for k, v in shard.items()}
        save_file(shard, str(d / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


EMBER_VARIANTS = {
    "ember": [],
    "ember-no-warmup": ["--no-warmup"],
    "ember-no-host-tier": ["--kv-host-gb", "0"],
    "ember-pages-16": ["--block-size", "16"],  # pages of 16, not the GPU default
    "ember-no-pieces": ["--max-piecewise-tokens", "0"],  # prefill steps launched from Python
}
"""ember at its defaults, and without the start-up warm-up or the host KV tier (whose memory is
pinned in the background while the first requests run) to compare in the same run. A variant
named `VARIANT@DIR` runs the ember package of another tree (an earlier commit's files, e.g.
`git archive HEAD~1 ember | tar -x -C .ab/base` for `ember@.ab/base`): a change's baseline in the
same call."""


def command(engine: str, model: str, port: int, device: str, dummy: bool = True) -> list[str]:
    """The server's command line; `dummy`: weights made in place (`--load-format dummy`), else
    read from the model directory's files (`--weights files`)."""
    load = ["--load-format", "dummy"] if dummy else []
    variant = engine.split("@")[0]
    if variant in EMBER_VARIANTS:
        # -P: not the working directory's ember first (a `@DIR` tree leads PYTHONPATH).
        cmd = [sys.executable, "-P", "-m", "ember.cli", "serve", model, "--device", device]
        if device == "cuda":
            cmd += load
        # --public-metrics: `ember bench` reads the KV-hit and speculative counters there.
        named = ["--port", str(port), "--served-model-name", "m", "--public-metrics"]
        return cmd + EMBER_VARIANTS[variant] + named
    if engine == "vllm":
        return [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            *load, "--port", str(port), "--served-model-name", "m",
        ]  # fmt: skip
    raise ValueError(f"unknown engine {engine!r}")


def environment(engine: str, caches: Path) -> dict[str, str]:
    """The engine's compile caches under `caches` (empty: a fresh machine's first start)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton")}
    if "@" in engine:
        tree = str(Path(engine.split("@", 1)[1]).resolve())
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if engine == "vllm":
        site = os.environ.get("VLLM_SITE", "/tmp/vllm_site")
        env |= {
            "PYTHONPATH": os.pathsep.join([site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "VLLM_CACHE_ROOT": str(caches / "vllm"),
            "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
        }
    return env


def runs_of(engines: str) -> list[tuple[str, str]]:
    """(report key, engine) for each entry of `--engines`; an engine named again runs again
    under `ENGINE#2`, `#3`, ... with its own caches (a fresh start of its own), so an A/B can
    alternate its order in one call (`ember,ember@.ab/base,ember@.ab/base,ember`)."""
    seen: dict[str, int] = {}
    out = []
    for engine in engines.split(","):
        seen[engine] = seen.get(engine, 0) + 1
        out.append((engine if seen[engine] == 1 else f"{engine}#{seen[engine]}", engine))
    return out


def evict_weights(model: Path) -> int:
    """Drops the model's weight files from the page cache, so the next start reads them from the
    disk as a fresh machine's first start does. Returns the bytes evicted."""
    from cold_import import evict

    return evict(sorted(model.glob("*.safetensors")))


def start(cmd: list[str], env: dict[str, str], url: str, log: Path, timeout_s: float):
    """The server's process and its seconds from launch to /health answering 200 (both servers
    answer 503 or nothing while they load)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[2:4]} exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.25)
    stop_processes([proc])
    raise TimeoutError(f"not ready after {timeout_s:.0f} s; see {log}")


def bench(
    url: str, out: Path, name: str, load: tuple[int, int, int], vocab: str, rates=None, seed=0
):
    """One `ember bench --workload random` run: its JSON document. The same seed gives the same
    prompts (on one server, a second run would hit its prefix cache)."""
    n, inp, outp = load
    cmd = [
        sys.executable, "-m", "ember.cli", "bench", "--url", url, "--workload", "random",
        "--num-requests", str(n), "--input-len", str(inp), "--output-len", str(outp),
        "--vocab", vocab, "--out", str(out), "--name", name, "--no-progress",
        "--seed", str(seed),
    ]  # fmt: skip
    if rates:
        cmd += ["--rates", rates]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{name}.json").read_text())


def completion_s(url: str, prompt: list[int]) -> float:
    """Seconds to answer `prompt` (token ids) with one token through /v1/completions."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    req = urllib.request.Request(
        f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        json.loads(r.read())
    return time.monotonic() - t0


def short_prompts(url: str, loads: Loads) -> dict[str, float]:
    """Seconds to answer fresh short prompts alone with one token: median, least, most."""
    import random

    n, length = loads.short
    lo, hi = (int(x) for x in loads.vocab.split(":"))
    rng = random.Random(128)
    times = sorted(
        completion_s(url, [rng.randrange(lo, hi) for _ in range(length)]) for _ in range(n)
    )
    return {"p50_s": times[n // 2], "min_s": times[0], "max_s": times[-1]}


def agent_turns(url: str, loads: Loads) -> dict[str, dict[str, float]]:
    """For each conversation length C: the first turn's seconds (C fresh tokens) and the median
    next turn's (the C cached, `new` tokens more, a different chunk each turn)."""
    import random

    contexts, new, turns = loads.agent
    lo, hi = (int(x) for x in loads.vocab.split(":"))
    result = {}
    for c in contexts:
        rng = random.Random(c)
        conv = [rng.randrange(lo, hi) for _ in range(c)]
        first = completion_s(url, conv)
        nexts = [completion_s(url, conv + [rng.randrange(lo, hi) for _ in range(new)])
                 for _ in range(turns)]  # fmt: skip
        result[str(c)] = {"first_turn_s": first, "next_turn_s": sorted(nexts)[len(nexts) // 2]}
    return result


def run_loads(url: str, out: Path, tag: str, wanted: list[str], loads: Loads, again: bool) -> dict:
    """The loads on one start; `again`: the mixed load a second time (the run-to-run noise that
    the first start's per-request ratio is read against)."""
    result: dict = {}
    for key in ("mixed", "mixed_again") if again else ("mixed",):
        if "mixed" not in wanted:
            break
        # The second run's prompts differ (another seed): a prefix-cache hit is not speed.
        doc = bench(url, out, f"{tag}-{key}", loads.mixed, loads.vocab, seed=int(key != "mixed"))
        result[key] = doc["summary"]
        result[f"{key}_latency_s"] = {
            r["request_id"]: r["e2e"] for r in doc["records"] if r.get("e2e") is not None
        }
    if "b1" in wanted:
        tpots = []
        for i in range(loads.b1[0]):
            doc = bench(url, out, f"{tag}-b1-{i}", (1, *loads.b1[1:]), loads.vocab)
            tpots.append(doc["summary"]["tpot_ms"]["p50"])
        result["b1_tpot_ms"] = sorted(tpots)[len(tpots) // 2]
    if "batches" in wanted:
        sizes, inp, outp = loads.batches
        for b in sizes:
            doc = bench(url, out, f"{tag}-b{b}", (b, inp, outp), loads.vocab, seed=200 + b)
            result[f"b{b}_tpot_ms"] = doc["summary"]["tpot_ms"]["p50"]
    if "sweep" in wanted:
        doc = bench(url, out, f"{tag}-sweep", loads.mixed, loads.vocab, loads.sweep_rates, seed=100)
        result["sweep"] = [{"rate": s["rate"], **s["summary"]} for s in doc["sweep"] or []]
    if "short" in wanted:
        result["short"] = short_prompts(url, loads)
    if "agent" in wanted:
        result["agent"] = agent_turns(url, loads)
    return result


STARTUP_MARKS = (
    "Triton",
    "start-up:",
    "start-up dry run",
    "warm-up:",
    "serving ",
    "captured",
    "read ahead",
    "beside the start-up compile",
    "KV host tier",
    "KV tiers:",
)


def startup_lines(log: Path, limit: int = 40) -> list[str]:
    """The server log's lines about its start (ember's start-up clock, graphs and warm-up) and
    Triton compiling (the start-up count, and each variant compiled on the request path)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    return [line for line in lines if any(m in line for m in STARTUP_MARKS)][:limit]


def first_minute(fresh: dict[str, float], warm: dict[str, float]) -> dict[str, float]:
    """Each request's latency on the fresh start over the same request's on the warm start."""
    ratios = sorted(fresh[k] / warm[k] for k in fresh.keys() & warm.keys() if warm[k] > 0)
    if not ratios:
        return {}
    return {"worst": ratios[-1], "p50": ratios[len(ratios) // 2], "requests": len(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama", choices=sorted(ALL_SHAPES))
    ap.add_argument(
        "--quant",
        choices=sorted(SCHEMES),
        help="the shape's weights in this scheme (no roofline column; --weights files: the INT4 "
        "schemes)",
    )
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument(
        "--max-position",
        type=int,
        help="the config's max_position_embeddings (both servers' context; default: the "
        "shape's): Moonlight's 8,192 is under the agent load's conversations",
    )
    ap.add_argument("--engines", default="ember,vllm")
    ap.add_argument("--loads", default="mixed,b1,sweep,short,agent")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--starts", default="fresh,warm", help="fresh, warm or both (in that order)")
    ap.add_argument(
        "--weights",
        default="dummy",
        choices=["dummy", "files"],
        help="dummy: made in place at load (both servers' --load-format dummy); files: random "
        "bf16 safetensors written once into the model directory and read at every start",
    )
    ap.add_argument(
        "--cold-libs",
        action="store_true",
        help="evict torch's, the NVIDIA wheels' and Triton's libraries and compiled modules from "
        "the page cache before each fresh start (benchmarks/cold_import.py's lists)",
    )
    ap.add_argument(
        "--cold-weights",
        action="store_true",
        help="with --weights files: evict the files from the page cache before each fresh start "
        "(read from the disk, as on a fresh machine; a warm start reads what the fresh one left)",
    )
    args = ap.parse_args()
    wanted = args.loads.split(",")
    if args.device == "cpu":
        from ember.models.tiny import ensure_tiny

        model, loads, gpu = str(ensure_tiny("qwen3")), CPU_LOADS, "cpu"
    else:
        import torch

        cfg = shape_config(args.shape, args.quant, args.layers)
        if args.max_position:
            cfg["max_position_embeddings"] = args.max_position
        model, loads, gpu = str(model_dir(args.shape, cfg)), GPU_LOADS, torch.cuda.get_device_name()
        if args.weights == "files":
            t = time.perf_counter()
            # In a child process: the host memory its safetensors serialization took (a MoE
            # layer's, tens of GB for Kimi K2) goes back to the OS before the servers start;
            # kept in this process, it got this process killed for memory.
            spawn = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                size = pool.submit(write_weights, Path(model), cfg, "cuda").result()
            print(f"wrote {size / 1e9:.1f} GB of weights in {time.perf_counter() - t:.0f} s")
    work = Path(tempfile.mkdtemp(prefix="served-gpu-"))
    shape = "tiny-qwen3" if args.device == "cpu" else args.shape
    if args.device == "cuda" and (args.quant or args.layers):
        shape += f"-{args.quant or 'bf16'}" + (f"-{args.layers}L" if args.layers else "")
    if args.device == "cuda" and args.max_position:
        shape += f"-{args.max_position // 1024}k"
    report: dict = {
        "gpu": gpu,
        "shape": shape,
        "weights": args.weights if args.device == "cuda" else "files",
        "loads": loads.__dict__,
        "engines": {},
    }
    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    out = result_path("served_gpu", gpu, out_dir=out_dir)
    # The roofline counts bf16 bytes: a quantized shape's is benchmarks/quantized_gpu.py's.
    ceiling = args.device == "cuda" and "b1" in wanted and not args.quant
    if ceiling:
        from engine_gpu import copy_bandwidth

        report["b1_bytes"] = b1_bytes(cfg, loads)
        report["copy_bytes_per_s"] = [copy_bandwidth()]
        torch.cuda.empty_cache()
    if args.cold_weights and (args.weights != "files" or args.device != "cuda"):
        raise SystemExit("--cold-weights needs --weights files on cuda")
    report["cold_weights"], report["cold_libs"] = args.cold_weights, args.cold_libs
    for key, engine in runs_of(args.engines):
        slug = key.replace("/", "_")
        caches = work / f"{slug}-caches"  # empty at the first start, kept for the second
        runs = {}
        starts = args.starts.split(",")
        for start_kind in starts:
            # The sweep is a steady state's measure: on the warm start alone when both run (a
            # fresh start's cost shows in the mixed load's first-minute ratio).
            loads_here = [w for w in wanted if w != "sweep" or start_kind == starts[-1]]
            port = free_port("127.0.0.1")
            url = f"http://127.0.0.1:{port}"
            log = work / f"{slug}-{start_kind}.log"
            cmd = command(engine, model, port, args.device, dummy=args.weights == "dummy")
            evicted = 0
            if args.cold_weights and start_kind == "fresh":
                evicted = evict_weights(Path(model))
            if args.cold_libs and start_kind == "fresh":
                from cold_import import evict, library_files, module_files

                evict(library_files() + module_files())
            proc, ready_s = start(cmd, environment(engine, caches), url, log, args.ready_timeout)
            try:
                runs[start_kind] = {
                    "ready_s": ready_s,
                    "weights_evicted_bytes": evicted,
                    **run_loads(
                        url,
                        work / "bench",
                        f"{slug}-{start_kind}",
                        loads_here,
                        loads,
                        again=start_kind == "warm",
                    ),  # fmt: skip
                }
            finally:
                stop_processes([proc], 30.0)
            runs[start_kind]["startup_log"] = startup_lines(log)
            # Written after every start: a run cut short (a device call's time limit) keeps
            # what it finished.
            report["engines"][key] = runs
            out.write_text(json.dumps(report, indent=1))
        if "mixed" in wanted and {"fresh", "warm"} <= runs.keys():
            warm = runs["warm"].pop("mixed_latency_s")
            runs["first_minute"] = first_minute(runs["fresh"].pop("mixed_latency_s"), warm)
            # The same ratio between two runs of one warm server: what noise alone gives.
            runs["warm_again"] = first_minute(runs["warm"].pop("mixed_again_latency_s"), warm)
        report["engines"][key] = runs
    if ceiling:
        report["copy_bytes_per_s"].append(copy_bandwidth())
        torch.cuda.empty_cache()
        roofline_fracs(report)
    print_table(report)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out} (logs and runs in {work})")


def print_table(report: dict) -> None:
    engines = report["engines"]
    print(f"\n## {report['gpu']}, shape {report['shape']}: served, same client\n")
    if "copy_bytes_per_s" in report:
        rates = " and ".join(f"{b / 1e9:,.0f}" for b in report["copy_bytes_per_s"])
        print(f"copy {rates} GB/s (before and after); b1 reads {report['b1_bytes'] / 1e9:.2f} GB")
    print("| | " + " | ".join(f"{e} fresh | {e} warm" for e in engines) + " |")
    print("|---|" + "---|---|" * len(engines))

    def row(label: str, get) -> None:
        cells = []
        for runs in engines.values():
            for kind in ("fresh", "warm"):
                try:
                    cells.append(get(runs[kind]))
                except (KeyError, TypeError):
                    cells.append("-")
        print(f"| {label} | " + " | ".join(cells) + " |")

    row("start to ready", lambda r: f"{r['ready_s']:.1f} s")
    row("mixed, output tok/s", lambda r: f"{r['mixed']['output_throughput']:.0f}")
    row("b1, TPOT p50", lambda r: f"{r['b1_tpot_ms']:.2f} ms")
    row("b1, of the copy roofline", lambda r: f"{r['b1_roofline_frac']:.3f}")
    for b in report["loads"]["batches"][0]:
        row(f"b{b} at once, TPOT p50", lambda r, b=b: f"{r[f'b{b}_tpot_ms']:.2f} ms")
    row(
        f"a fresh {report['loads']['short'][1]}-token prompt alone, TTFT p50 (min-max)",
        lambda r: "{:.1f} ({:.1f}-{:.1f}) ms".format(
            *(r["short"][k] * 1e3 for k in ("p50_s", "min_s", "max_s"))
        ),
    )
    for c in report["loads"]["agent"][0]:
        row(
            f"agent, {c} tokens: first / next turn",
            lambda r, c=c: "{:.1f} / {:.1f} ms".format(
                *(r["agent"][str(c)][k] * 1e3 for k in ("first_turn_s", "next_turn_s"))
            ),
        )
    for e, runs in engines.items():
        for kind in ("fresh", "warm"):
            for s in runs.get(kind, {}).get("sweep", []):
                print(
                    f"{e} {kind}, {s['rate']:g} req/s: {s['output_throughput']:.0f} out tok/s, "
                    f"TTFT p50/p90 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p90']:.0f} ms, "
                    f"TPOT p50/p90 {s['tpot_ms']['p50']:.1f}/{s['tpot_ms']['p90']:.1f} ms"
                )
        for kind in ("fresh", "warm"):
            for line in runs.get(kind, {}).get("startup_log", [])[:8]:
                print(f"{e} {kind} log: {line[-160:]}")
        fm, again = runs.get("first_minute") or {}, runs.get("warm_again") or {}
        if fm:
            print(
                f"\n{e}: first start / warm, per request: worst {fm['worst']:.3f}, p50 {fm['p50']:.3f}"
            )
        if again:
            print(
                f"{e}: warm again / warm (noise), per request: worst {again['worst']:.3f}, "
                f"p50 {again['p50']:.3f}; mixed again "
                f"{runs['warm']['mixed_again']['output_throughput']:.0f} tok/s"
            )


if __name__ == "__main__":
    main()
