"""benchmarks/quality.py's result path: a new dated file by default, refused rather than
overwritten when it exists, and `--out` taken as given."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _quality():
    spec = importlib.util.spec_from_file_location(
        "quality_bench", ROOT / "benchmarks" / "quality.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_default_is_a_dated_file_named_by_the_hardware(tmp_path: Path) -> None:
    q = _quality()
    got = q.output_path(
        None, "NVIDIA_H100_80GB_HBM3", "bfloat16", results=tmp_path, date="2026-12-02"
    )
    assert got == tmp_path / "quality-H100-2026-12-02-bfloat16.json"
    cpu = q.output_path(None, "cpu-x86_64-2threads", "float32", results=tmp_path, date="2026-12-02")
    assert cpu.name == "quality-cpu-2026-12-02-float32.json"


def test_an_existing_result_is_refused_not_overwritten(tmp_path: Path) -> None:
    q = _quality()
    kept = tmp_path / "quality-cpu-2026-12-02-float32.json"
    kept.write_text("{}")
    with pytest.raises(SystemExit, match="exists"):
        q.output_path(None, "cpu-x86_64-2threads", "float32", results=tmp_path, date="2026-12-02")
    assert kept.read_text() == "{}"


def test_out_is_taken_as_given(tmp_path: Path) -> None:
    q = _quality()
    named = tmp_path / "mine.json"
    named.write_text("{}")
    assert q.output_path(named, "cpu", "float32", results=tmp_path) == named
