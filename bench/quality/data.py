"""Synthetic multi-hop retrieval task where cross-chunk attention is required.

A prompt is a list of retrieved chunks followed by one question. Chunks are short
profiles that form *chains*, the way a document split by a chunker leaves
pronouns whose referent sits in the previous chunk:

    0: "meet alice . she lives in paris with bob ."
    1: "they live in rome with carol ."
    2: "the weather in lima was cold ."
    3: "meet dave . he lives in oslo with erin ."
    4: "they live in kyiv with frank ."
    5: "they live in cairo with grace ."
    question: "who lives in rome"   answer: "bob"

"they" in chunk 1 is bob, the companion named at the end of chunk 0 (the rule
of this task: "they" is always the person named last before it), so the answer needs two
chunks and a 2-hop chain (rome -> the "they" of chunk 1 -> the friend named at
the end of chunk 0 -> bob). Weather chunks are distractors that carry a city but
no person. With a causal model the only tokens that can bind "rome" to bob are
chunk 1's, attending back into chunk 0 (Cache-Craft §2.4, CacheBlend §3:
cross-chunk attention). A chunk KV computed alone cannot carry that binding;
that is what the naive-reuse check measures.

Six short chunks rather than a few long ones: a query that sees chunk caches
computed alone can still guess by elimination (not the friend named in the
city's own chunk, not a chain head, not the last friend), which picks the answer
out of 1-2 candidates with 3-4 chunks but out of about 4 with 6. Short chunks
(7-10 words) keep the whole prompt under 50 tokens, which the model's lookup
learns in minutes on a CPU.

Question kinds (``Example.kind``):
  ``local``  about a chain head (named in its own chunk): one chunk suffices.
  ``cross``  about a person introduced as a friend: needs the naming chunk and the
             "they" chunk after it.
Answers are one word (a name); the model must emit it then ``<eos>``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

NAMES = (
    "alice bob carol dave erin frank grace heidi ivan judy kevin laura mike nina "
    "oscar peggy quinn rita sam tina uma victor wendy xavier yara zach amir bella "
    "chen dora elias fiona gavin hana igor jonas kira leo maya nils olga pablo "
    "rosa sven tara ugo vera wade yuri zoe"
).split()
CITIES = (
    "paris rome oslo lima kyiv cairo delhi tokyo seoul dublin madrid lisbon vienna "
    "prague warsaw berlin munich zurich geneva milan naples athens sofia riga "
    "tallinn quito bogota havana denver boston austin dallas miami toronto perth"
).split()
# Every other word a prompt or question can hold.
TEMPLATE_WORDS = "meet . he she lives live in with they the weather was cold who".split()
FEMALE = frozenset(
    "alice carol erin grace heidi judy laura nina peggy rita tina uma wendy yara "
    "bella dora fiona hana kira maya olga rosa tara vera zoe".split()
)


def pronoun(name: str) -> str:
    return "she" if name in FEMALE else "he"


SPECIAL_TOKENS = ("<pad>", "<unk>", "<eos>")
PAD, UNK, EOS = SPECIAL_TOKENS


def vocabulary() -> list[str]:
    """Every word the task can produce, specials first; fixed order = fixed ids."""
    return [*SPECIAL_TOKENS, *NAMES, *CITIES, *TEMPLATE_WORDS]


@dataclass(frozen=True)
class Example:
    """One prompt: retrieved chunks (words), a question, and its one-word answer."""

    chunks: tuple[str, ...]
    question: str
    answer: str
    kind: str  # "local" | "cross"
    # Indices of the chunks whose content the answer depends on.
    needed_chunks: tuple[int, ...]

    def prompt_text(self) -> str:
        return " ".join(self.chunks) + " " + self.question


@dataclass(frozen=True)
class _Person:
    name: str
    city: str
    friend: str
    chunk: int  # the chunk holding this person's facts
    named_in: int  # the chunk that names them (== chunk for a chain head)


def _head_chunk(name: str, city: str, friend: str) -> str:
    # The name sits 5 words before the city, as the friend named at the end of the
    # previous chunk does for a "they" chunk: one binding rule serves both kinds,
    # and only for "they" chunks does it cross the chunk boundary.
    return f"meet {name} . {pronoun(name)} lives in {city} with {friend} ."


def _cont_chunk(city: str, friend: str) -> str:
    # Nothing in a "they" chunk says who "they" is, not even a gendered pronoun:
    # computed alone, its KV knows its city and friend but not its subject.
    return f"they live in {city} with {friend} ."


def _weather_chunk(city: str) -> str:
    return f"the weather in {city} was cold ."


def _chain_lengths(rng: random.Random, n_person_chunks: int) -> list[int]:
    """Split the person chunks into chains of length >= 2 (one chain allowed)."""
    if n_person_chunks < 4 or rng.random() < 0.4:
        return [n_person_chunks]
    first = rng.randint(2, n_person_chunks - 2)
    return [first, n_person_chunks - first]


@dataclass(frozen=True)
class Context:
    """The retrieved chunks of one prompt and the people they describe."""

    chunks: tuple[str, ...]
    persons: tuple[_Person, ...]


# Retrieved chunks per prompt.
CHUNK_COUNTS = (6,)
# Chance that one of them is a distractor (from 3 chunks up).
WEATHER_SHARE = 0.5


def make_context(rng: random.Random, n_chunks: int | None = None) -> Context:
    """Draw 6 chunks (CHUNK_COUNTS): one or two chains of profiles, at most one distractor."""
    n = n_chunks if n_chunks is not None else rng.choice(CHUNK_COUNTS)
    n_weather = 1 if (n >= 3 and rng.random() < WEATHER_SHARE) else 0
    n_person = n - n_weather
    chains = _chain_lengths(rng, n_person)
    names = rng.sample(NAMES, n_person + len(chains))
    cities = rng.sample(CITIES, n)

    # (subject, city, friend) per person chunk, grouped by chain.
    chain_facts: list[list[tuple[str, str, str]]] = []
    name_i = fact_i = 0
    for length in chains:
        chain = []
        subject = names[name_i]
        name_i += 1
        for _ in range(length):
            friend = names[name_i]
            name_i += 1
            chain.append((subject, cities[fact_i], friend))
            fact_i += 1
            subject = friend
        chain_facts.append(chain)

    # A distractor goes at a chain boundary, so "they" always refers to the
    # friend named at the end of the chunk right before it.
    weather_at = rng.randint(0, len(chain_facts)) if n_weather else -1
    chunks: list[str] = []
    persons: list[_Person] = []
    for b, chain in enumerate(chain_facts + [[]]):
        if b == weather_at:
            chunks.append(_weather_chunk(cities[fact_i]))
        for k, (subject, city, friend) in enumerate(chain):
            here = len(chunks)
            if k == 0:
                chunks.append(_head_chunk(subject, city, friend))
                named_in = here
            else:
                chunks.append(_cont_chunk(city, friend))
                named_in = here - 1
            persons.append(_Person(subject, city, friend, here, named_in))
    assert len(chunks) == n
    return Context(tuple(chunks), tuple(persons))


# Share of questions about a person named in an earlier chunk; the rest are local.
CROSS_SHARE = 0.7


def make_question(rng: random.Random, ctx: Context, kind: str | None = None) -> tuple[str, str, str, tuple[int, ...]]:
    """(question, answer, kind, needed chunk indices) about one person of ``ctx``.

    The question names a city and ends with it, "who lives in rome"; the answer is
    the person. Cities are unique within a context, so the answer is unique.
    """
    if kind is None:
        kind = "cross" if rng.random() < CROSS_SHARE else "local"
    if kind == "local":
        target = rng.choice([p for p in ctx.persons if p.named_in == p.chunk])
    elif kind == "cross":
        # Only "they" chunks followed by another chunk: with the city in the last
        # chunk, recency alone points at the friend named just before it.
        cross = [p for p in ctx.persons if p.named_in != p.chunk]
        target = rng.choice([p for p in cross if p.chunk < len(ctx.chunks) - 1] or cross)
    else:
        raise ValueError(f"unknown question kind {kind!r}")
    needed = tuple(sorted({target.named_in, target.chunk}))
    return question_about(target.city), target.name, kind, needed


def question_about(city: str) -> str:
    return f"who lives in {city}"


def city_of(chunk: str) -> str:
    """The city a chunk names (every chunk names exactly one)."""
    found = [w for w in chunk.split() if w in _CITY_SET]
    if len(found) != 1:
        raise ValueError(f"chunk {chunk!r} names {len(found)} cities, expected 1")
    return found[0]


_CITY_SET = frozenset(CITIES)


def make_example(rng: random.Random, n_chunks: int | None = None) -> Example:
    """One prompt: 6 chunks and one question about them."""
    ctx = make_context(rng, n_chunks)
    question, answer, kind, needed = make_question(rng, ctx)
    return Example(ctx.chunks, question, answer, kind, needed)


# Seeds of the two splits are far apart; held-out examples are also filtered
# against nothing else: with ~10^20 distinct prompts a collision is negligible,
# and `test_splits_are_disjoint` checks a sample.
TRAIN_SEED = 1_000
HELDOUT_SEED = 9_000_001


def examples(split: str, count: int, seed: int | None = None) -> list[Example]:
    """Deterministic list of examples for ``split`` in {"train", "heldout"}."""
    return list(iter_examples(split, count, seed))


def iter_examples(split: str, count: int | None = None, seed: int | None = None) -> Iterator[Example]:
    return draws(make_example, (TRAIN_SEED, HELDOUT_SEED), split, count, seed)


def draws(make: Callable[[random.Random], Example], seeds: tuple[int, int], split: str, count: int | None,
          seed: int | None) -> Iterator[Example]:
    """A task's examples of ``split`` (`make` draws one; `seeds`: its train and held-out bases)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    base = seeds[0] if split == "train" else seeds[1]
    rng = random.Random(base if seed is None else base + seed)
    i = 0
    while count is None or i < count:
        yield make(rng)
        i += 1
