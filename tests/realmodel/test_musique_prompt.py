"""kvbench.common.musique's prompts with the real model's tokenizer: segments that recur."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from kvbench.common import musique


@pytest.fixture(scope="module")
def tok(fetched):
    return AutoTokenizer.from_pretrained(fetched.path)


def test_segments_are_the_tokenized_pieces_and_decode_to_the_chat(tok):
    record = musique.load(limit=1)[0]
    p = musique.prompt(tok, record)
    enc = lambda text: tuple(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert p.passages == tuple(enc(x + "\n\n") for x in record.passages)
    assert p.tokens == p.instruction + sum(p.passages, ()) + p.question
    assert p.chunks() == [p.instruction, *p.passages]
    user = musique.INSTRUCTION + "".join(x + "\n\n" for x in record.passages) + \
        musique.QUERY.format(question=record.question)
    chat = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(list(p.tokens)) == chat
    assert tok.decode(list(p.instruction)).endswith(musique.INSTRUCTION)
    assert tok.decode(list(p.question)).startswith(musique.QUERY.format(question=record.question))


def test_the_instruction_is_the_same_segment_in_every_prompt(tok):
    records = musique.load(limit=5)
    prompts = [musique.prompt(tok, r) for r in records]
    assert len({p.instruction for p in prompts}) == 1
    assert len({p.question for p in prompts}) == len(records)


def test_a_passage_tokenizes_the_same_in_any_prompt(tok):
    record = musique.load(limit=1)[0]
    other = musique.Record(record.id, "Which passage comes first?", ("none",), tuple(reversed(record.passages)))
    assert musique.prompt(tok, other).passages == tuple(reversed(musique.prompt(tok, record).passages))
