"""How a benchmark names the file it writes: `<bench>-<hardware>-<date>[-<what differs>].<ext>`.

`<hardware>` is the GPU's short name (`H200`, `H100`; `2xH200` for a two-GPU run) or `cpu`, and
`<date>` the day of the run, so a new run never lands on a file that is already in
benchmarks/results/. The folder is `$OUT` when set (the device machines return what is written
there), else benchmarks/results/.
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

_VENDOR = {"nvidia", "geforce", "tesla", "amd", "radeon", "instinct"}


def hardware_label(name: str | None) -> str:
    """A device name as the results name it: 'NVIDIA H200' -> 'H200', 'NVIDIA H100 80GB HBM3' ->
    'H100', 'NVIDIA GeForce RTX 4090' -> 'RTX4090'; no name, or a CPU's, -> 'cpu'."""
    words = [w for w in (name or "").replace("_", " ").split() if w.lower() not in _VENDOR]
    if not words or words[0].lower().startswith("cpu"):
        return "cpu"
    label = (
        words[0] + words[1] if words[0].upper() in ("RTX", "GTX") and len(words) > 1 else words[0]
    )
    return re.sub(r"[^A-Za-z0-9]", "", label) or "cpu"


def result_path(
    bench: str,
    hardware: str | None,
    *,
    tag: str = "",
    ext: str = "json",
    out_dir: str | os.PathLike | None = None,
    date: str | None = None,
) -> Path:
    """Where `bench` writes its result: `<out_dir>/<bench>-<hardware>-<date>[-<tag>].<ext>`.
    `hardware` is a device name (or an already short label such as '2xH200'); `tag` says what
    this run sets apart from the benchmark's default (a model, a load, a setting)."""
    folder = Path(out_dir or os.environ.get("OUT") or RESULTS)
    day = date or datetime.date.today().isoformat()
    hw = (
        hardware
        if hardware and re.fullmatch(r"\d*x?[A-Za-z0-9]+", hardware)
        else hardware_label(hardware)
    )
    suffix = "-" + tag.strip("-") if tag and tag.strip("-") else ""
    return folder / f"{bench}-{hw}-{day}{suffix}.{ext}"
