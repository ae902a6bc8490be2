"""Train the quality model on CPU with plain torch, one thread.

    OMP_NUM_THREADS=1 python -m kvbench.quality.train      # 44 min on one 2-core-VM thread
    OMP_NUM_THREADS=1 python -m kvbench.quality.train --task long --init-from bench/quality/model  # 55 min

Each training context (up to 6 chunks) is followed by a question about every
person in it, each question seeing the context and nothing else (`batch_loss`).
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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import DynamicCache

from kvbench.common.args import count

from . import data, longdata, modeling

# Task name -> (example module, default model directory, max positions of the model).
TASKS = {"short": (data, modeling.MODEL_DIR, 256), "long": (longdata, modeling.LONG_MODEL_DIR, 512)}


class Curriculum:
    """Context length follows progress, not the clock.

    Contexts hold 2..level chunks; the level goes up by one when greedy exact match
    on contexts of exactly `level` chunks reaches PROMOTE_AT. With two chunks the
    lookup has few candidates and short sequences, so the binding + lookup circuit
    forms in a few thousand fast steps; it then carries over to longer contexts.
    (A curriculum on a timer lengthened contexts before the circuit existed and
    left runs on the 25% plateau: docs/quality.md.)
    """

    PROMOTE_AT = 0.8
    PROBE_SIZE = 128

    def __init__(self, top: int, start: int = 2, task=data) -> None:
        self.level = min(start, top)
        self.top = top
        self.task = task  # the task module (`data` or `longdata`)

    def chunks(self, rng: random.Random) -> int:
        return rng.randint(2, self.level)

    def update(self, model, tok) -> float | None:
        """Exact match at the current level (None at the top); promotes if it is high enough."""
        if self.level >= self.top:
            return None
        rng = random.Random(self.task.TRAIN_SEED + 10_000 + self.level)  # a fixed probe per level
        probe = [self.task.make_example(rng, self.level) for _ in range(self.PROBE_SIZE)]
        em = exact_match_full_prefill(model, tok, probe)["all"]
        if em >= self.PROMOTE_AT:
            self.level += 1
        return em


@dataclass(frozen=True)
class Batch:
    """Contexts, and every question about them asked on its own.

    context    [B, W] chunk tokens, right-padded
    context_w  [B, W] loss weight of predicting token t from t-1 (0 on pads)
    lengths    [B] real tokens per context
    of         [Q] the context each question belongs to
    qa         [Q, S] question words, answer, EOS (all the same length here)
    qa_w       [Q, S] loss weight, as context_w
    """

    context: torch.Tensor
    context_w: torch.Tensor
    lengths: torch.Tensor
    of: torch.Tensor
    qa: torch.Tensor
    qa_w: torch.Tensor


AUX_WEIGHT = 0.1


def make_batch(rng: random.Random, tok, batch: int, curriculum: Curriculum) -> Batch:
    """One context per row, each followed (separately) by a question about every person in it."""
    contexts, of, qas, qa_ws = [], [], [], []
    for i in range(batch):
        ctx = curriculum.task.make_context(rng, curriculum.chunks(rng))
        contexts.append([t for c in ctx.chunks for t in tok.encode(c, add_special_tokens=False)])
        for p in ctx.persons:
            q = tok.encode(data.question_about(p.city), add_special_tokens=False)
            a = tok.encode(p.name, add_special_tokens=False) + [tok.eos_token_id]
            of.append(i)
            qas.append(q + a)
            # The first question word follows the context: nothing to learn there.
            qa_ws.append([0.0] + [AUX_WEIGHT] * (len(q) - 1) + [1.0] * len(a))
    width = max(map(len, contexts))
    ids = torch.full((batch, width), tok.pad_token_id, dtype=torch.long)
    w = torch.zeros((batch, width))
    for i, c in enumerate(contexts):
        ids[i, : len(c)] = torch.tensor(c)
        w[i, : len(c)] = AUX_WEIGHT
    return Batch(ids, w, torch.tensor(list(map(len, contexts))), torch.tensor(of),
                 torch.tensor(qas), torch.tensor(qa_ws))


def _weighted_ce(logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of weighted next-token cross entropy, and the sum of weights."""
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
    wt = w[:, 1:].reshape(-1)
    return (ce * wt).sum(), wt.sum()


def batch_loss(model, b: Batch) -> torch.Tensor:
    """Weighted loss of the contexts and of every question, each question seeing only
    its own context and itself.

    Questions that see each other can be answered by elimination ("a name not given
    yet") and by position, and a model trained so learns that instead of reading the
    city's binding (docs/quality.md). So each context runs once, its KV is copied
    once per question, and all questions run as one batch on top.
    """
    cache = DynamicCache()
    # Right padding: a causal model never lets a real context token see a pad.
    out = model(input_ids=b.context, past_key_values=cache, use_cache=True)
    ctx_loss, ctx_w = _weighted_ce(out.logits, b.context, b.context_w)
    per_question = DynamicCache()
    for layer, kv in enumerate(cache.layers):
        per_question.update(kv.keys.index_select(0, b.of), kv.values.index_select(0, b.of), layer)
    width, s = b.context.shape[1], b.qa.shape[1]
    real = torch.arange(width)[None, :] < b.lengths[b.of, None]  # [Q, W] context tokens, not pads
    mask = torch.cat([real, torch.ones(len(b.of), s, dtype=torch.bool)], dim=1).long()
    positions = b.lengths[b.of, None] + torch.arange(s)[None, :]  # right after the context
    qa_logits = model(input_ids=b.qa, attention_mask=mask, position_ids=positions,
                      past_key_values=per_question).logits
    qa_loss, qa_w = _weighted_ce(qa_logits, b.qa, b.qa_w)
    return (ctx_loss + qa_loss) / (ctx_w + qa_w)


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


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="short",
                    help="short: 6 chunks of 7-10 words (data); long: 5-8 chunks of 32-52 words (longdata)")
    ap.add_argument("--out", type=Path, default=None, help="default: the task's committed model directory")
    ap.add_argument("--steps", type=count(), default=100_000, help="upper bound; --minutes or --target stops first")
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget for training")
    ap.add_argument("--batch", type=count(), default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=count(0), default=100)
    ap.add_argument("--hidden", type=count(), default=128)
    ap.add_argument("--intermediate", type=count(), default=384)
    ap.add_argument("--layers", type=count(), default=4)
    ap.add_argument("--heads", type=count(), default=4)
    ap.add_argument("--kv-heads", type=count(), default=2)
    ap.add_argument("--eval-every", type=count(), default=100)
    ap.add_argument("--eval-size", type=count(), default=256)
    ap.add_argument("--target", type=float, default=0.985, help="stop early at this held-out EM")
    ap.add_argument("--seed", type=count(0), default=0)
    ap.add_argument("--threads", type=count(), default=1)
    ap.add_argument("--init-from", type=Path, default=None, help="continue from a saved model directory")
    return ap.parse_args(argv)


def _model(args: argparse.Namespace, tok, max_positions: int):
    """A fresh model of the arguments' shape, or the one of --init-from grown to the vocabulary."""
    cfg = modeling.build_config(
        len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max_positions,
    )
    if args.init_from is not None:
        model = modeling.LlamaForCausalLM.from_pretrained(str(args.init_from), torch_dtype=torch.float32)
        # Words are only ever appended to the vocabulary, so old ids keep their rows.
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        # RoPE has no learned positions: a model of the short task serves longer prompts.
        model.config.max_position_embeddings = max_positions
    else:
        model = modeling.LlamaForCausalLM(cfg)
    model.train()
    return model


def _optimizer(model, lr: float) -> torch.optim.Optimizer:
    """AdamW, weight decay on the matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.98),
    )


def _lr_at(args: argparse.Namespace, step: int, elapsed: float, top_since: float | None, budget_s: float) -> float:
    """Peak rate while the curriculum climbs, then a cosine over the rest of the time
    budget (step counts vary with machine load, so the schedule runs on the clock)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if top_since is None:
        return args.lr
    frac = (elapsed - top_since) / max(budget_s - top_since, 1.0)
    return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def _train(args: argparse.Namespace, model, tok, task, heldout: list[data.Example],
           rng: random.Random) -> tuple[int, float, dict, list[dict]]:
    """The training loop, on the clock: (steps, seconds, best held-out EM, evaluation log).
    Every --eval-every steps the curriculum may climb and the best checkpoint is saved."""
    opt = _optimizer(model, args.lr)
    budget_s = args.minutes * 60
    curriculum = Curriculum(max(task.CHUNK_COUNTS), task=task)
    top_since: float | None = None  # seconds into the run when contexts reached full length
    log: list[dict] = []
    t0 = time.time()
    best: dict = {}
    ema = None
    with Progress(
        TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f}s"),
        TextColumn("{task.fields[msg]}"), TimeElapsedColumn(), TimeRemainingColumn(),
    ) as bar:
        bar_task = bar.add_task("train", total=budget_s, msg="")
        step = 0
        while step < args.steps:
            elapsed = time.time() - t0
            if elapsed > budget_s:
                break
            for g in opt.param_groups:
                g["lr"] = _lr_at(args, step, elapsed, top_since, budget_s)
            loss = batch_loss(model, make_batch(rng, tok, args.batch, curriculum))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
            bar.update(bar_task, completed=min(time.time() - t0, budget_s), msg=f"step {step} loss {ema:.3f}")
            if step % args.eval_every == 0:
                level = curriculum.level
                level_em = curriculum.update(model, tok)
                if top_since is None and curriculum.level >= curriculum.top:
                    top_since = time.time() - t0
                em = exact_match_full_prefill(model, tok, heldout)
                rec = {"step": step, "seconds": round(time.time() - t0, 1), "loss": round(ema, 4),
                       "chunks": level, "em_at_chunks": None if level_em is None else round(level_em, 4),
                       **{f"em_{k}": round(v, 4) for k, v in em.items()}}
                log.append(rec)
                bar.console.log(json.dumps(rec))
                if em["all"] > best.get("all", -1.0):
                    # Keep the best checkpoint: a late bad step never costs the run.
                    best = em
                    save(model, tok, args.out)
                if em["all"] >= args.target:
                    break
    return step, time.time() - t0, best, log


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    task, model_dir, max_positions = TASKS[args.task]
    args.out = args.out or model_dir
    rng = random.Random(task.TRAIN_SEED + args.seed)
    tok = modeling.build_tokenizer(task.vocabulary())
    model = _model(args, tok, max_positions)
    n_params = sum(p.numel() for p in model.parameters())
    # Checkpoints are picked on the default held-out draw; reports use seed 1, never picked on.
    heldout = task.examples("heldout", args.eval_size)
    step, train_s, best, log = _train(args, model, tok, task, heldout, rng)
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
