"""Train the quality model on CPU with plain torch, one thread.

    OMP_NUM_THREADS=1 python -m kvbench.quality.train --minutes 25

Each training sequence is one context (4 chunks) followed by several
question/answer pairs about it, so one forward pass carries several answers.
The loss counts answer tokens (and EOS) fully and the rest of the text lightly:
context words are mostly random draws, but their templates are worth learning.
Exact match is measured on held-out prompts with exactly one question, as the
benchmark asks them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import data, modeling


def chunks_for(rng: random.Random, frac: float) -> int:
    """Curriculum on context length: 2 chunks first, growing to the task's
    largest count by the end of the curriculum share of the budget.

    With few distractor tokens the attention to the right fact gets a visible
    gradient early; the lookup circuit then carries over to longer contexts.
    """
    longest = max(data.CHUNK_COUNTS)
    if frac < CURRICULUM_FRAC[0]:
        return rng.randint(2, 2 + int((longest - 2) * frac / CURRICULUM_FRAC[0]))
    return rng.choice(data.CHUNK_COUNTS)


CURRICULUM_FRAC = [0.3]  # set from --curriculum


def training_sequence(rng: random.Random, tok, n_questions: int, frac: float = 1.0) -> tuple[list[int], list[float]]:
    """Token ids and per-token loss weights (weight of predicting token t at t-1)."""
    ctx = data.make_context(rng, chunks_for(rng, frac))
    ids: list[int] = []
    weights: list[float] = []
    for chunk in ctx.chunks:
        c = tok.encode(chunk, add_special_tokens=False)
        ids += c
        weights += [PRONOUN_WEIGHT if w in data.PRONOUNS else AUX_WEIGHT for w in chunk.split()]
    asked: set[str] = set()
    # One question per person at most: a repeated question would be a free copy
    # of the answer given earlier in the same sequence.
    for _ in range(min(n_questions, len(ctx.persons))):
        for _ in range(20):
            question, answer, _, _ = data.make_question(rng, ctx)
            if question not in asked:
                break
        else:
            break
        asked.add(question)
        q = tok.encode(question, add_special_tokens=False)
        a = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        ids += q + a
        weights += [AUX_WEIGHT] * len(q) + [1.0] * len(a)
    return ids, weights


AUX_WEIGHT = 0.1
# "he"/"she" inside a chunk is predictable only by resolving who the chunk is
# about, across the chunk boundary for "they" chunks: weigh it like an answer.
PRONOUN_WEIGHT = 1.0


def make_batch(rng: random.Random, tok, batch: int, n_questions: int, frac: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = [training_sequence(rng, tok, n_questions, frac) for _ in range(batch)]
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
    w = torch.zeros((batch, width))
    for i, (s, ws) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        w[i, : len(ws)] = torch.tensor(ws)
    return ids, w


def weighted_loss(model, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Right padding only: a causal model never lets a real token see a pad, so no mask.
    logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    wt = w[:, 1:].reshape(-1)
    return (ce * wt).sum() / wt.sum()


@torch.no_grad()
def exact_match_full_prefill(model, tok, examples: list[data.Example], batch: int = 64) -> dict[str, float]:
    """Greedy exact match with full prefill, batched by teacher forcing.

    Greedy decoding gets every answer token (and EOS) right exactly when the
    argmax at each answer position, fed the gold prefix, is the gold token.
    """
    model.eval()
    hits: dict[str, list[int]] = {}
    for start in range(0, len(examples), batch):
        part = examples[start : start + batch]
        enc = [modeling.encode(tok, e) for e in part]
        seqs = [e.prompt_ids + list(e.answer_ids) for e in enc]
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        pred = model(input_ids=ids).logits.argmax(-1)  # [B, T]
        for i, (e, ex) in enumerate(zip(enc, part)):
            p = len(e.prompt_ids)
            n = len(e.answer_ids)
            ok = bool((pred[i, p - 1 : p - 1 + n] == ids[i, p : p + n]).all())
            hits.setdefault(ex.kind, []).append(int(ok))
            hits.setdefault("all", []).append(int(ok))
    model.train()
    return {k: sum(v) / len(v) for k, v in hits.items()}


def save(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=modeling.MODEL_DIR)
    ap.add_argument("--steps", type=int, default=4000, help="upper bound; --minutes usually stops first")
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget for training")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--questions", type=int, default=8, help="QA pairs per training context")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-size", type=int, default=256)
    ap.add_argument("--target", type=float, default=0.97, help="stop early at this held-out EM")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--curriculum", type=float, default=0.3, help="fraction of the budget on short contexts")
    ap.add_argument("--init-from", type=Path, default=None, help="continue from a saved model directory")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    CURRICULUM_FRAC[0] = max(args.curriculum, 1e-6)
    torch.manual_seed(args.seed)
    rng = random.Random(data.TRAIN_SEED + args.seed)
    tok = modeling.build_tokenizer()
    cfg = modeling.build_config(
        len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
    )
    if args.init_from is not None:
        model = modeling.LlamaForCausalLM.from_pretrained(str(args.init_from), torch_dtype=torch.float32)
        # Words are only ever appended to the vocabulary, so old ids keep their rows.
        model.resize_token_embeddings(len(tok), mean_resizing=False)
    else:
        model = modeling.LlamaForCausalLM(cfg)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    heldout = data.examples("heldout", args.eval_size)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98),
    )
    budget_s = args.minutes * 60
    # Cosine schedule over the time budget (step counts vary with machine load).
    def lr_at(step: int, frac: float) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    log: list[dict] = []
    t0 = time.time()
    best = {}
    ema = None
    with Progress(
        TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}s"),
        TextColumn("{task.fields[msg]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    ) as bar:
        task = bar.add_task("train", total=budget_s, msg="")
        step = 0
        while step < args.steps:
            elapsed = time.time() - t0
            if elapsed > budget_s:
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step, elapsed / budget_s)
            ids, w = make_batch(rng, tok, args.batch, args.questions, elapsed / budget_s)
            loss = weighted_loss(model, ids, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            bar.update(task, completed=min(time.time() - t0, budget_s), msg=f"step {step} loss {ema:.3f}")
            if step % args.eval_every == 0:
                em = exact_match_full_prefill(model, tok, heldout)
                rec = {"step": step, "seconds": round(time.time() - t0, 1), "loss": round(ema, 4),
                       **{f"em_{k}": round(v, 4) for k, v in em.items()}}
                log.append(rec)
                bar.console.log(json.dumps(rec))
                if em["all"] > best.get("all", -1.0):
                    # Keep the best checkpoint: a late bad step never costs the run.
                    best = em
                    save(model, tok, args.out)
                if em["all"] >= args.target:
                    break
    train_s = time.time() - t0
    em = exact_match_full_prefill(model, tok, heldout)
    summary = {"steps": step, "train_seconds": round(train_s, 1), "params": n_params,
               "final_heldout_em": em, "args": {k: str(v) for k, v in vars(args).items()},
               "threads": args.threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if em["all"] >= best.get("all", -1.0):
        save(model, tok, args.out)
    else:
        summary["saved"] = f"best checkpoint, held-out EM {best}"
    print(json.dumps(summary))
    (args.out / "training_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))


if __name__ == "__main__":
    main()
