"""`ember serve --speculative ...` reaches the engine's config, bad values are a one-line error
before anything starts, and `ember up --engine-args` hands the same flags to every engine."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ember.server.args import add_serve_args, engine_config_from_args
from ember.spec_decode.config import SpeculativeConfig
from tests.servers import free_port, spawned_by_up


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(["model-dir", *argv])


def test_off_without_the_flag() -> None:
    assert engine_config_from_args(parse()).speculative is None


def test_flags_become_the_speculative_config(tmp_path: Path) -> None:
    cfg = engine_config_from_args(parse("--speculative", "ngram"))
    assert cfg.speculative == SpeculativeConfig("ngram", 8, None, None)  # the method's default
    cfg = engine_config_from_args(
        parse("--speculative", "suffix", "--num-speculative-tokens", "7",
              "--speculative-max-batch", "16")
    )  # fmt: skip
    assert cfg.speculative == SpeculativeConfig("suffix", 7, None, 16)
    draft = str(tmp_path)
    cfg = engine_config_from_args(parse("--speculative", "eagle3", "--draft-model", draft))
    assert cfg.speculative == SpeculativeConfig("eagle3", 4, draft, None)
    # 0: never speculate (the engine's own measurement is skipped).
    cfg = engine_config_from_args(parse("--speculative", "ngram", "--speculative-max-batch", "0"))
    assert cfg.speculative is not None and cfg.speculative.max_batch == 0


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "must be in [1, 16], got 0"),
        (["--speculative", "ngram", "--num-speculative-tokens", "17"], "got 17"),
        (["--speculative", "eagle3"], "eagle3 needs a draft model (--draft-model DIR)"),
        (["--speculative", "ngram", "--speculative-max-batch", "-1"], "max_batch must be >= 0"),
        (["--num-speculative-tokens", "3"], "--num-speculative-tokens needs --speculative"),
        (["--draft-model", "/d", "--speculative-max-batch", "2"], "--draft-model, --speculative"),
        (["--speculative", "ngram", "--draft-model", "/d"], "is for --speculative eagle3, not"),
        (["--speculative", "eagle3", "--draft-model", "/no/such/dir"], "is not a directory"),
    ],
)
def test_bad_values_say_what_is_wrong(argv: list[str], says: str) -> None:
    with pytest.raises(ValueError) as e:
        engine_config_from_args(parse(*argv))
    assert says in str(e.value)


def test_an_unknown_method_is_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse("--speculative", "medusa")
    assert e.value.code == 2
    assert "invalid choice: 'medusa'" in capsys.readouterr().err


def test_serve_exits_with_one_line_before_loading(tiny_model_dir) -> None:
    model = str(tiny_model_dir("llama"))
    cmd = [sys.executable, "-m", "ember.cli", "serve", model, "--port", str(free_port())]
    r = subprocess.run(
        [*cmd, "--speculative", "ngram", "--num-speculative-tokens", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines == ["ember: error: num_speculative_tokens must be in [1, 16], got 0"], lines


def test_up_hands_the_flags_to_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = "--speculative suffix --num-speculative-tokens 6"
    _, spawned = spawned_by_up(monkeypatch, ["/m/tiny", "--both", "1", "--engine-args", extra])
    engines = {name: cmd for name, cmd in spawned.items() if name != "router"}
    assert set(engines) == {"prefill-0", "decode-0", "both-0"}
    serve = argparse.ArgumentParser()
    add_serve_args(serve)
    for cmd in engines.values():
        assert cmd[0] == "serve"
        cfg = engine_config_from_args(serve.parse_args(cmd[1:]))
        assert cfg.speculative == SpeculativeConfig("suffix", 6, None, None)
    assert "--speculative" not in spawned["router"]


@pytest.mark.parametrize(
    "extra,says",
    [
        ("--speculative ngram --num-speculative-tokens 0", "must be in [1, 16], got 0"),
        ("--speculative eagle3", "eagle3 needs a draft model"),
        ("--num-speculative-tokens 2", "needs --speculative"),
        ("--speculative lookahead", "invalid choice: 'lookahead'"),
    ],
)
def test_up_refuses_bad_speculative_engine_args_at_once(extra: str, says: str) -> None:
    from ember.cluster import engine_extra_args

    with pytest.raises(ValueError) as e:
        engine_extra_args(extra)
    assert str(e.value).startswith("--engine-args: ") and says in str(e.value)
