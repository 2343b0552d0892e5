"""Spawning the engine-core process, without importing torch: `ember serve` starts its core first
thing, so that the core's imports, CUDA set-up, load and compiles overlap the API process's own
imports (FastAPI, the tokenizer; the API process never imports torch) and set-up, rather than
following them (docs/performance.md).

Nothing here may import torch at module level; the child's entry points import what they need.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from ember.parent_death import left_by_dead_processes

if TYPE_CHECKING:
    from ember.engine.config import EngineConfig


IPC_PREFIX = "ember-ipc-"
"""The API process's sockets to its core live in `$TMPDIR/ember-ipc-<pid>-XXXX/` (mode 0700: no
other user can connect to them). The directory goes when the core is stopped (`close`), when the
process exits without having stopped it (`_remove_live_dirs`, at exit: a failed start, SIGTERM
during start-up), and, after a SIGKILL, at the next spawn on this machine
(`remove_stale_ipc_dirs`)."""

_live_dirs: set[str] = set()


@atexit.register
def _remove_live_dirs() -> None:
    for d in list(_live_dirs):
        shutil.rmtree(d, ignore_errors=True)
    _live_dirs.clear()


def remove_stale_ipc_dirs(directory: str | None = None) -> list[str]:
    """Remove the IPC directories of processes that are gone (SIGKILLed before they could);
    returns those removed. A live process's directory, or another user's, is left alone."""
    removed = []
    for d in left_by_dead_processes(
        Path(directory or tempfile.gettempdir()).glob(f"{IPC_PREFIX}*-*"), IPC_PREFIX
    ):
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


@dataclass(slots=True)
class SpawnedCore:
    """A running engine-core process and the API side's two bound sockets to it."""

    ipc_dir: str
    ctx: zmq.asyncio.Context
    input: zmq.asyncio.Socket  # PUSH: requests, aborts, shutdown
    output: zmq.asyncio.Socket  # PULL: outputs, ready, failed
    proc: BaseProcess

    def kill(self) -> None:
        """Stop the core at once and free the sockets and the IPC directory."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self.close()

    def close(self) -> None:
        """Free the sockets and the IPC directory (the core is gone)."""
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        _live_dirs.discard(self.ipc_dir)


def spawn_core(target: Callable[..., None], *args: Any) -> SpawnedCore:
    """Bind the sockets, then start `target(*args, input_addr, output_addr, parent_pid)` in a
    spawned process (not forked: the parent may hold threads, uvloop's or torch's, that a fork
    would break). The parent-death signal follows the spawning thread: call this on the thread
    that lives as long as the process (the main one)."""
    remove_stale_ipc_dirs()
    ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
    _live_dirs.add(ipc_dir)
    input_addr, output_addr = f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"
    ctx = zmq.asyncio.Context()
    inp = ctx.socket(zmq.PUSH)
    inp.bind(input_addr)
    out = ctx.socket(zmq.PULL)
    out.bind(output_addr)
    proc = multiprocessing.get_context("spawn").Process(
        target=target,
        args=(*args, input_addr, output_addr, os.getpid()),
        name="ember-engine-core",
        daemon=True,
    )
    proc.start()
    return SpawnedCore(ipc_dir, ctx, inp, out, proc)


def engine_core_entry(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int
) -> None:
    """The spawned process's entry: imports the engine (torch) there, not in the parent."""
    if config.load_format != "dummy":
        from ember.models.checkpoint_files import start_read_ahead

        start_read_ahead(config.model)  # the disk is idle while the imports below run
    if config.device != "cpu":
        from ember.engine import cuda_context
        from ember.kernels import triton_setup

        cuda_context.start(config.device)  # the driver's set-up, beside the imports below
        triton_setup.start()  # beside the imports below: its reads and hashing release the GIL
    from ember.engine.core_proc import engine_core_main

    engine_core_main(config, input_addr, output_addr, parent_pid)
