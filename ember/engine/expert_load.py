"""Tokens routed to each rank's experts on an expert-parallel engine, for /metrics, read without
stalling a step: each rank copies its counters (FusedMoE.expert_load, on the device) to pinned host
memory behind the running work at most every REPORT_S, and reads the copy it made the time
before (so a figure is at most ~2 REPORT_S old)."""

from __future__ import annotations

import time

import torch
from torch import nn

REPORT_S = 1.0


class ExpertLoadMeter:
    def __init__(self, model: nn.Module) -> None:
        self._read = getattr(model, "expert_load", None)
        self._host: torch.Tensor | None = None
        self._done: torch.cuda.Event | None = None
        self._at = 0.0
        self.value: int | None = None
        """(token, expert) pairs routed to this rank's experts so far, over every MoE layer;
        None where the model counts none (not expert parallel)."""

    def poll(self, now: float | None = None) -> int | None:
        """The latest figure read back; starts the next copy when REPORT_S has passed."""
        if self._read is None:
            return None
        now = time.monotonic() if now is None else now
        if self._host is not None and (self._done is None or self._done.query()):
            self.value = int(self._host.sum())
        if now - self._at < REPORT_S:
            return self.value
        loads = self._read()
        if loads is None:
            self._read = None
            return None
        self._at = now
        if loads.is_cuda:
            self._host = torch.empty(loads.shape, dtype=loads.dtype, pin_memory=True)
            self._host.copy_(loads, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = loads.clone(), None
            self.value = int(self._host.sum())
        return self.value
