"""The second quality task: the first task's chains at realistic proportions.

Real RAG chunks are hundreds of tokens, and the tokens whose KV depends on earlier
chunks are a few percent of them. Here a prompt is 5-8 chunks of 32-52 words; each
chunk is the first task's profile sentence (`data`: "meet X . she lives in C with Y ."
or "they live in C with Y .", or a weather distractor) placed among filler sentences
that name no person and no city:

    the market opens early on most days . the old bridge is closed for repairs .
    they live in rome with carol . the bakery sells bread and cakes . ...

The rule is the first task's: "they" is the person named last before it, which is the
companion at the end of the previous chunk's profile, because filler never names a
person. A cross question ("who lives in rome") needs the "they" chunk's binding to the
previous chunk; in a "they" chunk that binding is carried by one or two of its 32-52
tokens, 2-6%. Splits, seeds and question kinds as in `data` (its `Example`).

Filler is drawn from FILLER per chunk, without repetition inside a chunk; the profile
sentence goes at a random sentence boundary, so the binding token sits anywhere.
"""

from __future__ import annotations

import random
from typing import Iterator

from . import data
from .data import Example

FILLER = (
    "the market opens early on most days .",
    "the old bridge is closed for repairs .",
    "the bakery sells bread and cakes .",
    "a new school was built near the park .",
    "the museum is free on the first sunday .",
    "trains run every hour to the coast .",
    "the river freezes in a hard winter .",
    "many people walk to work in summer .",
    "the library keeps long opening hours .",
    "a small band plays at the square .",
    "the hills are green after the rain .",
    "the harbour is busy in the morning .",
    "the streets are quiet late at night .",
    "an old clock stands above the hall .",
    "the garden has roses and tall trees .",
    "a festival fills the town each spring .",
)
WORDS_PER_CHUNK = (32, 44)  # a chunk fills up to a target in this range; one sentence may overshoot
CHUNK_COUNTS = (5, 6, 7, 8)


def vocabulary() -> list[str]:
    """The first task's words, then the filler's, in a fixed order (fixed ids)."""
    base = data.vocabulary()
    seen = set(base)
    extra = []
    for s in FILLER:
        for w in s.split():
            if w not in seen:
                seen.add(w)
                extra.append(w)
    return base + extra


def _pad(rng: random.Random, core: str) -> str:
    """`core` among filler sentences until the chunk reaches a target length (32-52 words)."""
    target = rng.randint(*WORDS_PER_CHUNK)
    sentences = [core]
    pool = list(FILLER)
    rng.shuffle(pool)
    words = len(core.split())
    for s in pool:
        if words >= target:
            break
        sentences.insert(rng.randint(0, len(sentences)), s)
        words += len(s.split())
    return " ".join(sentences)


def make_context(rng: random.Random, n_chunks: int | None = None) -> data.Context:
    """5-8 long chunks: the first task's chains (same people, same rule) among filler."""
    n = n_chunks if n_chunks is not None else rng.choice(CHUNK_COUNTS)
    ctx = data.make_context(rng, n)
    return data.Context(tuple(_pad(rng, c) for c in ctx.chunks), ctx.persons)


def make_example(rng: random.Random, n_chunks: int | None = None) -> Example:
    """One prompt: 5-8 long chunks and one question about them."""
    ctx = make_context(rng, n_chunks)
    question, answer, kind, needed = data.make_question(rng, ctx)
    return Example(ctx.chunks, question, answer, kind, needed)


# Seeds far from the first task's, so the two tasks never share a draw.
TRAIN_SEED = 2_000
HELDOUT_SEED = 19_000_001


def examples(split: str, count: int, seed: int | None = None) -> list[Example]:
    """Deterministic list of examples for ``split`` in {"train", "heldout"}."""
    return list(iter_examples(split, count, seed))


def iter_examples(split: str, count: int | None = None, seed: int | None = None) -> Iterator[Example]:
    return data.draws(make_example, (TRAIN_SEED, HELDOUT_SEED), split, count, seed)
