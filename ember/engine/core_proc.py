"""The engine-core process: receives requests and aborts over ZeroMQ, steps the model as long as
there is work, and pushes token outputs and load statistics back. HTTP never blocks this loop."""

from __future__ import annotations

import logging
import os
import signal
import traceback

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

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500
"""How often an idle core wakes to check that its parent is still alive."""


def engine_core_main(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the spawned process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when we stop
    logging.basicConfig(level=os.environ.get("EMBER_LOG_LEVEL", "INFO"))
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
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
    except Exception as e:  # report why we could not start, then exit
        out.send(enc.encode(EngineCoreFailed(f"{type(e).__name__}: {e}")))
        out.close(linger=2000)
        return
    r = core.resolved
    out.send(
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
        )
    )
    try:
        EngineCoreLoop(core, inp, out).run()
    except Exception:
        out.send(enc.encode(EngineCoreFailed(traceback.format_exc())))
        raise
    finally:
        core.close()
        inp.close(linger=0)
        out.close(linger=1000)
        ctx.term()


class EngineCoreLoop:
    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket) -> None:
        self.core = core
        self.inp = inp
        self.out = out
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(CoreInput)
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)
        self.parent = os.getppid()
        self.last_stats: SchedulerStats | None = None
        self.rejected: list[EngineCoreOutput] = []
        self.lease_replies: list[tuple[str, bool]] = []

    def run(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            if not self.drain_inputs(0 if busy else IDLE_POLL_MS):
                return
            self.core.expire_leases()
            outputs = self.core.step() if self.core.has_unfinished_requests() else []
            self.publish(self.rejected + outputs)
            self.rejected = []
            if not busy and os.getppid() != self.parent:
                log.warning("API process is gone; engine core exits")
                return

    def drain_inputs(self, timeout_ms: int) -> bool:
        """Handle every waiting message; False on shutdown."""
        while self.poller.poll(timeout_ms):
            timeout_ms = 0
            msg = self.dec.decode(self.inp.recv())
            if isinstance(msg, EngineCoreRequest):
                try:
                    self.core.add_request(msg)
                except ValueError as e:
                    # Validated in the API process already; if it still fails, end it visibly.
                    log.error("rejected request %s: %s", msg.request_id, e)
                    self.rejected.append(
                        EngineCoreOutput(
                            msg.request_id, [], finish_reason="abort", stop_reason=str(e)
                        )
                    )
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

    def publish(self, outputs: list[EngineCoreOutput]) -> None:
        stats = self.core.stats()
        events = self.core.drain_kv_events()
        replies, self.lease_replies = self.lease_replies or None, []
        if outputs or events or replies or stats != self.last_stats:
            self.out.send(self.enc.encode(EngineCoreOutputs(outputs, stats, events, replies)))
            self.last_stats = stats
