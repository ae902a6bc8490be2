"""The long task (`kvbench.quality.longdata`): realistic proportions, same rule."""

from __future__ import annotations

import random

from kvbench.quality import data, longdata, modeling, train


def test_generator_is_deterministic_and_splits_are_disjoint():
    assert longdata.examples("heldout", 20) == longdata.examples("heldout", 20)
    train_set = {e.prompt_text() for e in longdata.examples("train", 1000)}
    held = {e.prompt_text() for e in longdata.examples("heldout", 300)}
    assert not train_set & held


def test_prompts_have_five_to_eight_long_chunks_in_vocabulary():
    vocab = set(longdata.vocabulary())
    counts = set()
    for e in longdata.examples("heldout", 300):
        counts.add(len(e.chunks))
        assert all(32 <= len(c.split()) <= 52 for c in e.chunks)
        assert set(e.prompt_text().split()) <= vocab and e.answer in vocab
    assert counts == {5, 6, 7, 8}


def test_filler_names_no_person_and_no_city_so_they_still_means_the_last_name():
    words = {w for s in longdata.FILLER for w in s.split()}
    assert not words & set(data.NAMES) and not words & set(data.CITIES)
    for e in longdata.examples("heldout", 300):
        names = [[w for w in c.split() if w in data.NAMES] for c in e.chunks]
        for i, c in enumerate(e.chunks):
            if " they live in " in f" {c} ":
                # the previous chunk ends its people with the companion "they" refers to
                assert names[i - 1], e
        city = e.question.split()[-1]
        (home,) = [i for i, c in enumerate(e.chunks) if city in c.split()]
        assert home in e.needed_chunks


def test_cross_binding_tokens_are_a_few_percent_of_a_chunk():
    # One binding per "they" chunk, and the chunk is 32-52 tokens: <= ~5% each on average.
    shares = [1 / len(c.split()) for e in longdata.examples("heldout", 300) for c in e.chunks
              if c.split().count("they")]
    assert shares and sum(shares) / len(shares) <= 0.035


def test_the_trainer_builds_batches_of_the_long_task():
    tok = modeling.build_tokenizer(longdata.vocabulary())
    cur = train.Curriculum(8, start=3, task=longdata)
    b = train.make_batch(random.Random(0), tok, 4, cur)
    assert b.context.shape[0] == 4 and b.context.shape[1] >= 2 * 32
    assert int((b.context == tok.unk_token_id).sum()) == 0 and int((b.qa == tok.unk_token_id).sum()) == 0
