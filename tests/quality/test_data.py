"""The synthetic task: deterministic, in-vocabulary, and really cross-chunk."""

from __future__ import annotations

import random

import pytest

from kvbench.quality import data


def test_generator_is_deterministic_per_split_and_seed():
    assert data.examples("heldout", 20) == data.examples("heldout", 20)
    assert data.examples("train", 20, seed=3) == data.examples("train", 20, seed=3)
    assert data.examples("train", 20) != data.examples("heldout", 20)


def test_splits_are_disjoint():
    train = {e.prompt_text() for e in data.examples("train", 3000)}
    held = {e.prompt_text() for e in data.examples("heldout", 500)}
    assert not train & held


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError):
        data.examples("dev", 1)


def test_every_word_is_in_the_vocabulary():
    vocab = set(data.vocabulary())
    for e in data.examples("heldout", 300):
        assert set(e.prompt_text().split()) <= vocab
        assert e.answer in vocab


def test_prompts_have_four_to_six_chunks_of_fixed_length():
    for e in data.examples("heldout", 300):
        assert 4 <= len(e.chunks) <= 6
        assert all(14 <= len(c.split()) <= 15 for c in e.chunks)


def test_answer_is_unique_fact_of_the_target_chunk():
    for e in data.examples("heldout", 300):
        fact_chunk = e.chunks[e.needed_chunks[-1]]
        assert f" {e.answer} " in f" {fact_chunk} "


def test_cross_and_hop2_questions_need_two_or_more_chunks():
    for e in data.examples("heldout", 300):
        if e.kind == "local":
            assert len(e.needed_chunks) == 1
        else:
            assert len(e.needed_chunks) >= 2
            # The fact sits in a "they" chunk: its subject is named in the chunk before.
            assert e.chunks[e.needed_chunks[-1]].startswith("they ")


def test_they_refers_to_the_friend_named_in_the_previous_chunk():
    rng = random.Random(7)
    for _ in range(200):
        ctx = data.make_context(rng)
        for p in ctx.persons:
            if p.named_in != p.chunk:
                assert p.named_in == p.chunk - 1
                assert ctx.chunks[p.named_in].endswith(f"their friend is {p.name} .")
