"""Memory of a long CPU prefill: bounded by the attention's query blocks, not by prompt length
squared (an 11k-token prompt would take an engine core to 5.35 GB)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# The old dense path held [heads, q, k] scores and their softmax in fp32: 2 x 1 GiB at 8k tokens
# on the tiny model (4 heads). The query blocks hold 64 MiB of scores at a time.
PROMPT_TOKENS = 8192
BOUND_MIB = 512

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from ember import LLM, SamplingParams

    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], max_model_len={n} + 64, max_num_batched_tokens={n} + 64)
    prompt = {{"prompt_token_ids": [10 + i % 200 for i in range({n})]}}
    llm.generate(prompt, SamplingParams(max_tokens=1))  # warm: allocators, first-use buffers
    before = kib("VmRSS")
    # A new high-water mark comes only from the second prefill (VmHWM is reset by writing 5).
    open("/proc/self/clear_refs", "w").write("5")
    out = llm.generate({{"prompt_token_ids": [11 + i % 199 for i in range({n})]}},
                       SamplingParams(max_tokens=1))
    assert len(out[0].prompt_token_ids) == {n}
    print((kib("VmHWM") - before) // 1024)
    """
).format(n=PROMPT_TOKENS)


def test_long_prefill_peak_memory_is_bounded(tiny_model_dir) -> None:
    model: Path = tiny_model_dir("llama")
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    grew_mib = int(r.stdout.strip().splitlines()[-1])
    assert grew_mib < BOUND_MIB, f"an {PROMPT_TOKENS}-token prefill grew the RSS by {grew_mib} MiB"
