"""Ahead-of-launch compilation (ember/kernels/precompile.py): launches run dry record each variant
once and are skipped; the recorded variants are handed to Triton's asynchronous mode; on a GPU,
the next launch of a precompiled variant compiles nothing and computes what a plain launch does."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from ember.kernels import compile_log
from ember.kernels.compile_log import PRECOMPILE_THREADS
from ember.kernels.precompile import compile_all, precompile, recording

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeKernel:
    """A JITFunction's in-memory caches, one per device: (kernels by key, ...)."""

    def __init__(self, compiled: dict[str, object] | None = None) -> None:
        self.device_caches = {0: (dict(compiled or {}), None, None, None, None)}

    @property
    def cache(self) -> dict[str, object]:
        return self.device_caches[0][0]


def _triton_calls_hook(kernel: FakeKernel, key: str) -> bool:
    """What Triton does before compiling a variant (JITFunction._call_hook's keywords); the key
    doubles as the serialized specialization here."""
    from triton import knobs

    hook = knobs.runtime.jit_cache_hook
    assert hook is not None
    return hook(
        key=key,
        repr="kernel[...]",
        fn=types.SimpleNamespace(module="m", name="k", jit_function=kernel),
        compile={"key": key, "specialization_data": key, "device": 0, "num_warps": 4},
        is_manual_warmup=False,
        already_compiled=False,
    )


def test_a_dry_run_records_each_new_variant_once_and_launches_nothing() -> None:
    from triton import knobs

    before = knobs.runtime.jit_cache_hook
    a, b = FakeKernel(compiled={"v1": "binary"}), FakeKernel()
    with recording([a]) as found:  # b: as if first imported during the run
        # Triton looks in the kernel's cache first: a compiled variant must not be found there
        # (it would run on the outputs of skipped launches), so the launch reaches the hook.
        assert a.cache == {}
        assert _triton_calls_hook(a, "v1") is True  # skipped, and not recorded: compiled
        assert _triton_calls_hook(a, "v2") is True  # skipped and recorded
        assert _triton_calls_hook(b, "v1") is True
        # Each variant met is filed as a no-op: the next launch neither compiles nor runs.
        assert a.cache["v2"].run(1, 2, 3) is None and set(a.cache) == {"v1", "v2"}
    assert sorted((k is a, d) for k, d in found.values()) == [(False, "v1"), (True, "v2")]
    assert a.cache == {"v1": "binary"} and b.cache == {}  # as before the run
    assert knobs.runtime.jit_cache_hook is before  # restored, also for a later engine


def test_the_hook_and_caches_are_restored_when_the_dry_run_fails() -> None:
    from triton import knobs

    before = knobs.runtime.jit_cache_hook
    a = FakeKernel(compiled={"v1": "binary"})
    with pytest.raises(RuntimeError, match="boom"), recording([a]):
        _triton_calls_hook(a, "v2")
        raise RuntimeError("boom")
    assert knobs.runtime.jit_cache_hook is before
    assert a.cache == {"v1": "binary"}


def test_recorded_variants_are_preloaded_inside_triton_async_mode() -> None:
    from triton.runtime import _async_compile

    seen: list[tuple[str, bool]] = []

    class Kernel:
        device_caches: dict = {}

        def preload(self, data: str) -> None:
            seen.append((data, _async_compile.active_mode.get() is not None))

    k = Kernel()
    compile_all([(k, "x"), (k, "y")], workers=2)
    assert seen == [("x", True), ("y", True)]
    assert _async_compile.active_mode.get() is None
    compile_all([])  # nothing to do: no pool


def test_compiled_variants_are_loaded_in_the_pool_on_their_device(monkeypatch) -> None:
    """After compiling, each variant not yet loaded builds its launcher and loads its binary in
    a pool thread, on its kernel's device; loaded ones and the dry run's no-ops are left alone."""
    import threading

    from ember.kernels import precompile as pc

    devices: dict[str, int] = {}
    monkeypatch.setattr(
        pc, "_set_device", lambda d: devices.__setitem__(threading.current_thread().name, d)
    )
    loads: list[tuple[str, str]] = []

    class Compiled:
        def __init__(self, name: str, module: object = None) -> None:
            self.name, self.module = name, module

        def _init_handles(self) -> None:
            loads.append((self.name, threading.current_thread().name))
            if self.name == "too-big":
                raise RuntimeError("out of shared memory")  # left for the launch to raise

    class Kernel:
        def __init__(self) -> None:
            self.device_caches = {}

        def preload(self, data: str) -> None:
            cache = self.device_caches.setdefault(3, ({}, None))[0]
            cache |= {data: Compiled(data), "old": Compiled("old", module=object())}
            cache["skipped"] = pc._SKIPPED

    k1, k2 = Kernel(), Kernel()
    compile_all([(k1, "a"), (k2, "b"), (k2, "too-big")], workers=2)
    assert sorted(name for name, _ in loads) == ["a", "b", "too-big"]
    assert all(t.startswith(PRECOMPILE_THREADS) for _, t in loads)
    assert devices and set(devices.values()) == {3}


def test_where_no_hook_fires_the_dry_run_simply_runs() -> None:
    ran = []
    done = precompile(lambda: ran.append(1))
    assert ran == [1] and done.variants == 0 and done.dry_s >= 0 and done.compile_s >= 0


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

    assert precompile(launch_all, workers=3).variants == 3
    assert all((y == 7.0).all() for y in outs)  # the dry launches did not run
    variants = [c for cache, *_ in _scale.device_caches.values() for c in cache.values()]
    assert len(variants) == 3 and all(c.module is not None for c in variants)  # loaded ahead
    compiled = log.compiled + log.loaded
    launch_all()
    assert log.compiled + log.loaded == compiled  # found in memory: nothing compiled or loaded
    for s, y in zip(scales, outs, strict=True):
        torch.testing.assert_close(y, x * s)


def test_every_kernel_of_embers_is_found() -> None:
    # In a process of its own: these tests run Triton's interpreter, whose kernels cache nothing.
    code = (
        "from ember.kernels import decode_attention as d, fused_moe as f\n"
        "from ember.kernels.precompile import _loaded_kernels\n"
        "found = _loaded_kernels()\n"
        "assert d._decode_split_kernel in found and f._moe_gemm_kernel in found, found\n"
        "assert all(hasattr(k, 'device_caches') for k in found)\n"
        "print(len(found))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout) >= 5
