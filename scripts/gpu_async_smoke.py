"""On a GPU: the engine-core process (spawned, CUDA graphs, KV sized under gpu_memory_utilization)
behind AsyncLLM, as `ember serve --device cuda` runs it, without the HTTP layer (which the device
machines lack and which is the same on every device). Checks concurrent streams, a prefix-cache
hit on a second turn, and that an abort frees every block. Exit status 0 when all hold.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.engine.async_llm import AsyncLLM  # noqa: E402
from ember.engine.config import EngineConfig  # noqa: E402
from ember.models.tiny import make_tiny  # noqa: E402
from ember.sampling_params import SamplingParams  # noqa: E402


async def main() -> int:
    model = make_tiny(Path(tempfile.mkdtemp()) / "tiny", "llama")
    llm = AsyncLLM(
        EngineConfig(
            model=str(model),
            device="cuda",
            max_model_len=2048,
            gpu_memory_utilization=0.3,
            max_num_seqs=32,
        )
    )
    await llm.start()
    print("ready:", llm.ready)
    prompt = "You are a coding agent. " * 20

    async def one(i: int, n: int) -> tuple[int, int]:
        last = None
        params = SamplingParams(max_tokens=n, ignore_eos=True, seed=i)
        async for out in llm.generate(f"r{i}", prompt + f"task {i}", params):
            last = out
        return len(last.outputs[0].token_ids), last.num_cached_tokens

    results = await asyncio.gather(*(one(i, 40 + i) for i in range(16)))
    ok = all(n == 40 + i for i, (n, _) in enumerate(results))
    cached = max(c for _, c in results)
    print("lengths ok:", ok, "max cached tokens:", cached)
    ok &= cached > 0

    # Abort mid-stream: every block comes back.
    stream = await llm.add_request("long", prompt, SamplingParams(max_tokens=1500, ignore_eos=True))
    async for out in stream:
        if len(out.outputs[0].token_ids) >= 20:
            break
    await stream.aclose()
    for _ in range(100):
        await asyncio.sleep(0.02)
        s = llm.stats
        if s.num_running == 0 and s.num_free_blocks == s.num_blocks:
            break
    print("after abort:", llm.stats)
    ok &= llm.stats.num_free_blocks == llm.stats.num_blocks and llm.stats.num_running == 0
    await llm.shutdown()
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
