"""Piecewise CUDA graphs for steps that prefill: everything but attention.

A step with prompt tokens in it (a new turn beside running decodes, a prompt's chunk) cannot
replay a decode graph: its attention's grid and metadata follow the step's sequences. Launched
from Python, its ~400 kernels cost more host time than GPU time: a step of 16 decodes and a
64-token prompt took 32 ms on an H200 for 5.7 ms of kernels (Triton's launch path is ~45-65 us a
kernel). Here the forward pass of a padded token count is captured as one graph per stretch
between two attention calls (the norms, the projections with the rotation and its KV-cache write,
the MLP, the next layer's norm) and replayed piece by piece, with each layer's attention launched
eagerly in between on the step's real metadata: 33 graph launches and the attention kernels
instead of every kernel. vLLM does the same through torch.compile's graph splitting; ember's
models are plain Python, so the split happens at capture: the attention backend the model calls
ends the current graph, and begins the next one.

The pieces read and write fixed buffers: the step's ids, positions and KV slots (padding rows
write no slot), and each attention call's q, k and v (copied there at the end of a piece) and its
output (read by the next piece). Only model classes that say so (`piecewise_graphs = True`: one
attention call a layer through `ForwardContext.backend`, nothing read on the host) take this
path; a capture that does not meet one call a layer is dropped with a warning.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ember.attention.backend import AttentionBackend
from ember.attention.context import ForwardContext
from ember.attention.metadata import AttentionMetadata
from ember.attention.mla import mla_attention
from ember.distributed.state import current
from ember.engine.cuda_graphs import CAPTURE_MODE
from ember.engine.warmup import one_layer_of_each_kind
from ember.kernels.precompile import precompile

if TYPE_CHECKING:
    from torch import nn

log = logging.getLogger(__name__)

PIECEWISE_STEP = 128
"""Token counts captured: 16, 32, 64, then every PIECEWISE_STEP up to the configured maximum."""


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The padded token counts to capture up to `max_tokens` (none when it is 0)."""
    if max_tokens <= 0:
        return []
    sizes = [s for s in (16, 32, 64) if s < max_tokens]
    sizes += list(range(PIECEWISE_STEP, max_tokens + 1, PIECEWISE_STEP))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def supports_piecewise(model: nn.Module) -> bool:
    """The model opts in (its class says so) and no draft head reads its hidden states."""
    inner = getattr(model, "model", None)
    return bool(getattr(model, "piecewise_graphs", False)) and not getattr(inner, "aux_layers", ())


@dataclass(slots=True)
class _Call:
    """One attention call met at capture: what its replay passes the real backend."""

    kv_cache: torch.Tensor
    scale: float
    kv_written: bool


@dataclass(slots=True)
class _MlaCall:
    """One multi-head latent attention call met at capture (`AttentionBackend.mla`)."""

    cache: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    scale: float


@dataclass(slots=True)
class _Captured:
    pieces: list[torch.cuda.CUDAGraph]
    calls: list[_Call | _MlaCall]
    hidden: torch.Tensor


@dataclass(slots=True)
class _Buffers:
    """The attention calls' q, k, v and output: one set for every layer and size."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    """For MLA: q holds q_nope, k q_rope, v the latent rows."""


class _SplitBackend(AttentionBackend):
    """The backend a forward pass sees while it is captured or run dry: each attention call hands
    its q, k and v to the fixed buffers, ends the graph being captured, notes the call, begins the
    next graph, and returns the output buffer that replay fills."""

    name = "piecewise-split"
    takes_mla = True

    def __init__(self, owner: PiecewiseGraphs) -> None:
        self.owner = owner
        self.fuses_kv_write = owner.backend.fuses_kv_write
        self.calls: list[_Call | _MlaCall] = []
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.graph: torch.cuda.CUDAGraph | None = None  # None: a dry run, nothing captured

    def begin(self, capture: bool) -> None:
        if capture:
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=self.owner.pool, capture_error_mode=CAPTURE_MODE)

    def end(self) -> None:
        if self.graph is not None:
            self.graph.capture_end()
            self.pieces.append(self.graph)
            self.graph = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
        out: torch.Tensor | None = None,  # (the model passes none: the buffer is the output)
    ) -> torch.Tensor:
        buf = self.owner.buffers_for(q, k, v, q.shape[1:])
        self._split(buf, q, k, v, _Call(kv_cache, scale, kv_written))
        return buf.out[: q.shape[0]]

    def mla(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        t, h = q_nope.shape[:2]
        buf = self.owner.buffers_for(q_nope, q_rope, latent, (h, w_uv.shape[1]))
        self._split(buf, q_nope, q_rope, latent, _MlaCall(cache, w_uk, w_uv, scale))
        return buf.out[:t]

    def _split(
        self,
        buf: _Buffers,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        call: _Call | _MlaCall,
    ) -> None:
        """The call's inputs into the fixed buffers; the graph being captured ends there, and
        the next begins after it."""
        t = q.shape[0]
        buf.q[:t].copy_(q)
        buf.k[:t].copy_(k)
        buf.v[:t].copy_(v)
        capture = self.graph is not None
        self.end()
        self.calls.append(call)
        self.begin(capture)


class PiecewiseGraphs:
    """The captured pieces of each padded token count and their fixed inputs."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.sizes: list[int] = []
        self.captured: dict[int, _Captured] = {}
        self.pool: object = None
        self.replays = 0
        """Steps run on the pieces (tests and benchmarks count them)."""
        self._ids = self._pos = self._slots = torch.empty(0, dtype=torch.int64)
        self._buffers: _Buffers | None = None
        self._prepared: int | None = None
        # Data-parallel attention splits a step's rows by rank (ember/engine/dp_attention.py),
        # which the pieces' one metadata of the whole step does not: such steps run eagerly.
        self._data_parallel = current().dp_attention

    def prepare(self, max_tokens: int) -> None:
        """The sizes up to `max_tokens` and the fixed ids, positions and slots (before `run_dry`
        and `capture`)."""
        self._prepared = max_tokens
        takes = supports_piecewise(self.model) and not self._data_parallel
        self.sizes = piecewise_sizes(max_tokens) if takes else []
        top = self.sizes[-1] if self.sizes else 0
        self._ids = torch.zeros(top, dtype=torch.int64, device=self.device)
        self._pos = torch.zeros(top, dtype=torch.int64, device=self.device)
        self._slots = torch.full((top,), -1, dtype=torch.int64, device=self.device)
        self._buffers = None
        self.captured.clear()

    def size_for(self, n: int) -> int | None:
        """The captured size a step of `n` tokens pads up to; None if there is none."""
        if not self.captured:
            return None
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def buffers_for(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: tuple[int, ...]
    ) -> _Buffers:
        """The attention buffers, made at the first call (the largest size's: shapes per token
        from the model's q, k and v, and `out`, the output's, in q's dtype)."""
        if self._buffers is None:
            top = self.sizes[-1]

            def like(t: torch.Tensor) -> torch.Tensor:
                return torch.zeros((top, *t.shape[1:]), dtype=t.dtype, device=t.device)

            o = torch.zeros((top, *out), dtype=q.dtype, device=q.device)
            self._buffers = _Buffers(like(q), like(k), like(v), o)
        return self._buffers

    def _metadata(self, size: int) -> AttentionMetadata:
        """What the model sees at capture: the fixed slots (the rotation writes K and V through
        them); the attention fields are never read (the split backend takes the call)."""
        zero = self._slots.new_zeros(1, dtype=torch.int32)
        return AttentionMetadata(zero, zero, zero.view(1, 1), self._slots[:size], 1, 1, [0], [1])

    def _forward(self, size: int, kv_cache: torch.Tensor, capture: bool) -> _Captured:
        split = _SplitBackend(self)
        ctx = ForwardContext(self._metadata(size), kv_cache, split)
        split.begin(capture)
        try:
            hidden = self.model(self._ids[:size], self._pos[:size], ctx)
        finally:
            split.end()
        return _Captured(split.pieces, split.calls, hidden)

    def run_dry(self, kv_cache: torch.Tensor) -> None:
        """Every size's forward, uncaptured, for the start-up compile (ember/kernels/precompile):
        the pieces' Triton variants compile with the rest, before any capture."""
        for size in self.sizes:
            self._forward(size, kv_cache, capture=False)

    @torch.inference_mode()
    def capture(self, kv_cache: torch.Tensor, max_tokens: int, num_layers: int) -> None:
        """Capture every size's pieces up to `max_tokens` (`prepare` is called here unless it
        was, with it), largest first (its memory serves the rest), after one uncaptured run (lazy
        set-up must not happen inside a capture). Their Triton variants were compiled ahead
        where the start-up compile ran `run_dry`; any it missed are compiled here first."""
        if self._prepared != max_tokens:
            self.prepare(max_tokens)
        if not self.sizes:
            return
        with one_layer_of_each_kind(self.model):
            precompile(lambda: self.run_dry(kv_cache))
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        try:
            self._forward(self.sizes[-1], kv_cache, capture=False)
            torch.cuda.synchronize(self.device)
            with torch.cuda.stream(stream):
                for size in reversed(self.sizes):
                    captured = self._forward(size, kv_cache, capture=True)
                    calls = len(captured.calls)
                    if calls != num_layers:
                        self._off(f"the forward made {calls} attention calls, {num_layers} layers")
                        return
                    self.captured[size] = captured
            torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError as e:
            # A card the KV cache filled to its limit: steps launch from Python, as before.
            self._off(f"out of memory ({e})")
            return
        log.info(
            "captured piecewise CUDA graphs for prefill steps of up to %d tokens (%d sizes, %d "
            "pieces each) in %.1f s, %.0f MiB",
            self.sizes[-1],
            len(self.sizes),
            num_layers + 1,
            time.perf_counter() - t0,
            (torch.cuda.memory_reserved(self.device) - before) / 2**20,
        )

    def _off(self, why: str) -> None:
        log.warning("piecewise CUDA graphs off: %s", why)
        self.captured.clear()
        self.sizes = []
        self._buffers = None
        torch.cuda.empty_cache()

    def run(
        self, ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata, size: int
    ) -> torch.Tensor:
        """The forward pass of a step's `n` tokens on the pieces of `size` >= n: the hidden
        states [n, hidden], a view of the size's fixed output (the next run overwrites it)."""
        n = ids.shape[0]
        got = self.captured[size]
        self._ids[:n].copy_(ids)
        self._pos[:n].copy_(positions)
        self._slots[:n].copy_(md.slot_mapping)
        if n < size:
            self._slots[n:size].fill_(-1)  # padding rows write no KV slot
        buf = self._buffers
        assert buf is not None
        q, k, v, out = buf.q[:n], buf.k[:n], buf.v[:n], buf.out[:n]
        for piece, call in zip(got.pieces, got.calls, strict=False):
            piece.replay()
            if isinstance(call, _MlaCall):
                out.copy_(mla_attention(q, k, v, call.w_uk, call.w_uv, call.cache, md, call.scale))
            else:
                self.backend.forward(q, k, v, call.kv_cache, md, call.scale, call.kv_written, out)
        got.pieces[-1].replay()
        self.replays += 1
        return got.hidden[:n]
