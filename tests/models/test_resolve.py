"""Model arguments by name: `ember serve smollm2`, `ember up smollm2`, `LLM(model="smollm2")`."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember.models.resolve import KNOWN_MODELS, resolve_model, served_name


def test_a_known_name_is_its_directory_and_served_under_its_directorys_name(smollm2: Path) -> None:
    assert resolve_model("smollm2") == str(smollm2)
    assert served_name("smollm2") == "smollm2-135m-instruct" == KNOWN_MODELS["smollm2"][1]


def test_a_path_is_not_taken_for_a_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # a directory of that name here: the user means it
    assert resolve_model("smollm2") == "smollm2"
    assert served_name("smollm2") == "smollm2"
    model = str(tiny_model_dir("llama"))
    assert resolve_model(model) == model and served_name(model) == model
    assert resolve_model("no-such-model") == "no-such-model"  # left for the loader to refuse


def test_llm_loads_a_known_model_by_name(smollm2: Path) -> None:
    from ember import LLM, SamplingParams

    llm = LLM(model="smollm2", max_model_len=256)
    assert llm.engine.config.model == str(smollm2)
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 3
