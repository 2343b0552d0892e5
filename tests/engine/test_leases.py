"""A prefill engine answers a lease's release from the API process when it knows the lease is still
held (the core cannot have let it expire yet), instead of waiting for a core that may sit in a long
step: a wait that timed out made decode engines distrust good reads and prefill the prompt again
(seen with AIPerf: 28 of 40 reads)."""

from __future__ import annotations

import asyncio
import time

import pytest

from ember.engine.async_llm import LEASE_MARGIN_S, AsyncLLM
from ember.engine.config import EngineConfig
from ember.engine.messages import EngineCoreOutput, ReleaseLease
from ember.kv_transfer_params import KVTransferParams


class SilentCore:
    """Stands in for a core busy in a long step: takes messages, answers nothing."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, msg: object) -> None:
        self.sent.append(msg)


@pytest.fixture
def llm(tiny_model_dir) -> AsyncLLM:
    engine = AsyncLLM(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=256))
    engine._client = SilentCore()  # type: ignore[assignment]
    return engine


def lease_output(lease_id: str, until: float) -> EngineCoreOutput:
    kv = KVTransferParams(engine_id="e", lease_id=lease_id, block_ids=[1, 2])
    return EngineCoreOutput(
        "r", [5], finish_reason="length", kv_transfer_params=kv, lease_until=until
    )


def test_a_known_live_lease_is_released_at_once(llm: AsyncLLM) -> None:
    llm._note_leases([lease_output("e:1", time.monotonic() + 30)])

    async def main() -> None:
        t0 = time.monotonic()
        assert await llm.release_lease("e:1", timeout_s=5) is True
        assert time.monotonic() - t0 < 0.5  # no wait on the (silent) core
        # The core is still told to free it; a second release is the core's to answer.
        assert [m.lease_id for m in llm._client.sent if isinstance(m, ReleaseLease)] == ["e:1"]
        with pytest.raises(TimeoutError):
            await llm.release_lease("e:1", timeout_s=0.2)

    asyncio.run(main())


def test_a_lease_near_expiry_or_unknown_is_asked_of_the_core(llm: AsyncLLM) -> None:
    llm._note_leases([lease_output("e:2", time.monotonic() + LEASE_MARGIN_S / 2)])

    async def main() -> None:
        for lease in ("e:2", "e:unknown"):
            with pytest.raises(TimeoutError):  # the silent core never says: not ours to guess
                await llm.release_lease(lease, timeout_s=0.2)

    asyncio.run(main())
