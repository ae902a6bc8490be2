"""MuSiQue as RAG prompts for the real model, and the answer metrics the benchmarks report.

Data: records of CacheBlend's MuSiQue subset (`musique_s.json`: `ctxs` of `{"title", "text"}`,
`question`, `answers`); `bench/data/musique_dev.json` holds 30 of them (the development
split, bench/data/README.md). `load(path, passages=k)` keeps each record's first k passages.

Prompt layout (CacheBlend's, `YaoJiayi/CacheBlend` example for MuSiQue), inside the model's
chat template: one instruction segment (the template's system and user headers and the
instruction: the same for every prompt), one segment per passage, and the question segment
(question, then the template's assistant header). Each segment is tokenized on its own, so a
passage's tokens are the same in every prompt and context: its chunk key and stored KV recur.

Metrics:
- `f1`, `exact_match`: SQuAD's answer normalization (lower case, no punctuation, no articles
  a/an/the, single spaces), token F1 and exact match, best over the gold answers.
- `rouge_l`: ROUGE-L F1 (longest common subsequence of the normalized words) of a generated
  answer against another (Cache-Craft's fidelity measure: a policy's answer against full
  prefill's); 1.0 when both are empty.
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "musique_dev.json"

INSTRUCTION = ("You will be asked a question after reading several passages. Please directly answer the "
               "question based on the given passages. Do NOT repeat the question. The answer should be "
               "within 5 words.\nPassages:\n")
QUERY = ("\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
         "The answer should be within 5 words.\nQuestion: {question}")
_MARK = "\x00KVCRAFT\x00"


@dataclass(frozen=True)
class Record:
    id: int  # index in musique_s.json
    question: str
    answers: tuple[str, ...]
    passages: tuple[str, ...]  # "title\ntext" (text alone where the title is empty)


@dataclass(frozen=True)
class Prompt:
    instruction: tuple[int, ...]
    passages: tuple[tuple[int, ...], ...]
    question: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.instruction + sum(self.passages, ()) + self.question

    def chunks(self) -> list[tuple[int, ...]]:
        """Every segment before the question: the instruction, then the passages."""
        return [self.instruction, *self.passages]


def load(path: str | Path = SAMPLE, passages: int = 3, limit: int | None = None) -> list[Record]:
    """Records of a MuSiQue file, each cut to its first `passages` passages."""
    if passages < 1:
        raise ValueError(f"passages must be >= 1, got {passages}")
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"no MuSiQue file at {path}: get musique_s.json from the public repository "
                         "YaoJiayi/CacheBlend (inputs/musique_s.json), docs/quality.md") from None
    out = []
    for i, r in enumerate(raw[:limit]):
        try:
            ctxs = r["ctxs"][:passages]
            texts = tuple(f"{c['title']}\n{c['text']}" if c.get("title") else c["text"] for c in ctxs)
            out.append(Record(int(r.get("id", i)), r["question"], tuple(r["answers"]), texts))
        except (KeyError, TypeError) as e:
            raise SystemExit(f"{path}: record {i} is not a MuSiQue record (ctxs, question, answers): {e}") from None
    return out


def prompt(tokenizer, record: Record) -> Prompt:  # noqa: ANN001 - a transformers tokenizer
    """The record as token segments in the chat template (see the module docstring)."""
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                             add_generation_prompt=True)
    head, tail = rendered.split(_MARK)

    def enc(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    return Prompt(enc(head + INSTRUCTION), tuple(enc(p + "\n\n") for p in record.passages),
                  enc(QUERY.format(question=record.question) + tail))


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    return float(any(normalize(prediction) == normalize(a) for a in answers))


def _f1(pred: list[str], gold: list[str]) -> float:
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold:
        return float(pred == gold)
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


def f1(prediction: str, answers: Sequence[str]) -> float:
    pred = normalize(prediction).split()
    return max(_f1(pred, normalize(a).split()) for a in answers)


def rouge_l(candidate: str, reference: str) -> float:
    c, r = normalize(candidate).split(), normalize(reference).split()
    if not c or not r:
        return float(c == r)
    prev = [0] * (len(r) + 1)
    for x in c:  # LCS, one row at a time
        cur = [0]
        for j, y in enumerate(r):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, rec = lcs / len(c), lcs / len(r)
    return 2 * p * rec / (p + rec)
