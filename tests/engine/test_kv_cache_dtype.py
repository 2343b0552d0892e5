"""An FP8 KV cache (`kv_cache_dtype="fp8"`) through the engine on the CPU. Its blocks hold twice
the tokens; the engine's answers equal those of a float32 cache holding the same FP8-rounded
values (what is stored is all that changes: every read, layout and block id is the float cache's)
on dense, GQA and MLA models; on SmolLM2 every answer equals the unquantized cache's or parts from
it only at a near tie; FP8 blocks move between FP8 engines and are refused by an engine of
another cache dtype, which prefills the prompt itself (their round trip through the host tier is
in tests/models/test_deepseek_v3_kv.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ember.attention.mla as mla
import ember.attention.torch_backend as torch_backend
from ember import LLM, SamplingParams
from ember.cli import build_parser
from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.kernels.kv_dtype import to_cache
from ember.models.config import ModelConfig
from ember.server.args import engine_config_from_args
from tests.engine.test_pd_tensor_parallel import (
    PROMPTS,
    _add,
    _config,
    _disaggregated,
    _Releases,
    _run,
)
from tests.servers import SECRET

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
TEXTS = ["The quick brown fox jumps over", "def add(a, b):\n    return", "1, 2, 3, 4, 5,"]


def _answers(llm: LLM) -> list[tuple[list[int], list[dict]]]:
    outs = llm.generate(TEXTS, GREEDY)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_bad_settings_are_refused_and_fp8_halves_a_block(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'int8'"):
        EngineConfig(model=str(model), kv_cache_dtype="int8")
    cfg = ModelConfig.from_dir(model)
    kw = {"model": str(model), "max_model_len": 64, "kv_cache_memory_bytes": 1 << 20}
    plain = EngineConfig(**kw).resolve(cfg)
    fp8 = EngineConfig(**kw, kv_cache_dtype="fp8").resolve(cfg)
    assert fp8.kv_dtype == FP8 and plain.kv_dtype == torch.float32
    assert plain.kv_block_bytes == 4 * fp8.kv_block_bytes  # float32 elements, one byte each
    assert fp8.num_kv_blocks == 4 * plain.num_kv_blocks  # the same memory, 4x the tokens
    args = build_parser().parse_args(["serve", str(model), "--kv-cache-dtype", "fp8"])
    assert engine_config_from_args(args).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", str(model), "--kv-cache-dtype", "fp4"])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_an_fp8_cache_is_a_float_cache_holding_fp8_values(
    arch: str, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    model = str(tiny_model_dir(arch))
    llm = LLM(model, dtype="float32", kv_cache_dtype="fp8")
    try:
        assert llm.engine.core.runner.kv_cache.dtype == FP8
        got = _answers(llm)
    finally:
        llm.close()
    exact = LLM(model, dtype="float32")
    try:
        unrounded = _answers(exact)
        # The same float32 engine, its writes rounded through FP8 on the way in.
        rounded = lambda x, dtype: to_cache(x, FP8).to(dtype)  # noqa: E731
        monkeypatch.setattr(torch_backend, "to_cache", rounded)
        monkeypatch.setattr(mla, "to_cache", rounded)
        want = _answers(exact)
    finally:
        exact.close()
    gaps = []
    for (tokens, lps), (want_tokens, want_lps), (_, plain_lps) in zip(
        got, want, unrounded, strict=True
    ):
        assert tokens == want_tokens
        for step, want_step, plain_step in zip(lps, want_lps, plain_lps, strict=False):
            for t, lp in step.items():
                assert abs(lp.logprob - want_step[t].logprob) < 1e-5
                if t in plain_step:
                    gaps.append(abs(lp.logprob - plain_step[t].logprob))
    assert max(gaps) > 1e-4  # and the rounding is real: it moves the logprobs


def test_smollm2_answers_part_from_an_exact_cache_only_at_near_ties(smollm2: Path) -> None:
    """SmolLM2 in float32 with an FP8 cache and an exact one: where answers part, the FP8 run's
    token scored within 1 nat of the exact run's best (FP8's rounding, a few percent of each K
    and V element, moves a 135M model's near ties either way, never a clear answer)."""
    chats = [[{"role": "user", "content": f"Write a short note about {t}."}] for t in TOPICS]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=5, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(str(smollm2), dtype="float32", kv_cache_dtype=kv)
        try:
            runs[kv] = [o.outputs[0] for o in llm.chat(chats, params)]
        finally:
            llm.close()
    for exact, fp8 in zip(runs["auto"], runs["fp8"], strict=True):
        a, b = exact.token_ids, fp8.token_ids
        j = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if j is None:
            continue
        scored = {t: v.logprob for t, v in exact.logprobs[j].items()}
        assert b[j] in scored, (j, a[j], b[j])
        assert max(scored.values()) - scored[b[j]] <= 1.0, (j, scored)


TOPICS = ["rivers", "the moon", "bread", "trains", "python lists", "cats", "rain", "chess"]


@pytest.fixture(scope="module")
def fp8_prefill(tiny_model_dir) -> Iterator[tuple[EngineCore, _Releases]]:  # type: ignore[no-untyped-def]
    core = EngineCore(
        _config(
            tiny_model_dir("llama"), kv_role="prefill", kv_transport="shm", kv_cache_dtype="fp8"
        )
    )
    releases = _Releases(core)
    yield core, releases
    releases.close()
    core.close()


def _colocated(model: Path, **kw: object) -> dict[str, list[int]]:
    core = EngineCore(_config(model, **kw))
    try:
        for i, p in enumerate(PROMPTS):
            _add(core, f"r{i}", p, 8, None)
        return _run(core)
    finally:
        core.close()


@pytest.mark.parametrize("decode_kv", ["fp8", "auto"])
def test_fp8_blocks_move_between_fp8_engines_only(
    decode_kv: str, fp8_prefill: tuple[EngineCore, _Releases], tiny_model_dir
) -> None:  # type: ignore[no-untyped-def]
    """An FP8 decode engine reads an FP8 prefill engine's blocks and answers as one FP8 engine
    does; a float32 one refuses them (another layout) and prefills each prompt itself: its own
    answers, every lease released, no block held."""
    model = tiny_model_dir("llama")
    kv = {"kv_cache_dtype": decode_kv}
    decode = EngineCore(
        _config(model, kv_role="decode", kv_transport="shm", cluster_secret=SECRET, **kv)
    )
    try:
        before = decode.stats()
        got = _disaggregated(fp8_prefill, decode, f"dt-{decode_kv}")
        after = decode.stats()
    finally:
        decode.close()
    assert got == _colocated(model, **kv)
    loads = after.remote_kv_loads - before.remote_kv_loads
    failures = after.remote_kv_failures - before.remote_kv_failures
    assert (loads, failures) == ((len(PROMPTS), 0) if decode_kv == "fp8" else (0, len(PROMPTS)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_the_gpu_path_reads_its_fp8_cache_as_the_cpu_does(arch: str, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """float32 on the GPU (Triton writes and reads, CUDA graphs) against float32 on the CPU, both
    over an FP8 cache. MLA reads its prompt's latents from the cache on both; a dense model's
    fresh prompt attends its own unrounded K and V on the GPU (the CPU's through the cache), so
    there the logprobs agree to FP8's rounding and the decode tokens after the first may part at
    a tie."""
    model = str(tiny_model_dir(arch))
    kw = {"dtype": "float32", "kv_cache_dtype": "fp8", "max_model_len": 256, "num_kv_blocks": 256}
    answers = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model, device=device, **kw)
        try:
            assert llm.engine.core.runner.kv_cache.dtype == FP8
            answers[device] = _answers(llm)
        finally:
            llm.close()
            del llm
            gc.collect()  # (the next engine's memory is its own)
            torch.cuda.empty_cache()
    tol = 1e-3 if arch == "deepseek_v3" else 0.1
    for (cpu_tokens, cpu_lps), (gpu_tokens, gpu_lps) in zip(
        answers["cpu"], answers["cuda"], strict=True
    ):
        assert gpu_tokens[0] == cpu_tokens[0]
        if arch == "deepseek_v3":
            assert gpu_tokens == cpu_tokens
        first = next(
            (i for i, (a, b) in enumerate(zip(cpu_tokens, gpu_tokens, strict=True)) if a != b),
            len(cpu_tokens),
        )
        for step in range(first):
            t = cpu_tokens[step]
            assert abs(gpu_lps[step][t].logprob - cpu_lps[step][t].logprob) < tol
