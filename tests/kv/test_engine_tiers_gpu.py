"""The KV tiers on a GPU: blocks copied down on a side stream while the next steps run (and reuse
freed blocks) hold the very bytes an engine without tiers keeps on the device, and an agent's next
turn loaded back from host or disk gives the tokens of a device prefix hit. Runs only where CUDA is
available (the device machines); skipped on the CPU."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ember.entrypoints.llm import LLM
from ember.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BLOCK = 16  # set, not the GPU's default (64): the pool's sizes below count pages of 16
POOL = 48  # device blocks: one session of ~38 blocks fits, two do not
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


SESSIONS = [tokens(s, 600) for s in range(4)]


@pytest.fixture(autouse=True)
def _free_gpu_memory() -> Iterator[None]:
    yield
    gc.collect()
    torch.cuda.empty_cache()


def engine(model: Path, num_kv_blocks: int, **kwargs: Any) -> LLM:
    llm = LLM(
        str(model),
        device="cuda",
        max_model_len=POOL * BLOCK,
        block_size=BLOCK,
        num_kv_blocks=num_kv_blocks,
        kv_host_gb=kwargs.pop("kv_host_gb", 0),
        **kwargs,
    )
    tiers = llm.engine.core.tiers
    if tiers is not None:
        # A GPU recomputes the tiny model's prompts faster than a disk reads them, and the cost
        # model would rightly recompute: keep its default prefill speed (an 8B model's) instead.
        tiers.cost.observe_prefill = lambda tokens, seconds: None  # type: ignore[method-assign]
    return llm


def turns(llm: LLM) -> list[list[int]]:
    """Each session's first turn, one after another (each evicts the last from a small pool);
    returns the second turns' prompts."""
    out = []
    for i, prompt in enumerate(SESSIONS):
        answer = llm.generate([prompt], GREEDY)[0]
        out.append(prompt + list(answer.outputs[0].token_ids) + tokens(100 + i, 20))
    return out


@pytest.mark.parametrize("lower", ["host", "disk"])
def test_offloaded_bytes_and_next_turns_match_an_engine_that_kept_everything(
    tiny_model_dir, tmp_path: Path, lower: str
) -> None:
    model = tiny_model_dir("llama")
    ref = engine(model, num_kv_blocks=1024)  # keeps every session on the device
    ref_next = turns(ref)

    tiers: dict[str, Any] = (
        {"kv_host_gb": 0.05} if lower == "host" else {"kv_disk_dir": str(tmp_path)}
    )
    llm = engine(model, POOL, **tiers)
    assert turns(llm) == ref_next  # same first answers
    core = llm.engine.core
    assert core.tiers is not None
    core.tiers.flush()
    core.tiers.step_done()

    # Every block in host memory holds the bytes the reference engine computed for its hash.
    host, ref_core = core.tiers.host, ref.engine.core
    ref_blocks = ref_core.runner.kv_cache.view(ref_core.num_kv_blocks, -1).view(torch.uint8)
    checked = 0
    for prompt in ref_next:
        for key in ref_core.kv.update_block_hashes([], prompt, None):
            slot = host.lookup(key)
            cached = ref_core.kv.pool.get_cached_block(key)
            if slot is None or cached is None:
                continue
            assert torch.equal(host.row(slot), ref_blocks[cached.block_id].cpu()), key.hex()
            checked += 1
    assert checked >= min(len(SESSIONS) * 30, host.capacity_blocks - 8)

    if lower == "disk":  # a restarted engine reads the sessions back from disk
        llm.close()
        llm = engine(model, POOL, **tiers)
        core = llm.engine.core
    for prompt in ref_next:
        got, want = llm.generate([prompt], GREEDY)[0], ref.generate([prompt], GREEDY)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.num_cached_tokens == want.num_cached_tokens > 30 * BLOCK
    stats = core.stats().kv_tiers
    assert stats["cpu" if lower == "host" else "disk"].hits > 0
    llm.close()
    ref.close()
