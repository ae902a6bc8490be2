"""`kvcraft model parity`: the reference engine against transformers on the real model, measured.

On the folder `kvcraft model fetch` builds (fp32): logits of a chat prompt of about
`--tokens` tokens (max |diff| / max |logit|), greedy answers of `--new` tokens (identical
or not), and the time of one prefill of that prompt by each (best of `--repeat`; both
project the last row only onto the vocabulary, as serving does). The prompt is real
text: the model's own Apache-2.0 license, kept in the folder, and a question about it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from kvbench.common.args import count
from kvbench.common.realmodel import chat, fetch
from kvbench.common.rows import best_time

QUESTION = "Who may reproduce the Work?"


def license_prompt(folder: Path, tok, n_tokens: int) -> list[int]:  # noqa: ANN001
    """The longest chat over a word prefix of the folder's LICENSE that fits in n_tokens."""
    words = (Path(folder) / "LICENSE").read_text().split(" ")
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(chat(tok, " ".join(words[:mid]), QUESTION)) <= n_tokens else (lo, mid - 1)
    return chat(tok, " ".join(words[:lo]), QUESTION)


def measure(folder: Path, n_tokens: int = 1024, new_tokens: int = 16, repeat: int = 3) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from engine_adapter.generate import greedy, stop_tokens
    from engine_adapter.llama import LlamaEngine

    hf_logging.disable_progress_bar()
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = LlamaEngine.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = license_prompt(folder, tok, n_tokens)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V]
    got, kv = engine.prefill(ids[0])
    rel = float((got - ref).abs().max() / ref.abs().max())

    with torch.no_grad():
        hf_s = best_time(lambda: hf(ids, logits_to_keep=1), repeat)
        ours_s = best_time(lambda: engine.prefill(ids[0], all_logits=False), repeat)
        ref_gen = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, len(prompt):].tolist()
    logits, kv = engine.prefill(ids[0], all_logits=False)
    gen = greedy(engine, logits, kv, new_tokens, stop_tokens(folder))
    return {"prompt_tokens": len(prompt), "threads": torch.get_num_threads(),
            "logits_max_abs_diff": float((got - ref).abs().max()), "logits_rel_diff": rel,
            "greedy_identical": list(gen.tokens) == ref_gen, "answer": tok.decode(gen.tokens),
            "answer_transformers": tok.decode(ref_gen),
            "prefill_s": {"kvcraft": round(ours_s, 3), "transformers": round(hf_s, 3)},
            "decode_ms_per_token": {"kvcraft": round(1e3 * gen.decode_s / max(1, len(gen.tokens) - 1), 1)}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvcraft model parity", description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="the model folder (default: as `kvcraft model fetch`; fetched if absent)")
    p.add_argument("--tokens", type=count(), default=1024)
    p.add_argument("--new", type=count(0), default=16, help="greedy tokens to compare")
    p.add_argument("--repeat", type=count(), default=3, help="prefill timings: best of this many")
    a = p.parse_args(argv)
    out = measure(fetch(a.dir).path, a.tokens, a.new, a.repeat)
    print(json.dumps(out, indent=2))
    return 0 if out["logits_rel_diff"] <= 1e-4 and out["greedy_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
