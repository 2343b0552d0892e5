"""Triton's compiled kernels live in ember's home, and compilations are counted: at start-up,
and by name once the engine is ready (a compile on the request path is a warm-up to add)."""

from __future__ import annotations

import logging
import types
from pathlib import Path

import pytest
import torch

from ember.kernels import compile_log
from ember.kernels.compile_log import CompileLog, describe, use_ember_cache

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_the_cache_goes_to_embers_home_unless_triton_cache_dir_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_ember_cache() == str(tmp_path / "home" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert use_ember_cache() == str(tmp_path / "mine")


def _compile(log: CompileLog, name: str, hit: bool, times=None) -> None:
    log(
        src=types.SimpleNamespace(name=name),
        metadata={},
        metadata_group={},
        times=times,
        cache_hit=hit,
    )


def test_compilations_are_counted_and_late_ones_named(caplog: pytest.LogCaptureFixture) -> None:
    log = CompileLog()
    _compile(log, "_rms_norm_kernel", hit=False)
    _compile(log, "_rotary_kernel", hit=True)
    assert (log.compiled, log.loaded, log.late) == (1, 1, [])
    with caplog.at_level(logging.INFO, logger="ember.kernels.compile_log"):
        log.ready()
        _compile(log, "_moe_gemm_kernel", hit=True)  # loaded: not a compile
        _compile(log, "_moe_gemm_kernel", hit=False)
    assert (log.compiled, log.loaded, log.late) == (2, 2, ["_moe_gemm_kernel"])
    assert "1 compiled (0.0 s), 1 loaded" in caplog.text
    assert "compiled _moe_gemm_kernel on the request path" in caplog.text


def test_a_new_engine_start_counts_afresh_and_compile_seconds_add_up() -> None:
    log = CompileLog()
    _compile(log, "_a", hit=False)
    log.ready()
    _compile(log, "_b", hit=False)
    assert log.late == ["_b"]
    log.begin()  # a second engine in the same process: its start-up is not "late"
    times = types.SimpleNamespace(
        ir_initialization=100_000, lowering_stages=[("ttir", 200_000), ("cubin", 700_000)],
        store_results=0,
    )  # fmt: skip
    _compile(log, "_c", hit=False, times=times)
    _compile(log, "_d", hit=True)
    assert (log.compiled, log.loaded, log.late, log.is_ready) == (1, 1, [], False)
    assert log.compile_s == pytest.approx(1.0)


def test_a_variant_is_described_by_its_specialization() -> None:
    fn = types.SimpleNamespace(arg_names=["q_ptr", "num_seqs", "stride_bt", "BLOCK_M"])
    src = types.SimpleNamespace(
        name="_prefill_kernel",
        fn=fn,
        constants={(1,): 1, (3,): 64},
        attrs={(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]},
    )
    assert describe(src) == "_prefill_kernel(num_seqs=1, BLOCK_M=64; 16 | q_ptr, stride_bt)"
    assert describe(types.SimpleNamespace(name="_x")) == "_x"


@needs_cuda
@pytest.mark.gpu
def test_a_new_variant_is_compiled_once_then_served_from_memory(tmp_path: Path) -> None:
    import triton
    import triton.language as tl

    log = compile_log.install()

    @triton.jit
    def _fill(x_ptr, V: tl.constexpr):
        tl.store(x_ptr, V)

    x = torch.zeros(1, device="cuda")
    before = log.compiled + log.loaded
    value = float(tmp_path.stat().st_ino % 1000003)  # a constexpr no earlier run used
    _fill[(1,)](x, V=value)
    _fill[(1,)](x, V=value)
    assert x.item() == value
    assert log.compiled + log.loaded == before + 1


def test_variants_compiled_ahead_by_precompile_threads_are_not_listed_as_missed() -> None:
    import threading

    log = CompileLog()
    log.mark()
    worker = threading.Thread(
        target=_compile, args=(log, "_ahead", False), name=f"{compile_log.PRECOMPILE_THREADS}_0"
    )
    worker.start()
    worker.join()
    _compile(log, "_at_first_launch", hit=False)
    assert log.compiled == 2 and log.since_mark == ["_at_first_launch"]
