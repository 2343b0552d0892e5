"""DeepSeek-V3's one-plane latent KV through what moves blocks: a disaggregated pair (the decode
engine reads the prefill engine's latent blocks over the transfer engine) and the host tier
(blocks evicted from a small GPU pool come back); greedy output equals one engine's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from ember.models.tiny import make_tiny
from tests.servers import pd_cluster, start_server
from tests.spec_decode.test_spec_serving import ENGINE, completion


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("deepseek"), "deepseek_v3", seed=7)


def test_pd_moves_latent_blocks(deepseek: Path) -> None:
    pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 3000, (n,), generator=g).tolist() for n in (40, 77, 9)]
    plain = start_server(deepseek, *ENGINE)
    try:
        want = [completion(plain.url, p) for p in prompts]
    finally:
        plain.stop()
    with pd_cluster(deepseek, *ENGINE, prefill=1) as pd:
        assert [completion(pd.router.url, p) for p in prompts] == want
        deadline = time.monotonic() + 10  # stats reach /load with the next step's outputs
        while (load := pd.decode.load())["free_blocks"] != load["total_blocks"]:
            assert time.monotonic() < deadline, load
            time.sleep(0.1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_latent_blocks_come_back_from_the_host_tier(deepseek: Path, kv_cache_dtype: str) -> None:
    """(An FP8 cache's blocks too: its answers are an FP8 engine's with the whole pool.)"""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 3000, (96,), generator=g).tolist() for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    base_kw = dict(dtype="float32", max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    base = LLM(str(deepseek), **base_kw)
    want = [base.generate([p], params)[0].outputs[0].token_ids for p in prompts * 2]
    base.close()
    kw = dict(base_kw, block_size=4, num_kv_blocks=80, kv_host_gb=0.05)
    llm = LLM(str(deepseek), **kw)
    try:
        got = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts * 2]
        assert got == want
        assert llm.engine.core.stats().kv_tiers["cpu"].hits > 0
    finally:
        llm.close()
