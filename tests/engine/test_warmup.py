"""The start-up warm-up (ember/engine/warmup.py): its batch shapes stay inside the step's budgets
and cover what a Triton kernel specializes on; the dummy batches are well formed; running them on a
fresh engine changes nothing a request then computes. On a GPU: after the warm-up, a mixed
workload compiles no kernel on the request path."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.warmup import dummy_inputs, precompile_start_up, warmup_batches
from tests.outside_interpreter import STUB_H100, run_script

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_batches_fit_the_budgets_and_vary_what_kernels_specialize_on() -> None:
    batches = warmup_batches(2048, 64, 4096, graph_batch=32, block_size=16)
    for runs in batches:
        assert len(runs) <= 64 and sum(n for n, _ in runs) <= 2048
        assert all(n + c <= 4096 for n, c in runs)
        decodes = sum(n == 1 for n, _ in runs)
        assert all(n == 1 for n, _ in runs[:decodes])  # decode rows first
    alone = {runs[0][0] for runs in batches if len(runs) == 1}
    # One token, on and off multiples of 16, each prefill tile class (16 to 128 rows), and past
    # half the step's budget (the fused MoE's largest tiles); never the whole budget: no variant
    # depends on it, and a start-up pays each batch's compute.
    assert {1, 2, 15, 16, 17, 40, 100, 1025} <= alone
    assert max(sum(n for n, _ in runs) for runs in batches) <= 1025 + 100

    # A decode row over long contexts: every merge tile, up to the model's length.
    long_rows = {r[0][1] for r in batches if r[0][0] == 1 and len(r) == 1}
    assert {300, 1000, 2000, 4000, 4095} <= long_rows and max(long_rows) == 4095
    assert any(len(r) == 1 and r[0][1] > 0 for r in batches)  # a chunk over a cached prefix
    decode_only = {len(r) for r in batches if all(n == 1 for n, _ in r)}
    assert 33 in decode_only and 64 in decode_only  # past the captured graphs, eager
    assert any(r[0][0] == 1 and r[-1][0] > 1 for r in batches)  # mixed steps
    assert len(batches) == len({tuple(r) for r in batches})
    # The first two reach each prefill tile class (the slowest compiles start first): a decode
    # row, a fresh prompt and a chunk over a cached prefix, up to 64 query rows and past it.
    for runs, small in zip(batches[:2], (True, False), strict=True):
        assert runs[0][0] == 1 and [c > 0 for _, c in runs[1:]] == [False, True]
        assert all((n <= 64) == small for n, _ in runs[1:])


def test_dummy_inputs_are_well_formed_and_refuse_what_a_step_cannot_be(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), num_kv_blocks=16, block_size=4, max_model_len=64)
    runner = llm.engine.core.runner
    ids, pos, md = dummy_inputs(runner, [(1, 5), (1, 2), (6, 3)])
    assert md.num_decodes == 2 and md.query_start_loc_cpu == [0, 1, 2, 8]
    assert md.seq_lens_cpu == [6, 3, 9] and ids.shape == (8,)
    assert pos.tolist() == [5, 2, 3, 4, 5, 6, 7, 8]
    # Each run's new tokens land in its own blocks, after its prefix.
    assert md.slot_mapping.tolist()[:2] == [1 * 4 + 1, 2 * 4 + 2]
    with pytest.raises(ValueError, match="decode rows"):
        dummy_inputs(runner, [(3, 0), (1, 4)])
    with pytest.raises(ValueError, match="blocks in a cache of 16"):
        dummy_inputs(runner, [(1, 63), (64, 0)])
    llm.close()


def test_a_warmed_up_engine_answers_as_a_cold_one(tiny_model_dir) -> None:
    path = str(tiny_model_dir("qwen3"))
    kw = dict(num_kv_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 7] * 3, [11, 12, 13]]
    cold = LLM(path, **kw)
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, params)]
    cold.close()
    warm = LLM(path, **kw)
    core = warm.engine.core
    cache = core.runner.kv_cache
    # On the CPU no Triton hook fires: the batches run for real, over a cache of their own.
    batches = warmup_batches(64, 256, 128, 0, 4)
    assert precompile_start_up(core.runner, batches).variants == 0
    assert core.runner.kv_cache is cache  # the engine's own cache is back, untouched
    got = [o.outputs[0].token_ids for o in warm.generate(prompts, params)]
    assert got == want
    assert core.kv.pool.num_free_blocks == core.kv.pool.num_blocks
    warm.close()


@needs_cuda
@pytest.mark.gpu
def test_after_the_warm_up_a_mixed_workload_compiles_nothing(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("qwen3")), device="cuda", warmup=True, max_model_len=1024)
    log = llm.engine.core.compile_log
    assert log is not None and log.is_ready
    # The decode graphs' variants compiled with the start-up's, not at their capture.
    assert llm.engine.core.runner.graphs.compiled_at_capture == 0
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    prompts = [[7 + i] * n for i, n in enumerate([3, 17, 40, 100, 255, 513])]
    llm.generate(prompts, params)
    llm.generate(prompts[:2], params)  # a prompt again: over its cached prefix
    assert log.late == []
    llm.close()


@pytest.mark.parametrize(("arch", "kinds"), [("llama", 1), ("deepseek_v3", 2)])
def test_a_dry_run_cut_keeps_one_layer_of_each_kind(tiny_model_dir, arch: str, kinds: int) -> None:
    from ember.engine.warmup import dummy_step, one_layer_of_each_kind

    llm = LLM(str(tiny_model_dir(arch)), num_kv_blocks=16, block_size=4, max_model_len=64)
    runner = llm.engine.core.runner
    decoder = runner.model.model
    layers = decoder.layers
    names = dict(runner.model.named_parameters())
    assert len(layers) > kinds
    with one_layer_of_each_kind(runner.model):
        cut = decoder.run_layers
        assert len(cut) == kinds  # DeepSeek: its dense first layer and one MoE layer
        assert len({type(layer.mlp) for layer in cut}) == kinds
        assert all(any(layer is orig for orig in layers) for layer in cut)
        assert dummy_step(runner, [(1, 3), (5, 0)]).shape[0] == 2  # still a whole forward
        # The module tree is untouched: a load on another thread finds every weight by name.
        assert decoder.layers is layers and len(layers) > kinds
        assert dict(runner.model.named_parameters()) == names
        last = f"model.layers.{len(layers) - 1}.self_attn"
        assert runner.model.get_submodule(last) is layers[-1].self_attn
    assert decoder.layers is layers
    assert decoder.run_layers == list(layers)
    llm.close()


@pytest.mark.parametrize(
    ("arch", "overrides", "kept"),
    [
        ("llama", {"num_hidden_layers": 5}, [0, 1]),
        ("deepseek_v3", {"num_hidden_layers": 6, "first_k_dense_replace": 3}, [0, 1, 3, 4]),
    ],
)
def test_a_cut_to_two_layers_of_each_kind_keeps_the_first_two_in_order(
    tmp_path, arch: str, overrides: dict, kept: list[int]
) -> None:
    """The KV sizing's profiled step runs the first two layers of each kind (the second meets a
    residual, as every later one), in the model's order, and the stack comes back after."""
    from ember.engine.warmup import layers_of_each_kind
    from ember.models.loader import load_model
    from ember.models.tiny import make_tiny

    model = load_model(make_tiny(tmp_path / arch, arch, overrides=overrides), load_format="dummy")
    decoder = model.model
    decoder.aux_layers = (2,)
    with layers_of_each_kind(model, 2):
        assert [list(decoder.layers).index(layer) for layer in decoder.run_layers] == kept
        assert decoder.aux_layers == ()
    assert decoder.run_layers == list(decoder.layers) and decoder.aux_layers == (2,)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {"num_hidden_layers": 5}),
        ("qwen3_moe", {"num_hidden_layers": 5}),
        ("deepseek_v3", {"num_hidden_layers": 6, "first_k_dense_replace": 3}),
    ],
)
def test_the_kv_sizings_profile_on_two_layers_of_each_kind_peaks_as_the_whole_stack(
    tmp_path, monkeypatch, arch: str, overrides: dict
) -> None:
    """The profiled step's peak beyond the weights is the same on the cut as on every layer
    (bf16, a 2,048-token step), up to the allocator's rounding, and the cut runs fewer layers.
    The allocated bytes count a whole cached block where the allocator does not split it (a
    remainder under 1 MiB), so they move with its history by up to that much: on an H200 these
    models' peaks were 115,200 bytes apart (llama, qwen3_moe) or equal (deepseek_v3), the 8B
    shape's equal (docs/performance.md)."""
    from ember.engine import model_runner
    from ember.models.tiny import make_tiny

    path = make_tiny(tmp_path / arch, arch, overrides=overrides)
    llm = LLM(
        str(path),
        device="cuda",
        dtype="bfloat16",
        max_model_len=1024,
        num_kv_blocks=64,
        warmup=False,
        enforce_eager=True,
    )
    runner = llm.engine.core.runner
    ran: list[int] = []
    for i, layer in enumerate(runner.model.model.layers):
        layer.register_forward_hook(lambda *a, i=i: ran.append(i))
    cut = runner.profile_peak_bytes(2048, 1024, 8)
    cut_ran, ran[:] = list(ran), []
    monkeypatch.setattr(model_runner, "PROFILED_LAYERS_OF_EACH_KIND", 100)  # every layer
    whole = runner.profile_peak_bytes(2048, 1024, 8)
    llm.close()
    assert len(cut_ran) < len(ran) == overrides["num_hidden_layers"]
    assert whole > 0 and abs(cut - whole) < 1 << 20


def test_a_start_up_compile_that_does_not_fit_is_skipped_and_leaves_the_cache(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=16, block_size=4, max_model_len=64)
    runner = llm.engine.core.runner
    cache = runner.kv_cache

    def no_room(num_blocks: int) -> None:
        raise torch.OutOfMemoryError(f"{num_blocks} blocks")

    monkeypatch.setattr(runner, "allocate_kv_cache", no_room)
    assert precompile_start_up(runner, [[(5, 0)], [(1, 3)]]) is None
    assert runner.kv_cache is cache
    llm.close()


@pytest.mark.parametrize("after", [0, 1, 5])
def test_the_graphs_dry_run_comes_after_the_probes(tiny_model_dir, monkeypatch, after) -> None:
    """The graphs' sizes (most of a dry run's time) run after the first `graphs_after` batches,
    which reach the slowest compiles (their attention alone runs before anything); past the
    last batch they run last."""
    from ember.engine import warmup

    llm = LLM(str(tiny_model_dir("qwen3")), num_kv_blocks=64, block_size=4, max_model_len=128)
    order: list[object] = []
    real = warmup.dummy_step

    def step(runner, runs, max_seq_len=None):
        order.append(runs)
        return real(runner, runs, max_seq_len)

    monkeypatch.setattr(warmup, "dummy_step", step)
    probe = warmup.probe_attention
    monkeypatch.setattr(
        warmup, "probe_attention", lambda r, runs: (order.append(("probe", runs)), probe(r, runs))
    )
    batches = [[(5, 0)], [(1, 3), (4, 0)], [(2, 6)]]
    done = precompile_start_up(
        llm.engine.core.runner, batches, lambda: order.append("graphs"), graphs_after=after
    )
    assert done is not None
    at = min(after, len(batches))
    # The probes' attention alone first (before any layer's GEMMs), then the probes themselves.
    probes = [("probe", b) for b in batches[:at]]
    assert order == probes + batches[:at] + ["graphs"] + batches[at:]
    llm.close()


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_probe_runs_one_attention_call_and_none_for_mla(tiny_model_dir, arch) -> None:
    from ember.engine.warmup import probe_attention

    llm = LLM(str(tiny_model_dir(arch)), num_kv_blocks=64, block_size=4, max_model_len=128)
    runner = llm.engine.core.runner
    calls: list[tuple] = []
    forward = runner.backend.forward

    def counted(q, k, v, cache, md, scale, kv_written=False, out=None):
        calls.append((q.shape, k.shape, v.shape, md.num_decodes, md.num_seqs))
        return forward(q, k, v, cache, md, scale, kv_written, out)

    runner.backend.forward = counted
    probe_attention(runner, [(1, 7), (2, 0), (2, 7)])
    cfg = runner.config
    if cfg.uses_mla:
        assert calls == []
    else:
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        assert calls == [((5, h, d), (5, kv, d), (5, kv, d), 1, 3)]
    llm.close()


def test_a_probe_needs_no_model_and_early_compiles_start_only_on_a_gpu(tiny_model_dir) -> None:
    """The probes run on a stand-in (the model's shape, a one-layer cache, the backend) before
    the weights load: the same attention call a runner makes. Off a GPU nothing starts early."""
    from ember.engine.warmup import AttentionOnly, compile_probes_early, probe_attention

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=4, max_model_len=128)
    runner = llm.engine.core.runner
    stand_in = AttentionOnly(runner.config, 4, runner.dtype, "cpu", runner.backend)
    calls: list[tuple] = []
    forward = runner.backend.forward

    def counted(q, k, v, cache, md, scale, kv_written=False, out=None):
        calls.append((q.shape, cache.shape, md.num_decodes, md.num_seqs))
        return forward(q, k, v, cache, md, scale, kv_written, out)

    runner.backend.forward = counted
    runs = [(1, 7), (2, 0), (2, 7)]
    stand_in.allocate_kv_cache(8)
    probe_attention(stand_in, runs)
    probe_attention(runner, runs)
    assert len(calls) == 2 and calls[0][0] == calls[1][0] and calls[0][2:] == calls[1][2:]
    assert calls[0][1] == runner.kv_cache[:8, 0].shape  # layer 0's cache, one layer held
    assert compile_probes_early(stand_in, [runs]) is None  # on the CPU: nothing to start
    llm.close()


SAME = """
import json, sys
import torch
"""
SAME += (
    STUB_H100
    + """
from ember.attention.triton_backend import TritonAttentionBackend
from ember.engine.warmup import PROBES, AttentionOnly, blocks_of, probe_attention, warmup_batches
from ember.kernels.precompile import recording
from ember.models.config import ModelConfig

cfg = ModelConfig.from_dir(sys.argv[1])
probes = warmup_batches(2048, 64, 1024, 32, 16)[:PROBES]


def met(layers):
    probe = AttentionOnly(cfg, 16, torch.bfloat16, "cpu", TritonAttentionBackend())
    planes, heads, dim = cfg.kv_cache_dims
    n = max(blocks_of(r, 16) for r in probes)
    probe.kv_cache = torch.zeros((n, layers, planes, 16, heads, dim), dtype=torch.bfloat16)
    with recording() as found:
        for runs in probes:
            probe_attention(probe, runs)
    return sorted(f"{k.__name__} {d}" for k, d in found.values())


one, every = met(1), met(cfg.num_hidden_layers)
print(json.dumps({"kernels": sorted({v.split()[0] for v in one}), "same": one == every}))
"""
)


def test_the_stand_ins_one_layer_cache_meets_the_runners_variants(tiny_model_dir, tmp_path):
    """The early compiles are the start-up's own only if the probe over a one-layer cache
    specializes the kernels as over the runner's whole cache (its strides differ). Triton's
    real specialization (not the interpreter) for an H100 target, on the CPU."""

    out = run_script(SAME, tmp_path, str(tiny_model_dir("llama")))
    assert out["same"] is True
    assert {"_decode_split_kernel", "_prefill_kernel"} <= set(out["kernels"])


EARLY = """
import json, sys
import torch
from ember.attention.triton_backend import TritonAttentionBackend
from ember.engine.warmup import PROBES, AttentionOnly, compile_probes_early, warmup_batches
from ember.models.config import ModelConfig

cfg = ModelConfig.from_dir(sys.argv[1])
stand_in = AttentionOnly(cfg, 16, torch.bfloat16, "cuda", TritonAttentionBackend())
procs = compile_probes_early(stand_in, warmup_batches(2048, 64, 1024, 32, 16)[:PROBES])
answers = [f.result(timeout=120) for f in list(procs._futures.values())]
print(json.dumps({
    "submitted": procs.submitted, "forked": procs.forked,
    "compiled": [not a.cache_hit for a in answers], "cache_left": stand_in.kv_cache.numel(),
}))
procs.close()
"""


@needs_cuda
@pytest.mark.gpu
def test_early_compiles_start_before_a_model_and_compile_in_workers(
    tiny_model_dir, tmp_path
) -> None:
    """In a fresh process (nothing compiled in memory) with an empty Triton cache: the probes'
    attention variants and the sampler's are submitted before any model exists and compile in
    forked workers."""
    out = run_script(EARLY, tmp_path, str(tiny_model_dir("llama")))
    assert out["submitted"] >= 3 and 1 <= out["forked"] <= out["submitted"]
    assert out["compiled"] == [True] * out["submitted"]
    assert out["cache_left"] == 0  # the probes' cache is given back


def test_an_early_compile_that_fails_is_only_skipped(tiny_model_dir, monkeypatch, caplog) -> None:
    """A probe that raises before the model loads (say, a backend the stand-in does not suit)
    costs the start-up nothing: no workers are left, and the dry run after the load does it all."""
    from ember.engine import warmup
    from ember.engine.warmup import AttentionOnly, compile_probes_early
    from ember.kernels import compile_workers
    from ember.models.config import ModelConfig

    closed: list[bool] = []

    class Workers:
        def __init__(self, limit: int) -> None:
            pass

        def submit(self, *a):
            return None

        def close(self) -> None:
            closed.append(True)

    def boom(runner, runs):
        raise RuntimeError("this backend needs the model")

    monkeypatch.setattr(compile_workers, "CompileWorkers", Workers)
    monkeypatch.setattr(warmup, "probe_attention", boom)
    cfg = ModelConfig.from_dir(str(tiny_model_dir("llama")))
    stand_in = AttentionOnly(cfg, 4, torch.float32, "cpu", None)
    stand_in.device = torch.device("cuda")  # past the CPU check; nothing is allocated there
    monkeypatch.setattr(stand_in, "allocate_kv_cache", lambda n: None)
    import triton.runtime

    monkeypatch.setattr(
        triton.runtime.driver,
        "_active",
        type("D", (), {"get_current_target": lambda self: None})(),
        raising=False,
    )
    assert compile_probes_early(stand_in, [[(1, 3)]]) is None
    assert closed == [True] and "early start-up compile skipped" in caplog.text


@needs_cuda
@pytest.mark.gpu
def test_on_a_gpu_the_weights_load_beside_the_start_up_compile(tiny_model_dir, tmp_path) -> None:
    """The checkpoint loads on a thread while the dry run runs on the parameters' places
    (ember/models/loader.py: WeightsLoading): the start-up's phases say so, the greedy tokens are
    those of a start that loaded first (warm-up off: no dry run, no thread), and a checkpoint
    that lacks a weight fails the start with the load's error and leaves no thread behind."""
    import threading

    from tests.models.checkpoint_edits import copy_without

    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 200, 17, 3], list(range(40, 90))]
    outs = {}
    for warmup in (True, False):
        llm = LLM(
            str(path),
            device="cuda",
            warmup=warmup,
            max_model_len=512,
            dtype="float32",
            num_kv_blocks=256,  # not sized from free memory: earlier tests' engines may hold it
        )
        phases = llm.engine.core.startup.phases
        assert ("model" in phases) == warmup and "load" in phases
        outs[warmup] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.close()
    assert outs[True] == outs[False]

    copy_without(path, tmp_path, "model.layers.1.self_attn.o_proj.weight")
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(str(tmp_path), device="cuda", warmup=True, max_model_len=512, num_kv_blocks=256)
    assert not any(t.name == "weights-load" and t.is_alive() for t in threading.enumerate())


@needs_cuda
@pytest.mark.gpu
def test_on_a_gpu_the_graphs_are_captured_while_the_weights_load(
    tiny_model_dir, monkeypatch
) -> None:
    """The decode and piecewise graphs are captured with the load still under way. Here the
    loader waits for a decode graph's capture to be under way, and the capture waits until the
    loader has allocated fresh device memory (as each of its chunks does), copied into it and
    synchronized its stream: calls a capture in the default global mode would fail on, made by
    another thread. The graphs replay the weights that arrived after they were captured, so the
    greedy tokens are those of a start that loaded first (warm-up off: no thread)."""
    import threading

    from ember.engine.cuda_graphs import DecodeGraphs
    from ember.models import loader

    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 200, 17, 3], list(range(40, 90))]
    kwargs = dict(device="cuda", max_model_len=512, dtype="float32", num_kv_blocks=256)
    first = LLM(str(path), warmup=False, **kwargs)
    want = [o.outputs[0].token_ids for o in first.generate(prompts, params)]
    first.close()

    capturing, allocated = threading.Event(), threading.Event()
    real_reader, real_forward = loader.iter_staged, DecodeGraphs._forward

    def reader(*args: object, **kw: object):
        assert capturing.wait(20)
        fresh = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")  # more than is cached
        fresh[: 1 << 20].copy_(torch.ones(1 << 20, dtype=torch.uint8), non_blocking=True)
        torch.cuda.current_stream().synchronize()
        del fresh
        allocated.set()
        yield from real_reader(*args, **kw)

    def forward(self, size: int, ctx: object) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() and not capturing.is_set():
            capturing.set()
            assert allocated.wait(20)  # the loader's calls, made while this capture is open
        return real_forward(self, size, ctx)

    monkeypatch.setattr(loader, "iter_staged", reader)
    monkeypatch.setattr(DecodeGraphs, "_forward", forward)
    llm = LLM(str(path), warmup=True, **kwargs)
    assert allocated.is_set() and llm.engine.core.runner.graphs.graphs
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.close()
    assert got == want
