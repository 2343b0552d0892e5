"""The KV sizing's profiled-step peak on the 8B shape (dummy weights, bf16, the engine's defaults:
a 16,384-token step) with the first two decoder layers of each kind (the engine's default,
ember/engine/model_runner.py) and with every layer, and the seconds of each; prints each and
writes $OUT/peak_probe.json. Run as is in session 20's call 3 (GPU only;
results/kv_profile_peak-H200-2026-11-28.json)."""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import torch  # noqa: E402
from served_gpu import model_dir  # noqa: E402

from ember import LLM  # noqa: E402
from ember.engine import model_runner  # noqa: E402

path = model_dir("llama")
llm = LLM(
    str(path),
    device="cuda",
    load_format="dummy",
    warmup=False,
    enforce_eager=True,
    num_kv_blocks=4096,
)
core = llm.engine.core
r, cfg = core.resolved, core.config
out = {}
for name, n in (
    ("two of each kind", 2),
    ("every layer", 1000),
    ("two again", 2),
    ("every again", 1000),
):
    model_runner.PROFILED_LAYERS_OF_EACH_KIND = n
    torch.cuda.synchronize()
    t = time.perf_counter()
    peak = core.runner.profile_peak_bytes(
        r.max_num_batched_tokens, r.max_model_len, cfg.max_num_seqs
    )
    out[name] = {"peak_bytes": peak, "seconds": time.perf_counter() - t}
    print(name, out[name], flush=True)
llm.close()
Path(os.environ.get("OUT", "/tmp"), "peak_probe.json").write_text(json.dumps(out, indent=1))
