from pathlib import Path

import pytest

from ember.cli import main


def test_make_tiny_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    assert main(["model", "make-tiny", str(out), "--arch", "qwen3_moe", "--shards", "2"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert "wrote tiny qwen3_moe model" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "import os", "--max-tokens", "4"]) == 0


def test_demo_runs_two_turns_with_a_cache_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    assert main(["demo", "--max-tokens", "8"]) == 0
    text = capsys.readouterr().out
    turn2 = next(line for line in text.splitlines() if line.startswith("turn 2"))
    cached = int(turn2.split(" prompt tokens, ")[1].split(" cached")[0])
    assert cached > 0


def test_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
