"""Run a script in a fresh Python without TRITON_INTERPRET (which the test session sets on a
machine with no GPU): Triton then compiles for real, for a GPU target the script names, with its
own ptxas, so kernels can be compiled for Hopper and their PTX inspected on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

STUB_H100 = """
from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class StubDriver:  # an H100 for the compiler and the specializations; nothing is launched
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(StubDriver())
"""
"""A script's first lines where Triton must compile (or specialize) for an H100 with no GPU."""


def run_script(source: str, tmp_path: Path, *args: str) -> Any:
    """Run `source` (its own Triton cache under tmp_path) and return the JSON of the last line
    it prints; fails the test with its stderr if it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    script = tmp_path / "run.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
