"""Triton compile workers (ember/kernels/compile_workers.py): a variant met by a dry run
compiles in a worker process forked from the engine, and the engine's own compile of it then
finds it in Triton's on-disk cache (the keys agree); a failed or dead worker leaves the compile
to the engine; no worker outlives the compile. Run without a GPU: a stub driver names an H100 as the target (Triton compiles for it with
its own ptxas, no GPU needed), in a subprocess without TRITON_INTERPRET (the test session's
kernels are interpreted)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.outside_interpreter import STUB_H100, run_script

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    from ember.kernels import compile_log, compile_workers
    from ember.kernels.precompile import precompile
    from ember.kernels.rmsnorm import rms_norm

    mode = sys.argv[1]
    hits = []
    log = compile_log.CompileLog()

    def listen(**kw):
        hits.append(kw["cache_hit"])
        log(**kw)

    def children():
        me = str(os.getpid())
        kids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                kids.append(stat.parent.name)
        return kids

    knobs.compilation.listener = listen
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    w = torch.randn(256, dtype=torch.bfloat16)
    if mode == "lookup":
        from ember.kernels.compile_workers import compile_variant, in_cache, variant_source
        from ember.kernels.precompile import recording

        with recording() as found:
            rms_norm(x, w, 1e-6)
        (kernel, data), = found.values()
        target = GPUTarget("cuda", 90, 32)
        src, options = variant_source(kernel, data, target)
        before = in_cache(src, target, options)
        compile_variant(kernel.__module__, kernel.fn.__name__, data, ["cuda", 90, 32])
        print(json.dumps({"before": before, "after": in_cache(src, target, options)}))
        sys.exit(0)
    procs = None
    if mode in ("early", "late-answer"):  # met before "the model loads", met again after
        from ember.kernels.precompile import recording

        if mode == "late-answer":  # the worker files the binary, then answers a second later
            compile = compile_workers.compile_variant
            compile_workers.compile_variant = lambda *a: (compile(*a), time.sleep(1.0))[0]
        procs = compile_workers.CompileWorkers(2)
        target = GPUTarget("cuda", 90, 32)
        found = []
        with recording(on_found=lambda k, d: found.append(procs.submit(k, d, target) and (k, d))):
            rms_norm(x, w, 1e-6)
        assert procs.submitted == 1 and procs.forked == 1
        if mode == "late-answer":  # the dry run meets it once it is in the cache, unanswered
            (kernel, data), = found
            deadline = time.monotonic() + 60
            while not compile_workers.cached(kernel, data, target):
                assert time.monotonic() < deadline, "the worker never filed its binary"
                time.sleep(0.02)
            future = procs._futures[next(iter(procs._futures))]
            assert not future.done() and not procs.queued(future)
    if mode == "worker-dies":
        compile_workers._work = lambda job_r, results_w: os._exit(3)
    elif mode == "bad-module":
        compile_workers.kernel_address = lambda kernel: ("ember.no_such_module", "k")
    done = precompile(
        lambda: rms_norm(x, w, 1e-6), workers=2, processes=mode != "threads", procs=procs
    )
    if procs is not None:  # met again: the same job, not a second compile
        assert not procs.queued(procs._futures[next(iter(procs._futures))])
        assert (procs.submitted, procs.reused) == (1, 1)
    deadline = time.monotonic() + 30
    while children() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({
        "variants": done.variants, "workers": done.workers, "hits": hits,
        "compiled": log.compiled, "loaded": log.loaded, "compile_s": log.compile_s,
        "children_left": children(),
    }))
    """
)


def _run(mode: str, tmp_path: Path) -> dict:
    return run_script(STUB_H100 + SCRIPT, tmp_path, mode)


def test_a_variant_compiles_in_a_forked_worker_and_the_engine_only_loads_it(
    tmp_path: Path,
) -> None:
    out = _run("procs", tmp_path)
    assert (out["variants"], out["workers"]) == (1, 1)
    # The engine's compile found the worker's binary: a cache hit, counted as compiled (by the
    # worker, in its seconds), not as loaded.
    assert out["hits"] == [True]
    assert (out["compiled"], out["loaded"]) == (1, 0)
    assert out["compile_s"] > 0
    assert out["children_left"] == []  # the worker exited and was reaped
    # A second start on the same cache: nothing is compiled, the variant is loaded.
    again = _run("procs", tmp_path)
    assert again["hits"] == [True]
    assert (again["compiled"], again["loaded"]) == (0, 1)


def test_a_variant_started_before_the_dry_run_is_compiled_once_and_loaded(
    tmp_path: Path,
) -> None:
    """`warmup.compile_probes_early`'s path: a variant submitted before the start-up's dry run
    (while the model loads) is met again by it and waited for, not compiled a second time."""
    out = _run("early", tmp_path)
    assert (out["variants"], out["workers"]) == (1, 1)  # one worker forked, for the early job
    assert out["hits"] == [True] and (out["compiled"], out["loaded"]) == (1, 0)
    assert out["children_left"] == []


def test_a_variant_its_worker_filed_but_has_not_answered_for_counts_as_compiled(
    tmp_path: Path,
) -> None:
    """The dry run meets a variant whose worker has put it in the on-disk cache and not yet
    answered: it was compiled by this start (not an earlier one's cache hit), so the core
    waits for the answer and counts it as compiled (a fresh start's log once said "23
    compiled, 1 loaded" for this)."""
    out = _run("late-answer", tmp_path)
    assert out["hits"] == [True] and (out["compiled"], out["loaded"]) == (1, 0)
    assert out["children_left"] == []


def test_the_cache_lookup_finds_what_the_worker_compiled(tmp_path: Path) -> None:
    assert _run("lookup", tmp_path) == {"before": False, "after": True}


def test_a_worker_that_dies_leaves_the_compile_to_the_engine(tmp_path: Path) -> None:
    out = _run("worker-dies", tmp_path)
    assert out["variants"] == 1
    assert out["hits"] == [False]  # compiled in the engine's own thread
    assert (out["compiled"], out["loaded"]) == (1, 0)
    assert out["children_left"] == []


def test_a_job_the_worker_fails_is_compiled_by_the_engine(tmp_path: Path) -> None:
    out = _run("bad-module", tmp_path)
    assert out["hits"] == [False]
    assert (out["compiled"], out["loaded"]) == (1, 0)
    assert out["children_left"] == []


def test_without_processes_the_threads_compile(tmp_path: Path) -> None:
    out = _run("threads", tmp_path)
    assert (out["variants"], out["workers"], out["hits"]) == (1, 0, [False])


@pytest.mark.gpu
def test_on_a_gpu_a_workers_variant_launches_and_computes_the_reference() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from triton import knobs

    from ember.kernels.precompile import precompile
    from ember.kernels.rmsnorm import rms_norm

    x = torch.randn(5, 3, 48, dtype=torch.bfloat16, device="cuda")  # a shape no other test uses
    w = torch.randn(48, dtype=torch.bfloat16, device="cuda")
    hits: list[bool] = []
    previous = knobs.compilation.listener

    def listen(**kw) -> None:
        hits.append(kw["cache_hit"])
        if previous is not None:
            previous(**kw)

    knobs.compilation.listener = listen
    try:
        done = precompile(lambda: rms_norm(x, w, 1e-6), workers=2, processes=True)
    finally:
        knobs.compilation.listener = previous
    assert (done.variants, done.workers) == (1, 1)
    assert hits == [True]  # the worker's binary, found in the cache
    out = rms_norm(x, w, 1e-6)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    torch.testing.assert_close(out, normed * w, rtol=2e-2, atol=2e-2)
