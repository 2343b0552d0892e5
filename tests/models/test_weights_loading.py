"""The weights' load on a thread of its own (`ember.models.loader.WeightsLoading`): what the
engine's start-up runs beside its compile on a GPU. Here on the CPU, with the real loading code."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ember.engine.warmup import one_layer_of_each_kind
from ember.models import loader
from ember.models.loader import (
    LoadStopped,
    WeightsLoading,
    build_model,
    fill_weights,
    load_model,
)
from tests.models.checkpoint_edits import copy_without

DEVICE = torch.device("cpu")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_a_load_on_its_thread_gives_the_weights_of_a_plain_load(tiny_model_dir, arch: str) -> None:
    path = tiny_model_dir(arch)
    plain = load_model(path, dtype=torch.float32)
    model = build_model(path, dtype=torch.float32)
    loading = WeightsLoading(model, path, torch.float32, DEVICE)
    assert loading.wait() >= 0.0
    assert loading.seconds > 0.0
    _same_weights(model, plain)


def test_a_load_finds_every_weight_while_a_dry_run_cut_is_in_force(tiny_model_dir) -> None:
    """The engine's dry run runs one layer of each kind while the weights load: the load finds
    the other layers' parameters by name all the same."""
    path = tiny_model_dir("llama")
    plain = load_model(path, dtype=torch.float32)
    model = build_model(path, dtype=torch.float32)
    with one_layer_of_each_kind(model):
        assert len(model.model.run_layers) == 1 < len(model.model.layers)
        WeightsLoading(model, path, torch.float32, DEVICE).wait()
    _same_weights(model, plain)


def _slow(monkeypatch: pytest.MonkeyPatch, path: Path, gate: threading.Event) -> list[str]:
    """The loader's CPU reader, made to wait for `gate` before its first tensor and then to
    take 20 ms a tensor; returns the names it has yielded so far, and 'closed' once closed."""
    real = loader.iter_safetensors
    seen: list[str] = []

    def reader(files: list[Path], device: str = "cpu"):
        try:
            gate.wait(10)
            for name, t in real(files, device):
                time.sleep(0.02)
                seen.append(name)
                yield name, t
        finally:
            seen.append("closed")

    monkeypatch.setattr(loader, "iter_safetensors", reader)
    return seen


def test_the_parameters_are_zero_until_their_weights_arrive(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dry run reads them meanwhile: zeros, not whatever the allocation held (no NaN)."""
    path = tiny_model_dir("llama")
    gate = threading.Event()
    _slow(monkeypatch, path, gate)
    model = build_model(path, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    loading = WeightsLoading(model, path, torch.float32, DEVICE)
    assert all(not p.any() for p in model.parameters())
    gate.set()
    loading.wait()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(p.any() for p in model.parameters())


def test_close_stops_a_load_at_its_next_tensor_and_closes_the_reader(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_dir("llama")
    gate = threading.Event()
    seen = _slow(monkeypatch, path, gate)
    total = len(load_file(next(path.glob("*.safetensors"))))
    model = build_model(path, dtype=torch.float32)
    loading = WeightsLoading(model, path, torch.float32, DEVICE)
    gate.set()
    while len(seen) < 2:
        time.sleep(0.005)
    loading.close()
    assert not loading._thread.is_alive()
    assert seen[-1] == "closed"
    assert len(seen) - 1 < total  # stopped before the end
    assert isinstance(loading._error, LoadStopped)


def test_a_checkpoint_that_lacks_a_weight_fails_at_wait(tiny_model_dir, tmp_path: Path) -> None:
    copy_without(tiny_model_dir("llama"), tmp_path, "model.layers.1.mlp.down_proj.weight")
    model = build_model(tmp_path, dtype=torch.float32)
    loading = WeightsLoading(model, tmp_path, torch.float32, DEVICE)
    with pytest.raises(ValueError, match=r"lacks weights: \['model\.layers\.1\.mlp\.down_proj"):
        loading.wait()
    assert not loading._thread.is_alive()


@pytest.mark.parametrize(
    ("arch", "left_out", "named"),
    [
        ("llama", "model.layers.0.mlp.up_proj.weight", r"gate_up_proj\.weight \(up\)"),
        ("llama", "model.layers.1.self_attn.k_proj.weight", r"qkv_proj\.weight \(k\)"),
        ("qwen3_moe", "model.layers.1.mlp.experts.2.up_proj.weight", r"experts\.w13 \(2\.up\)"),
        ("qwen3_moe", "model.layers.1.mlp.experts.3.down_proj.weight", r"experts\.w2 \(3\.down\)"),
        (
            "deepseek_v3",
            "model.layers.1.mlp.shared_experts.gate_proj.weight",
            r"experts\.w13 \(shared\.gate\)",
        ),
        (
            "deepseek_v3",
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            r"fused_qkv_a_proj\.weight \(kv_a\)",
        ),
    ],
)
def test_a_checkpoint_that_lacks_part_of_a_fused_weight_is_refused(
    tiny_model_dir, tmp_path: Path, arch: str, left_out: str, named: str
) -> None:
    """One fused parameter stands for several checkpoint tensors (q/k/v, gate/up, an MoE
    layer's experts): a checkpoint with only some of them is refused by the part it lacks, not
    served with that part left as zeros."""
    copy_without(tiny_model_dir(arch), tmp_path, left_out)
    model = build_model(tmp_path, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"lacks parts of weights: .*{named}"):
        fill_weights(model, tmp_path, torch.float32)


def test_a_shard_cut_short_fails_at_wait(tiny_model_dir, tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    for f in src.iterdir():
        data = f.read_bytes()
        (tmp_path / f.name).write_bytes(
            data[: len(data) // 2] if f.suffix == ".safetensors" else data
        )
    model = build_model(tmp_path, dtype=torch.float32)
    loading = WeightsLoading(model, tmp_path, torch.float32, DEVICE)
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError, match="not fully covered"):
        loading.wait()
    assert not loading._thread.is_alive()


def test_build_model_says_there_is_no_checkpoint_before_it_allocates(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, '
        '"vocab_size": 256, "max_position_embeddings": 128}'
    )
    with pytest.raises(FileNotFoundError):
        build_model(tmp_path)
    assert build_model(tmp_path, load_format="dummy").training is False


def test_fill_weights_stops_when_told(tiny_model_dir) -> None:
    path = tiny_model_dir("llama")
    model = build_model(path, dtype=torch.float32)
    stop = threading.Event()
    stop.set()
    with pytest.raises(LoadStopped):
        fill_weights(model, path, torch.float32, DEVICE, stop)


def test_a_build_draws_no_random_initial_values_and_restores_torchs_initializers(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every parameter is filled afterwards (checkpoint or dummy), so the build skips torch's
    random initializers (66 s of an 8B model's build on a CPU), and puts them back after."""
    from torch import nn

    calls: list[str] = []
    for name in ("kaiming_uniform_", "uniform_", "normal_"):
        real = getattr(nn.init, name)
        monkeypatch.setattr(
            nn.init, name, lambda t, *a, _n=name, _r=real, **k: calls.append(_n) or _r(t, *a, **k)
        )
    before = {name: getattr(nn.init, name) for name in ("kaiming_uniform_", "uniform_", "normal_")}
    path = tiny_model_dir("llama")
    build_model(path, dtype=torch.float32)
    assert calls == []
    assert {name: getattr(nn.init, name) for name in before} == before
    nn.Linear(4, 4)  # outside a build they draw as before
    assert "kaiming_uniform_" in calls
    # A dummy load still fills every parameter: finite, norms at one, the rest drawn.
    dummy = load_model(path, dtype=torch.float32, load_format="dummy")
    for name, p in dummy.named_parameters():
        assert torch.isfinite(p).all(), name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    assert dummy.model.embed_tokens.weight.std() > 0.01


def test_the_initializers_come_back_when_a_build_fails(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch import nn

    class Broken(nn.Module):
        def __init__(self, config, max_position: int = 0) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            raise RuntimeError("boom")

    monkeypatch.setattr(loader, "resolve_architecture", lambda name: Broken)
    before = {name: getattr(nn.init, name) for name in loader._RANDOM_INITS}
    with pytest.raises(RuntimeError, match="boom"):
        build_model(tiny_model_dir("llama"), load_format="dummy")
    assert {name: getattr(nn.init, name) for name in before} == before


def _bare_core(path: Path, **kwargs: object):
    """An EngineCore with only what `_load` reads (its __init__ would load on its own terms)."""
    from ember.engine.config import EngineConfig
    from ember.engine.core import EngineCore
    from ember.models.config import ModelConfig

    core = EngineCore.__new__(EngineCore)
    core.config = EngineConfig(model=str(path), device="cpu", dtype="float32", **kwargs)
    core.model_config = ModelConfig.from_dir(path)
    core.resolved = core.config.resolve(core.model_config)
    core.device = DEVICE
    return core


def test_the_engines_load_beside_returns_the_loading_and_fills_the_model(tiny_model_dir) -> None:
    from ember.attention.torch_backend import TorchAttentionBackend
    from ember.engine.startup_clock import StartupClock

    path = tiny_model_dir("llama")
    core, clock = _bare_core(path), StartupClock()
    loading = core._load(clock, TorchAttentionBackend(), beside=True)
    assert isinstance(loading, WeightsLoading) and "model" in clock.phases
    loading.wait()
    _same_weights(core.runner.model, load_model(path, dtype=torch.float32))
    # Dummy weights are drawn in place: nothing to load beside.
    dummy = _bare_core(path, load_format="dummy")
    assert dummy._load(StartupClock(), TorchAttentionBackend(), beside=True) is None


def test_a_runner_that_fails_stops_the_load_it_started(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ember.attention.torch_backend import TorchAttentionBackend
    from ember.engine import core as core_module
    from ember.engine.startup_clock import StartupClock

    gate = threading.Event()
    path = tiny_model_dir("llama")
    seen = _slow(monkeypatch, path, gate)

    def broken(*args: object, **kwargs: object) -> None:
        gate.set()
        raise RuntimeError("no runner")

    monkeypatch.setattr(core_module, "ModelRunner", broken)
    with pytest.raises(RuntimeError, match="no runner"):
        _bare_core(path)._load(StartupClock(), TorchAttentionBackend(), beside=True)
    assert not any(t.name == "weights-load" and t.is_alive() for t in threading.enumerate())
    assert seen[-1] == "closed"


def _beside_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's `_load` told to load beside on the CPU too (on a GPU it does so with the
    warm-up on), so its start-up's order runs here with the real loading code."""
    from ember.engine.core import EngineCore

    real = EngineCore._load

    def load(self, clock, backend, beside: bool = False):
        return real(self, clock, backend, beside=True)

    monkeypatch.setattr(EngineCore, "_load", load)


def test_the_kv_cache_and_scheduler_are_made_before_the_weights_are_in(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The KV sizing, the KV cache, the scheduler and (on a GPU) the graphs' capture run while
    the weights load; the engine waits for them after, and generates what an engine that
    loaded first does."""
    from ember import LLM, SamplingParams
    from ember.engine.core import EngineCore

    path = tiny_model_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 200, 17, 3], list(range(40, 70))]
    plain = LLM(str(path), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.close()

    gate = threading.Event()
    seen = _slow(monkeypatch, path, gate)
    _beside_on_the_cpu(monkeypatch)
    arrived_at_kv: list[int] = []
    real_kv = EngineCore._kv_and_scheduler

    def kv_and_scheduler(self, *args: object) -> None:
        arrived_at_kv.append(len(seen))  # the reader waits for the gate: nothing yet
        real_kv(self, *args)
        gate.set()

    monkeypatch.setattr(EngineCore, "_kv_and_scheduler", kv_and_scheduler)
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert arrived_at_kv == [0]
    assert seen[-1] == "closed" and len(seen) > 1  # every weight in before the engine is ready
    assert "load" in llm.engine.core.startup.phases
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    llm.close()


def test_a_start_that_fails_after_its_compile_stops_the_load(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure in the KV sizing or the scheduler's set-up, with the load still running,
    fails the start with its own error and leaves no loading thread; a load that fails while
    they run fails the start with the load's error."""
    from ember import LLM
    from ember.engine.core import EngineCore

    path = tiny_model_dir("llama")
    gate = threading.Event()
    seen = _slow(monkeypatch, path, gate)
    _beside_on_the_cpu(monkeypatch)

    def broken(self, *args: object) -> None:
        gate.set()
        while not seen:  # the load under way
            time.sleep(0.005)
        raise RuntimeError("no KV cache")

    with monkeypatch.context() as m:
        m.setattr(EngineCore, "_kv_and_scheduler", broken)
        with pytest.raises(RuntimeError, match="no KV cache"):
            LLM(str(path), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert not any(t.name == "weights-load" and t.is_alive() for t in threading.enumerate())
    total = len(load_file(next(path.glob("*.safetensors"))))
    assert seen[-1] == "closed" and len(seen) - 1 < total  # stopped before its end

    copy_without(path, tmp_path, "model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64)
    assert not any(t.name == "weights-load" and t.is_alive() for t in threading.enumerate())
