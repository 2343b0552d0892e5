"""The other ranks of a tensor-parallel engine, as seen from rank 0 (the engine core's process):
one worker process a device, started here, sent every step's plan, and watched.

Each worker (ember/engine/worker_main.py) joins the engine's process group, builds the same
`EngineCore` start-up as rank 0 (its shard of the weights, the same profiled step, the KV cache
sized to the smallest rank's room, the same graphs), then runs each `StepPlan` rank 0 sends: the
forward passes meet in their collectives, and rank 0 alone samples and answers.

Workers are subprocesses (`python -m ember.engine.worker_main`): the engine core runs as a
daemonic multiprocessing child, which may not start multiprocessing children of its own. The
configuration reaches a worker on its stdin (it holds the cluster's secret: never a command
line); the plans on one ZeroMQ PUSH socket per worker in a private directory (mode 0700), which
queues what is sent before a worker connects."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING

import zmq

from ember.engine.step_plan import StepPlan, StopWorkers, encode
from ember.kv.tiers.store_master import free_port

if TYPE_CHECKING:
    from ember.engine.config import EngineConfig

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
"""How long a closing engine waits for its workers to leave before it kills them."""


class WorkerFailed(RuntimeError):
    """A worker process of the engine ended: the engine cannot step without it."""


class Workers:
    def __init__(self, config: EngineConfig, size: int) -> None:
        """Start ranks 1 .. size - 1 for `config`; `init_method` is the process group's
        rendezvous that rank 0 joins next (ember.distributed.state.init)."""
        self.size = size
        self.dir = tempfile.mkdtemp(prefix="ember-tp-")
        self.init_method = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None
        """Why the engine cannot go on (a worker ended), once one has."""
        self._closing = False
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            for rank in range(1, size):
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                address = f"ipc://{self.dir}/plans-{rank}"
                sock.bind(address)
                self.sockets.append(sock)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "ember.engine.worker_main"],
                    stdin=subprocess.PIPE,
                    env=env,
                )
                assert proc.stdin is not None
                proc.stdin.write(
                    pickle.dumps((config, rank, size, self.init_method, address, os.getpid()))
                )
                proc.stdin.close()
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise
        self._watcher = threading.Thread(target=self._watch, name="tp-workers", daemon=True)
        self._watcher.start()

    def send(self, plan: StepPlan) -> None:
        """Every worker's copy of a step's plan."""
        self.check()
        data = encode(plan)
        for sock in self.sockets:
            sock.send(data, copy=False)

    def check(self) -> None:
        """Raise WorkerFailed once a worker has ended."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    def _watch(self) -> None:
        """Notice a worker's end within a fraction of a second and record why."""
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing and self.failure is None:
                    self.failure = f"tensor-parallel worker rank {rank} exited with code {code}"
                    log.error("%s: the engine cannot go on without it", self.failure)
            time.sleep(0.1)

    def close(self) -> None:
        """Ask the workers to leave, wait a while, kill those that stay; nothing is left."""
        self._closing = True
        stop = encode(StopWorkers())
        for sock in self.sockets:
            with contextlib.suppress(zmq.ZMQError):  # a worker gone already
                sock.send(stop, zmq.NOBLOCK)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
