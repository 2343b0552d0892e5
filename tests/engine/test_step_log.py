"""The engine core's step log (`EMBER_DEBUG=ember.engine.steps`): a line a launched step, with its
rows and tokens and when the requests that arrived since were submitted; nothing kept when off."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest

from ember.engine.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.sampling_params import SamplingParams

LINE = re.compile(
    r"step (\d+) at ([\d.]+): (\d+) rows \((\d+) prefilling\), (\d+) tokens; (\d+) waiting, "
    r"(\d+) arrived since(?: \(submitted ([\d.]+) to ([\d.]+), received ([\d.]+) to "
    r"([\d.]+)\))?; scheduled and launched in ([\d.]+) ms$"
)


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


def _core(model: Path) -> EngineCore:
    config = EngineConfig(model=str(model), max_model_len=256, num_kv_blocks=64, cpu_threads=1)
    return EngineCore(config)


def _request(rid: str, n: int, submitted: float) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    return EngineCoreRequest(rid, list(range(3, 3 + n)), params, [], 2, arrival_time=submitted)


def test_each_step_logs_its_rows_tokens_and_arrivals(llama: Path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="ember.engine.steps")
    core = _core(llama)
    began = time.monotonic()
    try:
        core.add_request(_request("a", 7, 100.25))
        core.add_request(_request("b", 5, 100.5))
        while core.has_unfinished_requests():
            core.step()
    finally:
        core.close()
    steps = [LINE.search(r.getMessage()) for r in caplog.records if r.name == "ember.engine.steps"]
    assert steps and all(steps), [r.getMessage() for r in caplog.records]
    first = steps[0]
    assert first.group(1, 3, 4, 5, 6, 7) == ("1", "2", "2", "12", "0", "2")
    assert (float(first[8]), float(first[9])) == (100.25, 100.5)
    # Received here after the test began, before the step's launch ended (the line's time); the
    # log writes times to 0.1 ms.
    got, at = float(first[10]), float(first[11])
    assert round(began, 4) <= got <= at <= float(first[2])
    assert 0 < float(first[12]) < 60_000
    # The next step decodes both rows; nothing arrived since.
    assert steps[1].group(3, 4, 5, 7) == ("2", "0", "2", "0") and steps[1][8] is None
    assert [int(m[1]) for m in steps] == list(range(1, len(steps) + 1))


def test_off_it_logs_nothing_and_keeps_nothing(llama: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="ember.engine.steps")
    core = _core(llama)
    try:
        core.add_request(_request("a", 7, 1.0))
        assert core._arrived == []
        core.step()
    finally:
        core.close()
    assert not [r for r in caplog.records if r.name == "ember.engine.steps"]
