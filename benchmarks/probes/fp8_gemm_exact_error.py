"""fp8_matmul's error on one GPU against the exact (float64) product of the operands it
multiplies, for every kind of tests/kernels/test_fp8_gemm.py at a model's shape (N 4096, K 7168,
bf16) and 33, 300 and 1,000 rows, under its own tiles and two other buckets' tiles: whether the
GPU's activation codes and scales equal the reference's (count of those that differ), the largest
error and its place, its size against the row's largest value, and the largest difference from
the fp32 reference rounded to bf16. Writes fp8_gemm_exact_error.json to $OUT (or /tmp)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))

from test_fp8_gemm import KINDS, activations, kind_args, quantize_weight  # noqa: E402

from ember.kernels.fp8_gemm import fp8_matmul, quantize_fp8_groups, tile_config  # noqa: E402
from ember.kernels.quant_ref import (  # noqa: E402
    dequantize_fp8,
    dequantize_fp8_groups,
    fp8_matmul_ref,
)
from ember.kernels.quant_ref import quantize_fp8_groups as quantize_ref  # noqa: E402


def main() -> None:
    out: dict[str, dict] = {}
    n, k = 4096, 7168
    for kind in KINDS:
        for m in (33, 300, 1000):
            g = torch.Generator().manual_seed(m)
            block, act = kind_args(kind, k)
            w, s = quantize_weight(torch.randn(n, k, generator=g), block)
            x = activations(m, k, g, spread=2).to(torch.bfloat16)
            want = fp8_matmul_ref(x, w, s, block, act).float()
            wd = dequantize_fp8(w, s, block, torch.float64)
            r: dict = {}
            if act:
                qg, sg = quantize_fp8_groups(x.cuda(), act)
                qc, sc = quantize_ref(x, act)
                r["codes_differ"] = int((qg.cpu().view(torch.uint8) != qc.view(torch.uint8)).sum())
                r["scales_differ"] = int((sg.cpu() != sc).sum())
                exact = dequantize_fp8_groups(qc, sc, act).double() @ wd.T
            else:
                exact = x.double() @ wd.T
            for name, cfg in (("own", None), ("m256", tile_config(200)), ("m64", tile_config(50))):
                got = fp8_matmul(x.cuda(), w.cuda(), s.cuda(), block, act, config=cfg)
                got = got.float().cpu()
                err = (got.double() - exact).abs()
                rowmax = exact.abs().amax(1, keepdim=True).clamp_min(1e-30)
                i = int(err.argmax())
                r[name] = {
                    "max_err": float(err.max()),
                    "max_err_over_rowmax": float((err / rowmax).max()),
                    "at_exact": float(exact.flatten()[i]),
                    "at_got": float(got.flatten()[i]),
                    "vs_ref_max": float((got - want).abs().max()),
                }
            out[f"{kind}-{m}"] = r
            print(kind, m, json.dumps(r), flush=True)
    path = Path(os.environ.get("OUT", "/tmp")) / "fp8_gemm_exact_error.json"
    path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "cases": out}, indent=1))


if __name__ == "__main__":
    main()
