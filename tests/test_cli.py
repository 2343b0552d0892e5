"""The `ember` command line: subcommands, one-line errors, no abbreviated flags."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ember.cli import main
from tests.servers import free_port


def test_make_tiny_then_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny"
    assert main(["model", "make-tiny", str(out), "--arch", "qwen3_moe", "--shards", "2"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert "wrote tiny qwen3_moe model" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "import os", "--max-tokens", "4"]) == 0


@pytest.mark.parametrize("arch", ["deepseek_v3", "kimi_k2"])
def test_make_tiny_deepseek_v3_then_generate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str
) -> None:
    """The DeepSeek-V3 tiny (MLA, grouped-routing MoE) and Kimi K2's (the same model with Kimi's
    tiktoken.model and chat template) from the CLI, then served by it, as text and as a chat."""
    out = tmp_path / "ds"
    assert main(["model", "make-tiny", str(out), "--arch", arch]) == 0
    assert f"wrote tiny {arch} model" in capsys.readouterr().out
    assert main(["generate", str(out), "--prompt", "import os", "--max-tokens", "4"]) == 0
    assert main(["generate", str(out), "--prompt", "hi", "--max-tokens", "4", "--chat"]) == 0


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


def ember(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ember.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def one_line_error(r: subprocess.CompletedProcess[str], prog: str) -> str:
    """The stderr of a failed command: exactly one line, `prog: error: ...`, no traceback."""
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["up", "--prefil", "2"],
        ["serve", "m", "--max-model", "64"],
        ["router", "--disagg", "1"],
        ["model", "make-tiny", "out", "--ar", "llama"],
        ["bench", "--url", "http://127.0.0.1:1", "--workload", "random", "--num-req", "3"],
        ["bench", "compare", "a.json", "b.json", "--hel"],
    ],
)
def test_abbreviated_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's prefix matching is off: `--prefil 2` is refused, not taken as `--prefill 2`."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_bench_against_a_closed_port_is_one_line() -> None:
    """A server that is down: one line and exit 1, not a traceback or exit 0."""
    port = free_port()
    r = ember("bench", "--url", f"http://127.0.0.1:{port}", "--workload", "random")
    assert f"cannot reach http://127.0.0.1:{port}/v1/models" in one_line_error(r, "ember bench")
    assert r.returncode == 1


def test_bench_compare_on_a_missing_or_foreign_file_is_one_line(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"summary": {"requests": 1}}))
    foreign = tmp_path / "foreign.json"
    foreign.write_text("[1, 2")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    for bad, says in ((tmp_path / "missing.json", "No such file"), (foreign, "not a JSON"),
                      (other, "not an ember bench result")):  # fmt: skip
        r = ember("bench", "compare", str(good), str(bad))
        assert says in one_line_error(r, "ember bench compare")
        assert r.returncode == 1


def test_router_on_a_busy_port_is_one_line() -> None:
    """`ember router` on a busy port: one line, not aiohttp's traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = ember("router", "--port", str(port), "--both", "http://127.0.0.1:1")
    assert one_line_error(r, "ember") == f"ember: error: port {port} is in use"


def test_require_secret_without_a_secret_is_one_line() -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "EMBER_CLUSTER_SECRET"}
    cmd = [sys.executable, "-m", "ember.cli", "serve", "m", "--port", "1", "--require-secret"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert "--require-secret needs the cluster secret" in one_line_error(r, "ember")


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its name: `ember serve`, `ember model get`, `ember bench` ..."""
    from ember.bench.cli import run_parser
    from ember.cli import build_parser

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            for sub_name, sub in action.choices.items():
                walk(sub, f"{name} {sub_name}")
        if not subs:
            found[name] = p

    walk(build_parser(), "ember")
    found["ember bench"] = run_parser()  # `ember bench` parses with its own parser
    return found


def test_every_command_groups_its_flags_and_says_what_each_does() -> None:
    parsers = _parsers()
    assert {"ember serve", "ember router", "ember up", "ember generate", "ember bench"} <= set(
        parsers
    )
    assert {"ember model make-tiny", "ember model import-gguf", "ember model get"} <= set(parsers)
    for name, p in parsers.items():
        own = p._action_groups[2:]  # after argparse's own two: positionals, options
        assert own, f"{name} --help has no groups"
        for g in own:
            assert g.title and g.description and "\n" not in g.description, (name, g.title)
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help and a.help.strip(), f"{name} {a.option_strings or a.dest} has no help"
            assert any(a in g._group_actions for g in own), f"{name} {a.dest} is in no group"


@pytest.mark.parametrize(
    ("command", "groups"),
    [
        (
            "serve",
            ["model", "server", "security", "limits", "engine", "GPU", "disaggregation",
             "KV tiers", "speculative decoding"],
        ),
        (
            "up",
            ["model", "cluster", "engines", "routing", "KV tiers", "security", "demo"],
        ),
    ],
)  # fmt: skip
def test_help_shows_the_groups(command: str, groups: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ember.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    for title in groups:
        assert f"\n{title}:\n" in out.stdout, title
