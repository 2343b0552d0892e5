"""Build a model from a Hugging Face-format directory: real safetensors weights, or dummy ones."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path

import torch
from torch import nn

from ember.models.checkpoint_files import safetensors_files
from ember.models.config import ModelConfig
from ember.models.quant_weights import quantized_tensors
from ember.models.registry import resolve_architecture
from ember.models.weight_staging import iter_safetensors, iter_staged, release_cached

LOAD_FORMATS = ("auto", "safetensors", "dummy")


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes, made where the parameters live (fast on a GPU).

    Tensor parallel, each rank draws its own slices from the same seed: the parameters come in
    the same order and shapes on every rank, so replicated ones (norms, a MoE router) agree
    across the ranks, but the slices are not those of the one-rank model's draw, whose weights
    a tensor-parallel dummy model therefore does not have."""
    gen_device = next(model.parameters()).device
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    own: set[int] = set()
    for module in model.modules():
        if hasattr(module, "init_dummy"):  # quantized layers draw their own
            module.init_dummy(gen)
            own.update(id(p) for p in module.parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in own:
                continue
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def load_model(
    model_dir: str | Path,
    config: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    max_position: int = 0,
) -> nn.Module:
    model = build_model(model_dir, config, dtype, device, load_format, max_position)
    fill_model(model, model_dir, load_format, dtype, device)
    return model


def fill_model(
    model: nn.Module,
    model_dir: str | Path,
    load_format: str = "auto",
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> None:
    """A built model's parameters filled: drawn (`load_format="dummy"`) or read (`fill_weights`)."""
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        fill_weights(model, model_dir, dtype, device)


def build_model(
    model_dir: str | Path,
    config: ModelConfig | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    max_position: int = 0,
) -> nn.Module:
    """The model with its parameters allocated on `device` and not yet filled (`fill_weights`,
    `WeightsLoading` or `init_dummy_weights` fill them), in eval mode."""
    model_dir = Path(model_dir)
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of {LOAD_FORMATS}")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    config = config or ModelConfig.from_dir(model_dir)
    cls = resolve_architecture(config.architecture)
    if load_format != "dummy":
        safetensors_files(model_dir)  # no checkpoint: said now, before anything is allocated
    with _default_dtype(dtype or config.dtype), torch.device(device), _no_random_init():
        model = cls(config, max_position=max_position)
    return model.eval()


_RANDOM_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)


@contextmanager
def _no_random_init() -> Iterator[None]:
    """torch.nn's random initializers made no-ops while a model is built: every parameter is
    then filled from the checkpoint (the load checks none is missing) or by
    `init_dummy_weights`, so drawing them first is wasted (an 8B model's nn.Linear layers: 66 s
    of a CPU build). Patched where `reset_parameters` looks them up, as transformers does."""
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}

    def skip(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    for name in _RANDOM_INITS:
        setattr(nn.init, name, skip)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def fill_weights(
    model: nn.Module,
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    stop: threading.Event | None = None,
    nice: int = 0,
    release: bool = True,
) -> None:
    """Copy the checkpoint in `model_dir` into the parameters of `model` (`build_model`'s).
    `stop`: once set, the load ends at its next tensor with `LoadStopped`. `nice` and
    `release`: the GPU reader's (weight_staging.iter_staged)."""
    model_dir = Path(model_dir)
    config = model.config
    files = safetensors_files(model_dir)
    # On a GPU the shards are read by several threads into pinned buffers and reach the
    # model as GPU tensors (weight_staging); elsewhere through safetensors' own reads.
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        tensors = iter_staged(files, device, nice=nice, release=release)
    else:
        tensors = iter_safetensors(files)
    # Quantized layers get the checkpoint's tensors as they are; layers the model computes in
    # its dtype get them dequantized.
    with closing(tensors):
        weights = quantized_tensors(tensors, config.quant, model.keeps_dense, dtype or config.dtype)
        loaded = model.load_weights(weights if stop is None else _until(stop, weights))
    check_complete(model, loaded, f"checkpoint in {str(model_dir)!r}")


def check_complete(model: nn.Module, loaded: set[str], source: str) -> None:
    """Raise, naming them, if parameters of `model` are not in `loaded` (the names its
    `load_weights` filled) or if a fused weight (q/k/v, gate/up, an MoE layer's experts), which
    is in `loaded` once any of its checkpoint tensors was, lacks parts: their rows would be
    served as they were allocated. `source` names the checkpoint in the error."""
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        raise ValueError(f"{source} lacks weights: {missing[:8]}")
    parts = [
        f"{name} ({', '.join(gaps[:4])}{', ...' if len(gaps) > 4 else ''})"
        for name in sorted(loaded)
        if (gaps := _missing_parts(model, name))
    ]
    if parts:
        raise ValueError(f"{source} lacks parts of weights: {parts[:8]}")


def _missing_parts(model: nn.Module, name: str) -> list[str]:
    owner_name, _, attr = name.rpartition(".")
    missing = getattr(model.get_submodule(owner_name), "missing_shards", None)
    return missing(attr) if missing is not None else []


class LoadStopped(Exception):
    """A load stopped before its end (`WeightsLoading.close`)."""


def _until(
    stop: threading.Event, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for item in weights:
        if stop.is_set():
            raise LoadStopped("the weights' load was stopped")
        yield item


READERS_NICE = 10
"""The readers of a load beside the start-up compile yield the CPU to it: the dry run is one
Python thread and the compiles up to 15 processes, and the readers' copies out of the page
cache slowed the dry run from 0.9-1.5 s to 1.5-2.8 s beside them (H200, docs/performance.md).
Measured against normal priority (one run each), nice 10 was level within the noise: it is
kept because it costs nothing where the CPU is idle, not for a measured gain."""


class WeightsLoading:
    """`fill_weights` on a thread of its own, so that the engine's start-up compile, its KV
    sizing and its graphs' capture run while the checkpoint is read (ember/engine/core.py).
    They need the parameters' shapes and places, not their values: the parameters are zeroed
    first, so whatever runs before and during the copies reads finite values (a MoE router
    reads no NaN), and a graph captured then reads the weights when it is replayed after
    `wait`. `wait` returns once every weight is in and raises what the load raised; `close`
    stops a load no one will wait for.

    On a GPU the copies run on a stream of the load's own, which begins after the zeroing and
    is synchronized before the thread ends (so all work queued after `wait` sees every
    weight), and never on the device's default stream, which the engine's thread uses
    meanwhile. The engine captures its graphs in thread-local mode, so this thread's
    allocations and copies are not capture errors; the frees that synchronize the device (the
    staging memory's release) wait for `wait` or `close`, on the engine's thread. The dry
    run's cut (`one_layer_of_each_kind`) leaves the module tree as it is, so the load finds
    every parameter by its name while the cut is in force."""

    def __init__(
        self, model: nn.Module, model_dir: str | Path, dtype: torch.dtype, device: torch.device
    ) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        self._cuda = device.type == "cuda"
        self._stream = None
        if self._cuda:
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))  # after the zeroing
        self.seconds = 0.0
        """The load's seconds, from its start to its last copy done."""
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(model, model_dir, dtype, device), name="weights-load"
        )
        self._thread.start()

    def _run(
        self, model: nn.Module, model_dir: str | Path, dtype: torch.dtype, device: torch.device
    ) -> None:
        t = time.perf_counter()
        try:
            with ExitStack() as on:
                if self._stream is not None:
                    torch.cuda.set_device(device)  # (the current device is a thread's own)
                    on.enter_context(torch.cuda.stream(self._stream))
                    on.callback(self._stream.synchronize)  # every copy done, also on failure
                fill_weights(
                    model, model_dir, dtype, device, self._stop, nice=READERS_NICE, release=False
                )
        except BaseException as e:  # handed to wait()
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t

    def wait(self) -> float:
        """Seconds this call waited for the load to end; raises the load's error."""
        t = time.perf_counter()
        self._join()
        if self._error is not None:
            raise self._error
        return time.perf_counter() - t

    def close(self) -> None:
        """Stop the load (at its next tensor) and wait for its thread; its error is dropped."""
        self._stop.set()
        self._join()

    def _join(self) -> None:
        self._thread.join()
        release_cached(self._cuda)  # (idempotent: a second call finds nothing cached)


def weight_bytes_by_kind(model: nn.Module) -> dict[str, int]:
    """The model's parameter bytes by how they are stored: a quantized layer's tensors (packed
    or FP8 values, scales, zero points) under its scheme ("INT4", "FP8"), every other
    parameter under its dtype ("bfloat16", "float32"); shared parameters counted once."""
    kinds: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        quant = getattr(module, "quant", None)
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if quant is not None:
                kind = f"INT{quant.bits}" if quant.kind == "int" else "FP8"
            else:
                kind = str(p.dtype).removeprefix("torch.")
            kinds[kind] = kinds.get(kind, 0) + p.numel() * p.element_size()
    return kinds


def describe_weights(model: nn.Module) -> str:
    """'8.37 GiB (INT4 4.71, bfloat16 3.66)': the weights' size by kind, for the start-up log."""
    kinds = sorted(weight_bytes_by_kind(model).items(), key=lambda kv: -kv[1])
    total = sum(v for _, v in kinds)
    unit, size = ("GiB", 2**30) if total >= 2**30 else ("MiB", 2**20)
    parts = ", ".join(f"{k} {v / size:.2f}" for k, v in kinds)
    return f"{total / size:.2f} {unit} ({parts})"
