"""The engine-core process: receives requests and aborts over ZeroMQ, steps the model as long as
there is work, and pushes token outputs and load statistics back. HTTP never blocks this loop."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys

import msgspec
import torch
import zmq

from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import (
    AbortRequests,
    CoreInput,
    EngineCoreFailed,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    ReleaseLease,
    SchedulerStats,
    Shutdown,
)
from ember.engine.request import RequestStatus
from ember.parent_death import die_with_parent

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500
"""How often an idle core wakes to check that its parent is still alive."""
SEND_TIMEOUT_MS = 500
"""A send that waits this long (the API process reads nothing) checks the parent, then retries."""


class ParentGone(Exception):
    """The API process died; the core must not outlive it."""


def engine_core_main(
    config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int | None = None
) -> None:
    """Entry point of the spawned process."""
    parent = os.getppid() if parent_pid is None else parent_pid
    # SIGKILL whatever the core is doing (a blocked ZeroMQ send, a long step). The signal follows
    # the thread that spawned us: CoreClient is made on one that lives as long as the API process.
    die_with_parent(parent, signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    logging.basicConfig(level=os.environ.get("EMBER_LOG_LEVEL", "INFO"))
    for name in filter(None, os.environ.get("EMBER_DEBUG", "").split(",")):
        logging.getLogger(name).setLevel(logging.DEBUG)  # e.g. ember.engine.steps
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # no send may block forever (see send())
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    enc = msgspec.msgpack.Encoder()
    if config.device == "cpu":
        # The API process needs a core of its own: intra-op threads that spin against it cost
        # more than they gain (measured in docs/performance.md).
        torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
    try:
        core = EngineCore(config)
        if core.workers is not None:
            # A dead worker may leave this process inside a collective that never returns: it
            # ends, and the server with it, for `ember up` or a supervisor to restart.
            core.workers.exit_on_failure = True
    except Exception as e:  # report why we could not start, then exit
        with contextlib.suppress(ParentGone):
            send(out, enc.encode(EngineCoreFailed(f"{type(e).__name__}: {e}")), parent)
        out.close(linger=2000)
        return
    r = core.resolved
    send(
        out,
        enc.encode(
            EngineCoreReady(
                core.num_kv_blocks,
                config.block_size,
                r.max_model_len,
                config.max_num_seqs,
                engine_id=core.engine_id,
                kv_root_hash=core.kv.root,
                transfer_address=core.connector.transport.address if core.connector else "",
            )
        ),
        parent,
    )
    linger = 1000
    try:
        EngineCoreLoop(core, inp, out, parent).run()
    except ParentGone:
        log.warning("API process is gone; engine core exits")
        linger = 0
    except Exception:
        # The traceback goes to our log; the API process gets the error's one line.
        log.exception("engine core failed")
        exc = sys.exc_info()[1]
        with contextlib.suppress(ParentGone):
            send(out, enc.encode(EngineCoreFailed(f"{type(exc).__name__}: {exc}")), parent)
        raise
    finally:
        core.close()
        inp.close(linger=0)
        out.close(linger=linger)
        ctx.term()


def send(out: zmq.Socket, data: bytes, parent: int) -> None:
    """Send, waiting for a reader as long as the API process `parent` lives; else ParentGone."""
    while True:
        try:
            out.send(data)
            return
        except zmq.Again:
            if os.getppid() != parent:
                raise ParentGone from None


class EngineCoreLoop:
    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket, parent: int) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(CoreInput)
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.parent = parent
        self.last_stats: SchedulerStats | None = None
        self.rejected: list[EngineCoreOutput] = []
        self.lease_replies: list[tuple[str, bool]] = []

    def run(self) -> None:
        """Serve until Shutdown; ParentGone when the API process dies."""
        while True:
            if os.getppid() != self.parent:  # every iteration: a syscall, ~1 us
                raise ParentGone
            busy = self.core.has_unfinished_requests()
            if not self.drain_inputs(0 if busy else IDLE_POLL_MS):
                return
            self.core.expire_leases()
            outputs = self.core.step() if self.core.has_unfinished_requests() else []
            self.publish(self.rejected + outputs)
            self.rejected = []

    def drain_inputs(self, timeout_ms: int) -> bool:
        """Handle every waiting message; False on shutdown."""
        while self.poller.poll(timeout_ms):
            timeout_ms = 0
            data = self.inp.recv()
            try:
                msg = self.dec.decode(data)
            except msgspec.DecodeError as e:  # e.g. values that SamplingParams refuses
                self.reject(_request_id_of(data), e)
                continue
            if isinstance(msg, EngineCoreRequest):
                try:
                    self.core.add_request(msg)
                except Exception as e:
                    # Validated in the API process already; if it still fails, it fails alone.
                    self.reject(msg.request_id, e)
            elif isinstance(msg, AbortRequests):
                status = (
                    RequestStatus.FINISHED_STOPPED
                    if msg.stopped
                    else RequestStatus.FINISHED_ABORTED
                )
                self.core.abort_requests(msg.request_ids, status)
            elif isinstance(msg, ReleaseLease):
                self.lease_replies.append((msg.lease_id, self.core.release_lease(msg.lease_id)))
            elif isinstance(msg, Shutdown):
                return False
        return True

    def reject(self, request_id: str | None, e: Exception) -> None:
        log.error("rejected request %s: %s: %s", request_id, type(e).__name__, e)
        if request_id is not None:
            reason = f"engine error: {type(e).__name__}: {e}"
            out = EngineCoreOutput(request_id, [], finish_reason="error", stop_reason=reason)
            self.rejected.append(out)

    def publish(self, outputs: list[EngineCoreOutput]) -> None:
        stats = self.core.stats()
        events = self.core.drain_kv_events()
        replies, self.lease_replies = self.lease_replies or None, []
        if outputs or events or replies or stats != self.last_stats:
            data = self.enc.encode(EngineCoreOutputs(outputs, stats, events, replies))
            send(self.out, data, self.parent)
            self.last_stats = stats


def _request_id_of(data: bytes) -> str | None:
    """The id of an "add" message that did not decode (array-like: [tag, request_id, ...])."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "add" and isinstance(raw[1], str):
        return raw[1]
    return None
