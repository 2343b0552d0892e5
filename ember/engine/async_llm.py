"""The engine as the server uses it: an asyncio front (tokenize, detokenize, stream outputs) over
an engine-core process. Each request gets a queue; one task fans the core's outputs out to them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from ember.engine.config import EngineConfig
from ember.engine.core_client import CoreClient, EngineDeadError, RequestFailedError
from ember.engine.input_processor import InputProcessor, PromptType
from ember.engine.messages import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReady,
    KVEvents,
    KVTransferParams,
    ReleaseLease,
    SchedulerStats,
)
from ember.engine.output_processor import OutputProcessor
from ember.engine.structured_output import GrammarCompiler
from ember.models.config import ModelConfig
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


KV_EVENTS_KEPT = 200_000
LEASE_MARGIN_S = 0.5
"""A lease this close to its expiry is not answered by the API process: the core is asked."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: CoreClient | None = None) -> None:
        """`client`: an engine core already spawned for `config` (a server spawns it first, so the
        core loads while this process reads the tokenizer and starts its HTTP side); `start()`
        spawns one otherwise."""
        if not Path(config.model).is_dir():
            raise FileNotFoundError(f"model directory {config.model!r} does not exist")
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        self.resolved = config.resolve(self.model_config)
        self.max_model_len = self.resolved.max_model_len
        self.inputs = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.max_model_len
        )
        self.processor = OutputProcessor(self.tokenizer)
        self.grammar = GrammarCompiler.for_model(config.model, self.model_config)
        self.stats = SchedulerStats()
        self.ready: EngineCoreReady | None = None
        self.dead: str | None = None
        self.died = asyncio.Event()
        """Set when the engine core died: the server exits so that a supervisor restarts it."""
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._client: CoreClient | None = client
        self._loop_task: asyncio.Task[None] | None = None
        self._lease_replies: dict[str, asyncio.Future[bool]] = {}
        self._leases: dict[str, float] = {}
        """Prefill leases this engine handed out -> when the core lets each expire (monotonic)."""
        # KV block events (seq, kind, hash hex, medium), numbered, for routers that poll /kv_events.
        self.kv_events: deque[tuple[int, str, str, str]] = deque(maxlen=KV_EVENTS_KEPT)
        self.kv_event_seq = 0

    async def start(self, timeout_s: float = 600.0) -> None:
        """Spawn the engine core (unless it was given) and wait until its model is loaded."""
        if self._client is None:
            self._client = CoreClient(self.config)
        try:
            self.ready = await self._client.wait_ready(timeout_s)
        except BaseException:
            await self._client.shutdown()
            raise
        self._loop_task = asyncio.create_task(self._output_loop(), name="ember-output-loop")

    async def shutdown(self) -> None:
        if self._loop_task:
            self._loop_task.cancel()
        if self._client:
            await self._client.shutdown()
        self._fail_all(EngineDeadError("engine is shutting down"))

    @property
    def is_ready(self) -> bool:
        return self.ready is not None and self.dead is None

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    @property
    def num_sequences(self) -> int:
        """Samples in flight (a request with n=4 counts 4): what admission limits."""
        return len(self.processor.parent_of)

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> RequestStream:
        """Validate and submit a request; iterate the returned stream for its outputs.

        Bad input raises ValueError here, before anything is queued. The caller must iterate the
        stream to the end or `aclose()` it; closing early aborts the request in the core.
        A decode leg (`kv_transfer.do_remote_prefill`) streams the prefill engine's first token at
        once, before its KV is read: the client has it one hop after the prefill leg returned.
        """
        if self.dead is not None or self._client is None:
            raise EngineDeadError(self.dead or "engine not started")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        state, core_reqs = self.inputs.process(request_id, prompt, params, cache_salt, kv_transfer)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.processor.add_request(state)
        stream = RequestStream(self, request_id, queue)
        stopped: list[str] = []
        if kv_transfer is not None and kv_transfer.do_remote_prefill:
            first = EngineCoreOutput(core_reqs[0].request_id, [kv_transfer.first_token_id])
            outputs, stopped = self.processor.process([first])
            for out in outputs:
                queue.put_nowait(out)
        try:
            for r in core_reqs:
                await self._client.send(r)
            if stopped:  # the first token already ended it on a stop string
                await self._client.send(AbortRequests(stopped, stopped=True))
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Convenience: add a request and yield its outputs, aborting it if the loop stops early."""
        stream = await self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def release_lease(self, lease_id: str, timeout_s: float = 5.0) -> bool:
        """Free a prefill lease's blocks; True if it was still held (so its KV was intact).

        A lease this process handed out and the core cannot have let expire yet is answered here at
        once: the core frees it only on a release, on expiry, or when it stops, so "held" is
        certain, and the core is told to free it when it next reads its inputs. Waiting for that
        reply instead cost a decode engine its read whenever the prefill engine sat in a long step
        (the release timed out, and the decode side prefilled the prompt again)."""
        if self._client is None or self.dead is not None:
            raise EngineDeadError(self.dead or "engine not started")
        until = self._leases.pop(lease_id, None)
        if until is not None and time.monotonic() < until - LEASE_MARGIN_S:
            await self._client.send(ReleaseLease(lease_id))
            return True
        fut = self._lease_replies.get(lease_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._lease_replies[lease_id] = fut
            await self._client.send(ReleaseLease(lease_id))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        finally:
            if fut.done():
                self._lease_replies.pop(lease_id, None)

    def _note_leases(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            kv = out.kv_transfer_params
            if kv is not None and kv.lease_id and out.lease_until > now:
                self._leases[kv.lease_id] = out.lease_until
        if len(self._leases) > 4096:  # leases that expired unreleased: forget them
            self._leases = {k: t for k, t in self._leases.items() if t > now}

    def events_since(self, seq: int) -> tuple[int, bool, list[tuple[int, str, str, str]]]:
        """(newest seq, whether events after `seq` were dropped, the events after `seq`)."""
        events = self.kv_events
        if not events or seq >= self.kv_event_seq:
            return self.kv_event_seq, False, []
        idx = seq + 1 - events[0][0]
        return self.kv_event_seq, idx < 0, list(itertools.islice(events, max(idx, 0), None))

    def _record_events(self, ev: KVEvents) -> None:
        for kind, h, medium in ev.events:
            self.kv_event_seq += 1
            self.kv_events.append((self.kv_event_seq, kind, h.hex(), medium))

    async def abort(self, request_id: str) -> None:
        children = self.processor.child_ids(request_id)
        self.processor.abort_request(request_id)
        if children and self._client is not None and self.dead is None:
            await self._client.send(AbortRequests(children))

    async def _output_loop(self) -> None:
        client = self._client
        if client is None:
            raise RuntimeError("engine core client missing")
        try:
            while True:
                if not await client.output.poll(1000):
                    if not client.is_alive():
                        raise EngineDeadError(f"engine core exited ({client.proc.exitcode})")
                    continue
                msg = await client.recv()
                if not isinstance(msg, EngineCoreOutputs):
                    raise EngineDeadError(f"engine core failed: {getattr(msg, 'error', msg)}")
                self.stats = msg.stats
                if msg.kv_events is not None:
                    self._record_events(msg.kv_events)
                for lease_id, released in msg.lease_replies or ():
                    fut = self._lease_replies.pop(lease_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(released)
                if not msg.outputs:
                    continue
                self._note_leases(msg.outputs)
                core_outputs = await self._fail_errored(client, msg.outputs)
                outputs, to_stop = self.processor.process(core_outputs)
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is not None:
                        q.put_nowait(out)
                if to_stop:
                    await client.send(AbortRequests(to_stop, stopped=True))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("engine output loop ended")
            self.dead = str(e)
            self._fail_all(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))
            self.died.set()

    async def _fail_errored(
        self, client: CoreClient, outputs: list[EngineCoreOutput]
    ) -> list[EngineCoreOutput]:
        """A core output with finish_reason "error" fails its request (all of its n samples)
        with RequestFailedError; the rest pass on."""
        if not any(o.finish_reason == "error" for o in outputs):
            return outputs
        kept = []
        for out in outputs:
            parent = self.processor.parent_of.get(out.request_id)
            if out.finish_reason != "error" or parent is None:
                kept.append(out)
                continue
            siblings = [c for c in self.processor.child_ids(parent) if c != out.request_id]
            self.processor.abort_request(parent)
            q = self._queues.get(parent)
            if q is not None:
                q.put_nowait(RequestFailedError(str(out.stop_reason or "engine error")))
            if siblings:
                await client.send(AbortRequests(siblings))
        return kept

    def _fail_all(self, err: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(err)


class RequestStream:
    """One request's cumulative outputs, newest first when the reader lags."""

    def __init__(
        self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue = queue
        self.finished = False
        self.closed = False
        self.arrival = time.monotonic()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self.queue.get()
        # Outputs are cumulative: when the reader lags, skip to the newest.
        while not self.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            await self.aclose()
            raise item
        if item.finished:
            self.finished = True
            self.engine._queues.pop(self.request_id, None)
        return item

    async def aclose(self) -> None:
        """Abort the request if it has not finished; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.engine._queues.pop(self.request_id, None)
        if not self.finished:
            await self.engine.abort(self.request_id)
