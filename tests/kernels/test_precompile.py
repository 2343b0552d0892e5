"""Ahead-of-launch compilation (ember/kernels/precompile.py): launches run dry record each variant
once and are skipped; the recorded variants are handed to Triton's asynchronous mode; on a GPU,
the next launch of a precompiled variant compiles nothing and computes what a plain launch does."""

from __future__ import annotations

import types

import pytest
import torch

from ember.kernels import compile_log
from ember.kernels.precompile import compile_all, precompile, recording

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _triton_calls_hook(fn: object, data: str) -> bool:
    """What Triton does before compiling a variant (JITFunction._call_hook's keywords)."""
    from triton import knobs

    hook = knobs.runtime.jit_cache_hook
    assert hook is not None
    return hook(
        key=data,
        repr="kernel[...]",
        fn=types.SimpleNamespace(module="m", name="k", jit_function=fn),
        compile={"key": data, "specialization_data": data, "num_warps": 4},
        is_manual_warmup=False,
        already_compiled=False,
    )


def test_a_dry_run_records_each_variant_once_and_skips_it() -> None:
    from triton import knobs

    before = knobs.runtime.jit_cache_hook
    a, b = object(), object()
    with recording() as found:
        assert _triton_calls_hook(a, '{"v": 1}') is True  # skip: no compile, no launch
        assert _triton_calls_hook(a, '{"v": 1}') is True
        assert _triton_calls_hook(a, '{"v": 2}') is True
        assert _triton_calls_hook(b, '{"v": 1}') is True
    assert sorted(d for _, d in found.values()) == ['{"v": 1}', '{"v": 1}', '{"v": 2}']
    assert knobs.runtime.jit_cache_hook is before  # restored, also for a later engine


def test_the_hook_is_restored_when_the_dry_run_fails() -> None:
    from triton import knobs

    before = knobs.runtime.jit_cache_hook
    with pytest.raises(RuntimeError, match="boom"), recording():
        raise RuntimeError("boom")
    assert knobs.runtime.jit_cache_hook is before


def test_recorded_variants_are_preloaded_inside_triton_async_mode() -> None:
    from triton.runtime import _async_compile

    seen: list[tuple[str, bool]] = []

    class Kernel:
        def preload(self, data: str) -> None:
            seen.append((data, _async_compile.active_mode.get() is not None))

    k = Kernel()
    compile_all([(k, "x"), (k, "y")], workers=2)
    assert seen == [("x", True), ("y", True)]
    assert _async_compile.active_mode.get() is None
    compile_all([])  # nothing to do: no pool


def test_where_no_hook_fires_the_dry_run_simply_runs() -> None:
    ran = []
    assert precompile(lambda: ran.append(1)) == 0
    assert ran == [1]


@needs_cuda
@pytest.mark.gpu
def test_a_precompiled_variant_launches_without_compiling_and_computes_the_same(
    tmp_path,
) -> None:
    import triton
    import triton.language as tl

    log = compile_log.install()
    log.begin()

    @triton.jit
    def _scale(x_ptr, y_ptr, n, S: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=ok) * S, mask=ok)

    x = torch.randn(1000, device="cuda")
    scales = [1.5 + (tmp_path.stat().st_ino % 1000) + i for i in range(3)]  # unseen constexprs
    outs = [torch.full_like(x, 7.0) for _ in scales]

    def launch_all() -> None:
        for s, y in zip(scales, outs, strict=True):
            _scale[(4,)](x, y, x.numel(), S=s, BLOCK=256)

    assert precompile(launch_all, workers=3) == 3
    assert all((y == 7.0).all() for y in outs)  # the dry launches did not run
    compiled = log.compiled + log.loaded
    launch_all()
    assert log.compiled + log.loaded == compiled  # found in memory: nothing compiled or loaded
    for s, y in zip(scales, outs, strict=True):
        torch.testing.assert_close(y, x * s)
