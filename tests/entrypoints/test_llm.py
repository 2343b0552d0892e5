"""The offline API end to end on the tiny model: sampling controls, stops, limits, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ember import LLM, SamplingParams
from tests.capture import captured_logits


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return LLM(str(qwen3), dtype="float32", max_model_len=512)


def prompts(n: int, length: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(n * 100 + length)
    return [torch.randint(10, 3000, (length + i,), generator=g).tolist() for i in range(n)]


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    p = prompts(1)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234, ignore_eos=True)
    alone = llm.generate(p, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3
    mixed = llm.generate([p, *prompts(3, 7)], [seeded, *others])[0].outputs[0].token_ids
    assert alone == mixed
    other_seed = SamplingParams(temperature=1.0, max_tokens=20, seed=99, ignore_eos=True)
    assert llm.generate(p, other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_are_distinct_and_seeded(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True)
    p = prompts(1, 40)[0]
    out = llm.generate(p, params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    ids = [tuple(o.token_ids) for o in out.outputs]
    assert len(set(ids)) == 3
    again = llm.generate(p, params)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == ids
    # All three share the prompt: the later samples start from the first one's blocks.
    assert out.num_cached_tokens > 0


def test_top_k_1_equals_greedy(llm: LLM) -> None:
    ps = prompts(4)
    want = [o.outputs[0].token_ids for o in llm.generate(ps, greedy())]
    top1 = SamplingParams(temperature=1.3, top_k=1, max_tokens=16, ignore_eos=True, seed=3)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, top1)] == want


def test_stop_strings_truncate_exactly(llm: LLM) -> None:
    p = prompts(1, 20)[0]
    full = llm.generate(p, greedy(40))[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[6:9]
    cut = text.index(stop)
    out = llm.generate(p, greedy(40, stop=[stop, "\x00never"]))[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    incl = llm.generate(p, greedy(40, stop=stop, include_stop_str_in_output=True))[0]
    assert incl.outputs[0].text == text[: cut + len(stop)]


def test_stop_token_ids_min_tokens_and_max_tokens(llm: LLM) -> None:
    p = prompts(1, 9)[0]
    toks = llm.generate(p, greedy(10))[0].outputs[0].token_ids
    stop_id = toks[2]
    first = toks.index(stop_id)
    out = llm.generate(p, greedy(10, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == toks[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens forbids the stop id until enough tokens exist.
    out = llm.generate(p, greedy(10, stop_token_ids=[stop_id], min_tokens=first + 2))[0].outputs[0]
    assert stop_id not in out.token_ids[: first + 2]
    assert len(out.token_ids) >= first + 2
    out = llm.generate(p, greedy(7))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(qwen3: Path) -> None:
    llm = LLM(str(qwen3), dtype="float32", max_model_len=256)
    eos = min(llm.get_tokenizer().eos_token_ids)
    # Make EOS the model's favourite token by boosting its logit.
    model = llm.engine.core.runner.model
    original = model.compute_logits

    def boosted(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        logits[:, eos] += 1000.0
        return logits

    model.compute_logits = boosted
    out = llm.generate(prompts(1)[0], SamplingParams(temperature=0, max_tokens=8))
    assert out[0].outputs[0].token_ids == [eos] and out[0].outputs[0].finish_reason == "stop"
    out = llm.generate(prompts(1)[0], greedy(5))[0].outputs[0]
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"
    out = llm.generate(prompts(1)[0], SamplingParams(temperature=0, max_tokens=8, min_tokens=3))
    assert len(out[0].outputs[0].token_ids) == 4 and eos not in out[0].outputs[0].token_ids[:3]


def test_logprobs_are_raw_log_softmax_with_top_alternatives(llm: LLM) -> None:
    with captured_logits(llm) as seen:
        out = llm.generate(prompts(1)[0], greedy(4, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    total = 0.0
    for step, tok, logits in zip(out.logprobs, out.token_ids, seen, strict=True):
        ref = torch.log_softmax(logits[0], dim=-1)
        top = torch.topk(ref, 3).indices.tolist()
        assert tok in step and set(top) <= set(step)
        for tid, lp in step.items():
            assert abs(lp.logprob - ref[tid].item()) < 1e-5
        assert step[tok].rank == 1  # greedy picks the most likely token
        assert [step[t].rank for t in top] == [1, 2, 3]
        total += step[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_mixed_prefill_and_decode_batches_match_unchunked(qwen3: Path) -> None:
    ps = prompts(6, 20)
    want = [o.outputs[0].token_ids for o in LLM(str(qwen3), dtype="float32").generate(ps, greedy())]
    small = LLM(str(qwen3), dtype="float32", max_num_batched_tokens=16, block_size=4)
    assert [o.outputs[0].token_ids for o in small.generate(ps, greedy())] == want


def test_preemption_gives_the_same_tokens(qwen3: Path) -> None:
    ps = prompts(4, 20)
    want = [
        o.outputs[0].token_ids for o in LLM(str(qwen3), dtype="float32").generate(ps, greedy(24))
    ]
    # 16 blocks of 4 tokens: four sequences of up to 44 tokens cannot all fit.
    tight = LLM(str(qwen3), dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64)
    got = [o.outputs[0].token_ids for o in tight.generate(ps, greedy(24))]
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert got == want
    assert tight.engine.core.kv.pool.num_free_blocks == 16


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("a", prompts(1, 40)[0], greedy(50))
    engine.add_request("b", prompts(1, 30)[0], SamplingParams(n=2, max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.core.kv.pool.num_free_blocks < engine.core.kv.pool.num_blocks
    engine.abort_request("a")
    engine.abort_request("b")
    assert not engine.has_unfinished_requests()
    assert engine.core.kv.pool.num_free_blocks == engine.core.kv.pool.num_blocks


def test_half_precision_runs_close_to_fp32(qwen3: Path) -> None:
    p = prompts(1, 30)[0]
    ref = LLM(str(qwen3), dtype="float32")
    seen: dict[str, torch.Tensor] = {}
    for dtype in ("float32", "bfloat16", "float16"):
        llm = ref if dtype == "float32" else LLM(str(qwen3), dtype=dtype)
        model = llm.engine.core.runner.model
        original = model.compute_logits
        model.compute_logits = lambda h, o=original, d=dtype: seen.setdefault(d, o(h))
        llm.generate(p, greedy(1))
        del model.compute_logits
    for dtype in ("bfloat16", "float16"):
        rel = (seen[dtype] - seen["float32"]).norm() / seen["float32"].norm()
        assert rel < 3e-2, f"{dtype}: relative error {rel:.3g}"


def test_dummy_weights_need_no_weight_files(qwen3: Path, tmp_path: Path) -> None:
    d = tmp_path / "noweights"
    shutil.copytree(qwen3, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(d))
    llm = LLM(str(d), load_format="dummy")
    out = llm.generate("hello", greedy(3))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_bad_input_names_the_problem(llm: LLM, qwen3: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_model_len is 512"):
        llm.generate([5] * 600, greedy())
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy())
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 10**9]], greedy())
    assert not llm.engine.has_unfinished_requests()  # nothing half-added

    bad = tmp_path / "bad"
    shutil.copytree(qwen3, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPTNeoXForCausalLM'"):
        LLM(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist|no config.json"):
        LLM(str(tmp_path / "nowhere"))
    (bad / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(bad))
    nottok = tmp_path / "notok"
    shutil.copytree(qwen3, nottok)
    (nottok / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        LLM(str(nottok))
    with pytest.raises(TypeError, match="unknown LLM arguments"):
        LLM(str(qwen3), gpu_memory_utilisation=0.5)


def test_chat_turns_reuse_the_conversations_ids_exactly(llm: LLM) -> None:
    """`LLM.chat` over a conversation's turns: each prompt's ids are a whole tokenization's, and
    every turn after the first reuses the ids of the turns before (the prefix cache's hits)."""
    tok = llm.engine.tokenizer
    cache = llm.engine.inputs.prompt_prefixes
    hits = cache.hits
    msgs = [{"role": "system", "content": "Be brief. é 漢字"}]
    for turn, said in enumerate(("read a.py", "now b.py <|im_end|> ok", "done")):
        msgs.append({"role": "user", "content": said})
        out = llm.chat(msgs, greedy(4))[0]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True)
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        assert cache.hits == hits + turn
        msgs.append({"role": "assistant", "content": out.outputs[0].text})
