"""The API process's handle on the engine-core process: spawn it, talk to it over ZeroMQ."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import zmq

from ember.engine.config import EngineConfig
from ember.engine.core_spawn import SpawnedCore, engine_core_entry, spawn_core
from ember.engine.messages import (
    CoreInput,
    CoreOutput,
    EngineCoreFailed,
    EngineCoreReady,
    Shutdown,
)


class EngineDeadError(RuntimeError):
    """The engine-core process died or failed to start."""


class RequestFailedError(RuntimeError):
    """The engine core failed this one request (it raised on it) and goes on serving others."""


class CoreClient:
    def __init__(self, config: EngineConfig, spawned: SpawnedCore | None = None) -> None:
        """Spawn an engine core for `config`, or adopt `spawned`, one started for the same
        config before this process imported torch (`ember serve`: ember/engine/core_spawn.py)."""
        self._core = spawned or spawn_core(engine_core_entry, config)
        self.input, self.output, self.proc = self._core.input, self._core.output, self._core.proc
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(CoreOutput)

    async def wait_ready(self, timeout_s: float = 600.0) -> EngineCoreReady:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if await self.output.poll(200):
                msg = await self.recv()
                if isinstance(msg, EngineCoreReady):
                    return msg
                if isinstance(msg, EngineCoreFailed):
                    raise EngineDeadError(f"engine core failed to start: {msg.error}")
            elif not self.proc.is_alive():
                raise EngineDeadError(f"engine core exited with code {self.proc.exitcode}")
        raise EngineDeadError(f"engine core not ready after {timeout_s:.0f} s")

    async def send(self, msg: CoreInput) -> None:
        await self.input.send(self.enc.encode(msg), copy=False)

    async def recv(self) -> CoreOutput:
        return self.dec.decode(await self.output.recv())

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """Stop the core at once and free the sockets (a start abandoned before the event loop)."""
        self._core.kill()

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, zmq.ZMQError):
                await asyncio.wait_for(self.send(Shutdown()), 1.0)
            await asyncio.to_thread(self.proc.join, timeout_s)
        self._core.kill()  # if it did not stop by itself; then the sockets go
