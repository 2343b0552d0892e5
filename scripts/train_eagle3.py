"""Train an EAGLE-3 draft head for a target model from the target's own answers, in minutes.

1. The target answers the prompts of benchmarks/data/eagle3_prompts.jsonl through ember's `LLM`:
   a held-out tenth greedily, the rest --samples times at --temperature (more, varied contexts).
2. A plain forward of prompt + answer gives, at every position p, the target's aux hidden states h_p
   (`DecoderModel.aux_layers`) and its greedy next token y_p: the labels, what verification accepts.
3. The draft vocabulary is the --draft-vocab-size tokens the target predicts most often in its
   answers (d2t/t2d); lm_head and norm start as the target's rows for those tokens.
4. Training-time test (EAGLE-3): step j = 0..K-1 unrolls the chain as `Eagle3Drafter.propose`
   runs it. At step j, row p stands for position p + j of a chain started at p: its input is token
   t_{p+1+j} and (j = 0) fc(h_p) or (j > 0) the row's own step j - 1 output; it attends to the step-0
   keys of positions <= p and to its own keys of steps 1..j; its label is y_{p+1+j}. Loss: the
   cross-entropy of each step, weighted 0.8^j, over answer positions whose label is in the vocab.
   The weights that score best on the held-out answers are kept.
5. The head is written in the published layout (config.json + model.safetensors), with
   train_summary.json: per-step accuracy on the held-out answers, `mean_accepted_length` (averaged
   over every answer position as a chain start) and `replay_mean_accepted_length`: the tokens per
   target step of greedy speculative decoding of those answers with the real drafter (the number
   the engine would see; lower, since accepted runs skip the easy positions).

    python scripts/train_eagle3.py --model smollm2 --out /tmp/eagle3-smollm2 [--device cuda]

On one H200 (SmolLM2-135M-Instruct, 320 prompts, K = 4, 1500 steps): about 70 s of training; the
held-out replay accepted 2.18 tokens per step (1.85 with one greedy answer per prompt).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ember.models.config import ModelConfig  # noqa: E402
from ember.models.loader import load_model  # noqa: E402
from ember.models.resolve import KNOWN_MODELS, get_model  # noqa: E402
from ember.spec_decode.eagle3 import (  # noqa: E402
    DraftRow,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3DraftModel,
    default_aux_layers,
)
from scripts.eagle3_data import (  # noqa: E402
    Sample,
    attention,
    draft_vocab,
    generate,
    in_answer,
    target_states,
)
from scripts.eagle3_ttt import shift, ttt_forward  # noqa: E402

PROMPTS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "eagle3_prompts.jsonl"
STEP_WEIGHT = 0.8


def head_config(target_cfg: ModelConfig, aux_layers: tuple[int, ...], draft_size: int) -> dict:
    """config.json of the head in the published layout (the target's layer shape)."""
    t = target_cfg
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "hidden_act": t.hidden_act,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": t.rope_theta,
        "rope_scaling": t.rope_scaling,
        "max_position_embeddings": t.max_position_embeddings,
        "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_size,
        "target_hidden_size": t.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layers),
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def init_head(config: dict, target: torch.nn.Module, draft_ids: torch.Tensor) -> Eagle3DraftModel:
    """A fresh head reading the target's embedding; lm_head and norm start as the target's, so
    the draft's logits begin in the target's output space."""
    device = draft_ids.device
    with torch.device(device):
        model = Eagle3DraftModel(
            Eagle3Config.from_dict(config),
            target.model.embed_tokens,
            max_position=target.model.rotary.cos_cache.shape[0],
        )
    with torch.no_grad():
        model.d2t.copy_(draft_ids - torch.arange(len(draft_ids), device=device))
        model.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        model.norm.weight.copy_(target.model.norm.weight)
    return model


def batches(samples: list[Sample], batch_tokens: int) -> list[list[Sample]]:
    """Length-sorted groups whose padded size stays under batch_tokens."""
    out: list[list[Sample]] = []
    for smp in sorted(samples, key=lambda x: len(x.ids)):
        if out and (len(out[-1]) + 1) * len(smp.ids) <= batch_tokens:
            out[-1].append(smp)
        else:
            out.append([smp])
    return out


def collate(group: list[Sample], to_draft: torch.Tensor) -> tuple[torch.Tensor, ...]:
    s = max(len(x.ids) for x in group)

    def pad(t: torch.Tensor, fill: float | int | bool) -> torch.Tensor:
        return torch.cat([t, t.new_full((s - len(t), *t.shape[1:]), fill)])

    ids = torch.stack([pad(x.ids, 0) for x in group])
    aux = torch.stack([pad(x.aux, 0.0) for x in group])
    labels = torch.stack([pad(to_draft[x.labels], -1) for x in group])
    answer = torch.stack([pad(in_answer(x), False) for x in group])
    return ids, aux, labels, answer


def evaluate(
    model: Eagle3DraftModel, groups: list[list[Sample]], to_draft: torch.Tensor, steps: int
) -> dict:
    """Per-step accuracy, and the mean accepted length of greedy verification of `steps` drafts
    (1 + the expected number of leading correct drafts) over held-out answer positions."""
    hits, runs, rows = torch.zeros(steps), 0.0, 0
    with torch.no_grad():
        for g in groups:
            ids, aux, labels, answer = collate(g, to_draft)
            _, correct = ttt_forward(model, ids, aux, labels, answer, steps)
            base = shift(answer, 1, False)  # chains whose first draft is an answer token
            run = torch.ones_like(base)
            for j, c in enumerate(correct):
                hits[j] += c.sum().item()
                run = run & c
                runs += (run & base).sum().item()
            rows += base.sum().item()
    rows = max(rows, 1)
    return {
        "step_accuracy": [round(h / rows, 4) for h in hits.tolist()],
        "mean_accepted_length": round(1 + runs / rows, 4),
        "eval_positions": rows,
    }


@torch.no_grad()
def replay(out_dir: Path, target: torch.nn.Module, samples: list[Sample], k: int) -> dict:
    """Greedy speculative decoding of held-out answers, replayed with the real drafter
    (`Eagle3Drafter.propose` over its paged KV, the engine's attention backend). Each answer is the
    target's greedy output, so a draft is accepted exactly when it matches the answer's next tokens;
    the result is the tokens each target step would produce (the mean accepted length)."""
    device = samples[0].ids.device
    drafter = Eagle3Drafter(str(out_dir), target, 16, torch.float32, device, attention(device))
    table = list(range(-(-(max(len(x.ids) for x in samples) + k) // 16)))
    drafter.allocate_kv_cache(len(table))
    steps = produced = 0
    for smp in samples:
        ids, end = smp.ids.tolist(), len(smp.ids) - 1
        start, n = 0, smp.answer_start  # x_0..x_n are known; positions start..n-1 need draft KV
        while n < end:
            row = DraftRow(table, start, ids[start + 1 : n + 1], smp.aux[start:n])
            drafts = drafter.propose([row], k)[0]
            a = 0
            while a < k and n + 1 + a <= end and drafts[a] == ids[n + 1 + a]:
                a += 1
            steps, produced = steps + 1, produced + min(a + 1, end - n)
            start, n = n, n + a + 1
    return {
        "replay_mean_accepted_length": round(produced / max(steps, 1), 4),
        "replay_steps": steps,
    }


def train(
    model: Eagle3DraftModel,
    train_groups: list[list[Sample]],
    eval_groups: list[list[Sample]],
    to_draft: torch.Tensor,
    args: argparse.Namespace,
) -> tuple[list[dict], int]:
    """AdamW with warm-up and cosine decay, for max_steps or max_seconds, whichever ends first.
    Every log_every steps the held-out answers are scored; the best weights are kept, since a
    few hundred answers are learnt by heart long before the budget ends."""
    params = [p for n, p in model.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, args.max_steps // 20)
    log, started, done = [], time.perf_counter(), 0
    best, best_state = 0.0, None
    for step in range(args.max_steps):
        if time.perf_counter() - started > args.max_seconds:
            break
        cosine = 0.5 + 0.5 * math.cos(math.pi * step / args.max_steps)
        lr = args.lr * min(1, (step + 1) / warmup) * cosine
        for g in opt.param_groups:
            g["lr"] = lr
        group = train_groups[step % len(train_groups)]
        if step % len(train_groups) == len(train_groups) - 1:
            random.shuffle(train_groups)
        ids, aux, labels, answer = collate(group, to_draft)
        losses, correct = ttt_forward(model, ids, aux, labels, answer, args.ttt_steps)
        loss = sum(STEP_WEIGHT**j * x for j, x in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        done += 1
        if step % args.log_every == 0 or step == args.max_steps - 1:
            scored = max(1, int(shift(answer, 1, False).sum()))
            entry = {
                "step": step,
                "loss": round(loss.item(), 4),
                "acc": [round(int(c.sum()) / scored, 3) for c in correct],
                "seconds": round(time.perf_counter() - started, 1),
            }
            if eval_groups:
                entry["eval"] = evaluate(model, eval_groups, to_draft, args.ttt_steps)
                if (score := entry["eval"]["mean_accepted_length"]) > best:
                    best, best_state = (
                        score,
                        {
                            k: v.detach().clone()
                            for k, v in model.state_dict().items()
                            if not k.startswith("embed_tokens")
                        },
                    )
            log.append(entry)
            print(json.dumps(entry), flush=True)
    if best_state is not None:
        model.load_state_dict(best_state, strict=False)
    return log, done


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help=f"target dir, or one of {sorted(KNOWN_MODELS)}")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=Path, default=PROMPTS)
    p.add_argument("--max-prompts", type=int, default=0, help="0: all")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7, help="of the training answers")
    p.add_argument("--samples", type=int, default=4, help="answers per training prompt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="the target's dtype while it answers")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=4, help="K: chain steps unrolled")
    p.add_argument("--max-steps", type=int, default=1500)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.samples > 1 and args.temperature == 0:
        p.error("--samples > 1 needs --temperature > 0 (greedy answers would repeat)")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    model_dir = get_model(args.model) if args.model in KNOWN_MODELS else Path(args.model)
    device = torch.device(args.device)

    t0 = time.perf_counter()
    train_seqs, eval_seqs = generate(model_dir, args)
    t_gen = time.perf_counter() - t0
    gc.collect()  # the engine's KV cache goes before training needs the memory
    if device.type == "cuda":
        torch.cuda.empty_cache()
    target = load_model(model_dir, dtype=torch.float32, device=device)
    target.requires_grad_(False)
    aux_layers = default_aux_layers(target.config.num_hidden_layers)
    target.model.aux_layers = aux_layers
    samples = target_states(target, train_seqs, device, args.batch_tokens)
    held_out = target_states(target, eval_seqs, device, args.batch_tokens)
    target.model.aux_layers = ()

    vocab = target.config.vocab_size
    draft_ids = draft_vocab(samples, min(args.draft_vocab_size, vocab), vocab).to(device)
    to_draft = torch.full((vocab,), -1, dtype=torch.int64, device=device)
    to_draft[draft_ids] = torch.arange(len(draft_ids), device=device)
    config = head_config(target.config, aux_layers, len(draft_ids))
    model = init_head(config, target, draft_ids)

    eval_groups = batches(held_out, args.batch_tokens)
    train_groups = batches(samples, args.batch_tokens)
    random.shuffle(train_groups)
    # Triton's kernels (RMSNorm, rotary, SiLU) have no backward: train on the PyTorch paths.
    triton_env = os.environ.get("EMBER_DISABLE_TRITON")
    os.environ["EMBER_DISABLE_TRITON"] = "1"
    t1 = time.perf_counter()
    log, steps = train(model, train_groups, eval_groups, to_draft, args)
    t_train = time.perf_counter() - t1
    summary = evaluate(model, eval_groups or train_groups, to_draft, args.ttt_steps)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.published_weights().items()}
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    if triton_env is None:  # the drafter runs on the engine's kernels again
        del os.environ["EMBER_DISABLE_TRITON"]
    else:
        os.environ["EMBER_DISABLE_TRITON"] = triton_env
    t2 = time.perf_counter()
    summary |= replay(args.out, target, held_out or samples, args.ttt_steps)
    summary |= {
        "target": str(model_dir),
        "train_sequences": len(train_seqs),
        "eval_sequences": len(eval_seqs),
        "answer_tokens": sum(len(s) - a for s, a in train_seqs),
        "draft_vocab_size": len(draft_ids),
        "aux_layers": list(aux_layers),
        "ttt_steps": args.ttt_steps,
        "steps": steps,
        "generate_s": round(t_gen, 1),
        "train_s": round(t_train, 1),
        "replay_s": round(time.perf_counter() - t2, 1),
        "log": log,
    }
    (args.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}))


if __name__ == "__main__":
    main()
