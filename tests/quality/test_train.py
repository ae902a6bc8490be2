"""The trainer's batched loss is the loss of each question asked alone after its context."""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from kvbench.quality import modeling, train


def _tiny_model(tok):
    torch.manual_seed(0)
    return modeling.LlamaForCausalLM(modeling.build_config(len(tok), hidden_size=32, intermediate_size=64,
                                                           num_hidden_layers=2, num_attention_heads=2,
                                                           num_key_value_heads=1))


def _one_at_a_time(model, b: train.Batch) -> torch.Tensor:
    """Reference: every (context + one question) as its own unpadded sequence."""
    num = den = 0.0
    for i in range(len(b.lengths)):
        n = int(b.lengths[i])
        ctx = b.context[i, :n]
        seqs = [(ctx, b.context_w[i, :n])]
        for q in (b.of == i).nonzero().flatten().tolist():
            # Context tokens were already counted once, in the context's own sequence.
            seqs.append((torch.cat([ctx, b.qa[q]]), torch.cat([torch.zeros(n), b.qa_w[q]])))
        for ids, w in seqs:
            logits = model(input_ids=ids[None]).logits[0]
            ce = F.cross_entropy(logits[:-1], ids[1:], reduction="none")
            num = num + (ce * w[1:]).sum()
            den = den + w[1:].sum()
    return num / den


def test_batched_questions_see_only_their_own_context():
    tok = modeling.build_tokenizer()
    model = _tiny_model(tok)
    # Contexts of different lengths, so padding and per-row positions matter.
    b = train.make_batch(random.Random(3), tok, 5, train.Curriculum(6, start=6))
    assert len(set(b.lengths.tolist())) > 1 and len(b.of) > len(b.lengths)

    got = train.batch_loss(model, b)
    got.backward()
    got_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want = _one_at_a_time(model, b)
    want.backward()

    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Gradients reach the context through the copied KV, as in the reference.
    for g, p in zip(got_grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_every_person_is_asked_about_once():
    tok = modeling.build_tokenizer()
    rng = random.Random(5)
    b = train.make_batch(rng, tok, 8, train.Curriculum(6, start=6))
    vocab = tok.convert_ids_to_tokens
    for i in range(8):
        words = vocab(b.context[i, : int(b.lengths[i])].tolist())
        asked = [vocab(b.qa[q].tolist()) for q in (b.of == i).nonzero().flatten().tolist()]
        cities = [q[3] for q in asked]
        people = [q[4] for q in asked]
        assert len(set(cities)) == len(cities) and all(q[-1] == tok.eos_token for q in asked)
        # Everyone who lives somewhere: the chain heads and every named companion but
        # the last of each chain, who has no chunk of their own.
        assert len(people) == words.count("lives") + words.count("live")
