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

from ember.engine.step_plan import Message, StopWorkers, encode
from ember.kv.tiers.store_master import free_port

if TYPE_CHECKING:
    from ember.engine.config import EngineConfig

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
"""How long a closing engine waits for its workers to leave before it kills them."""
JOIN_TIMEOUT_S = 600.0
"""How long rank 0 waits for every worker to reach the process group (imports, CUDA set-up)."""
EXIT_GRACE_S = 5.0
"""With `exit_on_failure`: how long a process whose worker died may take to end by itself (its
next collective may never return: NCCL waits for a dead peer) before it is ended."""


REGIONS_TIMEOUT_S = 30.0
"""How long a prefill engine's first lease waits for its workers to say where their KV caches
are (they say so before the first step they run, which the lease's prompt needed)."""


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
        self.exit_on_failure = False
        """End this whole process EXIT_GRACE_S after a worker's end (an engine core process:
        its server then exits non-zero, for a supervisor to restart)."""
        self._closing = False
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        hello, reports = f"ipc://{self.dir}/hello", f"ipc://{self.dir}/reports"
        acks = f"ipc://{self.dir}/tier-acks"
        self.hello = self.ctx.socket(zmq.PULL)
        self.hello.bind(hello)
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.bind(reports)
        self.tier_acks = self.ctx.socket(zmq.PULL)
        """The workers' answers to `TierLower` (`lower RANK JOB_ID COUNT`), read by rank 0's
        lower-tier thread alone (ember/engine/kv_tiers.WorkerLowerChannel)."""
        self.tier_acks.bind(acks)
        self._send_lock = threading.Lock()  # the engine thread's plans, the disk thread's jobs
        self.expert_loads: dict[int, int] = {}
        """Each worker's last reported expert load (ember/engine/expert_load.py), by rank."""
        self.kv_loads: dict[int, dict[int, tuple[bool, int]]] = {}
        """The workers' reports of their KV reads (`LoadKV`): load id -> rank -> (succeeded,
        bytes read)."""
        self.regions: dict[int, tuple[str, int]] = {}
        """A prefill engine's workers' KV caches: rank -> (transport address, base)."""
        self.tags: dict[int, dict[int, list[str]]] = {}
        """The workers' tags of leased blocks (`TagKV`): tag id -> rank -> tags."""
        self._next_tag_id = 0
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
                    pickle.dumps(
                        (
                            config,
                            rank,
                            size,
                            self.init_method,
                            address,
                            hello,
                            reports,
                            acks,
                            os.getpid(),
                        )
                    )
                )
                proc.stdin.close()
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise
        self._watcher = threading.Thread(target=self._watch, name="tp-workers", daemon=True)
        self._watcher.start()

    def wait_joining(self) -> None:
        """Return once every worker is about to join the process group (its imports done);
        raise WorkerFailed if one ends first, rather than wait for it in the rendezvous."""
        waiting = set(range(1, self.size))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while waiting:
            self.check()
            if time.monotonic() > deadline:
                raise WorkerFailed(f"workers {sorted(waiting)} did not start in {JOIN_TIMEOUT_S} s")
            if self.hello.poll(100):
                waiting.discard(int(self.hello.recv()))

    def send(self, plan: Message) -> None:
        """Every worker's copy of a step's plan, of a KV read to make or of a tier's copy or job
        (it queues while a worker is not yet reading; raises WorkerFailed rather than wait on one
        that ended). Any thread: the sockets are used under a lock, so each worker gets the
        messages in the order they were sent."""
        self.check()
        data = encode(plan)
        with self._send_lock:
            for sock in self.sockets:
                while True:
                    try:
                        sock.send(data, zmq.NOBLOCK, copy=False)
                        break
                    except zmq.Again:
                        sock.poll(100, zmq.POLLOUT)
                        self.check()

    def check(self) -> None:
        """Raise WorkerFailed once a worker has ended."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)

    def read_reports(self) -> dict[int, int]:
        """The workers' expert loads, with whatever they reported since the last call (their
        KV reads' outcomes go to `kv_loads`). A report is one line, its kind first:
        `expert RANK LOAD`, `kv RANK LOAD_ID OK BYTES` (OK: 1 or 0; BYTES: what it read) or
        `region RANK BASE ADDRESS` (a prefill engine's worker: its KV cache's transport address,
        the rest of the line, and base) or `tags RANK TAG_ID TAG,TAG,...` (its tags of a
        lease's blocks)."""
        while True:
            try:
                line = self.reports.recv(zmq.NOBLOCK).decode()
            except zmq.Again:
                return self.expert_loads
            kind, *fields = line.split(maxsplit=3 if line.startswith("region ") else -1)
            if kind == "region":
                self.regions[int(fields[0])] = (fields[2], int(fields[1]))
            elif kind == "tags":
                rank, tag_id = int(fields[0]), int(fields[1])
                got = fields[2].split(",") if len(fields) > 2 and fields[2] else []
                self.tags.setdefault(tag_id, {})[rank] = got
            elif kind == "expert":
                rank, value = (int(x) for x in fields)
                self.expert_loads[rank] = value
            elif kind == "kv":
                rank, load_id, ok, nbytes = (int(x) for x in fields)
                self.kv_loads.setdefault(load_id, {})[rank] = (bool(ok), nbytes)
            else:
                log.warning("unknown report from a worker: %r", line[:80])

    def kv_regions(self, timeout_s: float = REGIONS_TIMEOUT_S) -> list[tuple[str, int]]:
        """Each worker's (transport address, KV cache base), ranks 1 .. N-1: a prefill engine's
        workers report theirs once started, before the first step they run."""
        deadline = time.monotonic() + timeout_s
        while len(self.regions) < self.size - 1:
            self.check()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - set(self.regions))
                raise WorkerFailed(f"workers {missing} did not say where their KV cache is")
            if self.reports.poll(50):
                self.read_reports()
        return [self.regions[r] for r in range(1, self.size)]

    def ask_tags(self, keys: list[str], block_ids: list[int]) -> int:
        """Ask the workers with a key (`keys[rank]`, ranks 0 .. N-1) to tag their share of a
        lease's blocks under it (over Mooncake); the id to wait for with `kv_tags`."""
        from ember.engine.step_plan import TagKV

        tag_id = self._next_tag_id
        self._next_tag_id += 1
        self.send(TagKV(tag_id, keys, block_ids))
        return tag_id

    def kv_tags(
        self, tag_id: int, ranks: int | None = None, timeout_s: float = REGIONS_TIMEOUT_S
    ) -> dict[int, list[str]]:
        """The tags of `ask_tags`'s `tag_id`, by rank, once `ranks` workers (all, by default)
        have sent theirs."""
        want = self.size - 1 if ranks is None else ranks
        deadline = time.monotonic() + timeout_s
        while len(self.tags.get(tag_id, {})) < want:
            self.check()
            if time.monotonic() > deadline:
                raise WorkerFailed(f"the workers did not tag lease blocks ({tag_id}) in time")
            if self.reports.poll(20):
                self.read_reports()
        return self.tags.pop(tag_id, {})

    def kv_load_done(self, load_id: int, ranks: int | None = None) -> tuple[bool, int] | None:
        """Whether every worker (or the `ranks` that read) read its share of load `load_id`,
        and the bytes they read together; None while some have not said. A worker's end fails
        every load (its part can never land)."""
        self.read_reports()
        if self.failure is not None:
            self.kv_loads.pop(load_id, None)
            return False, 0
        got = self.kv_loads.get(load_id, {})
        if len(got) < (self.size - 1 if ranks is None else ranks):
            return None
        del self.kv_loads[load_id]
        return all(ok for ok, _ in got.values()), sum(n for _, n in got.values())

    def explain(self, err: BaseException, wait_s: float = 2.0) -> None:
        """After rank 0's step raised `err`: raise WorkerFailed from it if a worker ended (a
        collective with a dead peer fails first; the watcher learns why within `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            if any(proc.poll() is not None for proc in self.procs):
                time.sleep(0.05)  # the watcher records it
            else:
                return
        if self.failure is not None:
            raise WorkerFailed(self.failure) from err

    def _watch(self) -> None:
        """Notice a worker's end within a fraction of a second and record why."""
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing and self.failure is None:
                    self.failure = f"tensor-parallel worker rank {rank} exited with code {code}"
                    log.error("%s: the engine cannot go on without it", self.failure)
                    if self.exit_on_failure:
                        time.sleep(EXIT_GRACE_S)
                        if not self._closing:
                            log.error("ending the engine core: %s", self.failure)
                            os._exit(1)
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
        self.hello.close(linger=0)
        self.reports.close(linger=0)
        self.tier_acks.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
