"""The EAGLE-3 draft chain's graph holder (ember/engine/eagle3_graphs.py): its path off a GPU, the
same launches a captured graph replays, over static buffers padded to a batch size, gives the
eager chain's drafts and writes the same KV, and its padding rows write none (Triton's
interpreter: the Triton attention backend reads no host data, as in a graph). On a GPU the
captured graphs give the eager chain's drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember.attention.torch_backend import TorchAttentionBackend
from ember.attention.triton_backend import TritonAttentionBackend
from ember.engine.eagle3_graphs import ChainGraphs
from ember.models.loader import load_model
from ember.spec_decode.eagle3 import Eagle3Drafter
from ember.spec_decode.eagle3_chain import chain_drafts
from tests.spec_decode.test_eagle3 import BLOCK, write_head

K = 4
TABLES = [[3, 7, 1, 0], [5, 2, 0, 0], [9, 4, 6, 8]]
LAST = [6, 2, 9]  # each row's last written position (its first draft's)


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir) -> Path:  # type: ignore[no-untyped-def]
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("head"), target_dir)


@pytest.fixture
def target(target_dir: Path) -> torch.nn.Module:
    return load_model(target_dir, dtype=torch.float32)


def _drafter(head: Path, model: torch.nn.Module, device: str, backend) -> Eagle3Drafter:  # type: ignore[no-untyped-def]
    d = Eagle3Drafter(str(head), model, BLOCK, torch.float32, torch.device(device), backend)
    d.allocate_kv_cache(16)
    g = torch.Generator().manual_seed(4)
    d.kv_cache.copy_(torch.randn(d.kv_cache.shape, generator=g))  # the rows' cached context
    return d


def _inputs(d: Eagle3Drafter, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(9)
    n = len(TABLES)
    first = torch.randint(0, 200, (n,), generator=g) + d.model.d2t[:n].cpu()
    hidden = torch.randn(n, d.model.config.layer.hidden_size, generator=g)
    tables = torch.tensor(TABLES, dtype=torch.int32)
    last = torch.tensor(LAST, dtype=torch.int64)
    return tuple(x.to(device) for x in (first, hidden, last, tables))


def _graphs(d: Eagle3Drafter, device: str) -> ChainGraphs:
    """Graphs of K drafts for up to 8 rows, contexts of 16 blocks, tables 6 wide."""
    hidden = d.model.config.layer.hidden_size
    return ChainGraphs(
        d.model, hidden, d.backend, BLOCK, K, 8, 16 * BLOCK, 6, torch.float32, torch.device(device)
    )


def _eager(d: Eagle3Drafter, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    first, hidden, last, tables = inputs
    lens = [p + 1 for p in LAST]
    return chain_drafts(
        d.model, d.kv_cache, d.backend, BLOCK, first, hidden, last, tables, K, 16 * BLOCK, lens
    )


def test_the_graph_path_off_a_gpu_drafts_as_the_eager_chain(
    head_dir: Path,
    target: torch.nn.Module,
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter's run; on a GPU the captured test below runs")
    reference = _drafter(head_dir, target, "cpu", TorchAttentionBackend())
    want = _eager(reference, _inputs(reference, "cpu"))
    eager = _drafter(head_dir, target, "cpu", TritonAttentionBackend())
    assert torch.equal(_eager(eager, _inputs(eager, "cpu")), want)
    staged = _drafter(head_dir, target, "cpu", TritonAttentionBackend())
    graphs = _graphs(staged, "cpu")
    assert graphs.size_for(3) == 4  # three rows and one padding row
    before = staged.kv_cache.clone()
    got = graphs.run(*_inputs(staged, "cpu"), staged.kv_cache)
    assert torch.equal(got, want)
    # The same KV written (to float32 rounding: four rows' matmuls, not three) ...
    torch.testing.assert_close(staged.kv_cache, eager.kv_cache, rtol=0, atol=1e-5)
    assert not torch.equal(staged.kv_cache, before)
    # ... and nothing else: no real row's positions reach block 0, the padding row's table.
    assert torch.equal(staged.kv_cache[0], before[0])
    with pytest.raises(ValueError, match="take up to 8 rows"):
        graphs.run(*(torch.cat([x] * 3) for x in _inputs(staged, "cpu")), staged.kv_cache)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_chains_draft_as_the_eager_chain(
    head_dir: Path,
    target: torch.nn.Module,
) -> None:
    target = target.to("cuda")
    eager = _drafter(head_dir, target, "cuda", TritonAttentionBackend())
    want = _eager(eager, _inputs(eager, "cuda"))
    staged = _drafter(head_dir, target, "cuda", TritonAttentionBackend())
    graphs = _graphs(staged, "cuda")
    graphs.capture(staged.kv_cache)
    # (the captures' runs wrote the cache: back to the rows' context)
    staged.kv_cache.copy_(_drafter(head_dir, target, "cuda", TritonAttentionBackend()).kv_cache)
    got = graphs.run(*_inputs(staged, "cuda"), staged.kv_cache)
    assert torch.equal(got, want)
    torch.testing.assert_close(staged.kv_cache, eager.kv_cache, rtol=0, atol=1e-5)
