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
from ember.kernels.precompile import precompile, recording

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


class Compiled:
    """A compiled variant as Triton files it: not loaded (module None) until `_init_handles`."""

    def __init__(self, name: str, module: object = None, loads: list | None = None) -> None:
        self.name, self.module, self.loads = name, module, loads

    def _init_handles(self) -> None:
        import threading

        self.loads.append((self.name, threading.current_thread().name))
        if self.name == "too-big":
            raise RuntimeError("out of shared memory")  # left for the launch to raise


class CompilingKernel(FakeKernel):
    """A FakeKernel whose preload does what Triton's does under its asynchronous mode: the cache
    hook first (it must let the preload through), then a compile submitted to the mode, filed
    in the cache when the mode exits."""

    def __init__(self, loads: list, preloads: list, **kw) -> None:
        super().__init__(**kw)
        self.loads, self.preloads = loads, preloads

    def preload(self, data: str) -> None:
        from triton.runtime import _async_compile

        assert _triton_calls_hook(self, data) is False  # the hook lets a preload through
        mode = _async_compile.active_mode.get()
        assert mode is not None
        self.preloads.append(data)
        compiled = Compiled(data, loads=self.loads)
        mode.submit((id(self), data), lambda: compiled, lambda k: self.cache.__setitem__(data, k))


def test_each_variant_compiles_as_it_is_met_then_loads_in_the_pool(monkeypatch) -> None:
    import threading

    from triton import knobs
    from triton.runtime import _async_compile

    from ember.kernels import precompile as pc

    devices: dict[str, int] = {}
    monkeypatch.setattr(
        pc, "_set_device", lambda d: devices.__setitem__(threading.current_thread().name, d)
    )
    loads: list[tuple[str, str]] = []
    preloads: list[str] = []
    loaded = Compiled("v1", module=object(), loads=loads)
    a = CompilingKernel(loads, preloads, compiled={"v1": loaded})
    b = CompilingKernel(loads, preloads)
    before = knobs.runtime.jit_cache_hook

    def run_dry() -> None:
        assert _triton_calls_hook(a, "v1") is True  # compiled already: skipped, not compiled
        assert _triton_calls_hook(a, "v2") is True  # met: its compile starts now
        assert preloads == ["v2"]  # during the dry run, not after it
        assert _triton_calls_hook(a, "v2") is True  # met again: not compiled twice
        assert _triton_calls_hook(b, "w1") is True
        assert _triton_calls_hook(b, "too-big") is True
        assert a.cache["v2"] is pc._SKIPPED  # a later dry launch is a no-op

    done = precompile(run_dry, workers=2)
    assert done.variants == 3 and preloads == ["v2", "w1", "too-big"]
    # When each was met and when its compile ended: the start-up log's critical path.
    assert len(done.timeline) == 3
    assert all(0 <= met <= end <= done.compiled_s for _, met, end in done.timeline)
    assert done.critical(n=1).count("(met") == 1 and "the first met" in done.critical(n=1)
    assert a.cache["v1"] is loaded and a.cache["v2"].name == "v2"
    assert sorted(b.cache) == ["too-big", "w1"]
    # Each new variant's launcher built and binary loaded in the pool, on its device; the one
    # loaded before is left alone, and a load that fails is left for the launch to raise.
    assert sorted(name for name, _ in loads) == ["too-big", "v2", "w1"]
    assert all(t.startswith(PRECOMPILE_THREADS) for _, t in loads)
    assert set(devices.values()) == {0}
    assert knobs.runtime.jit_cache_hook is before
    assert _async_compile.active_mode.get() is None


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
