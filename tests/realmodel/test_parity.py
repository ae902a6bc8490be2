"""The reference engine against transformers on the real model (SmolLM2-135M-Instruct, fp32).

Issue 36's parity bar: logits max |diff| / max |logit| <= 1e-4 on a ~1k-token prompt, and
greedy generations identical. The prompt is a chat over real text: the model's own
Apache-2.0 license, which the fetch keeps in the folder.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engine_adapter.generate import greedy, stop_tokens
from engine_adapter.llama import LlamaEngine
from kvcli.parity import license_prompt
from kvbench.common.realmodel import chat

PROMPT_TOKENS = 1024
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def both(fetched):
    hf = LlamaForCausalLM.from_pretrained(fetched.path, dtype=torch.float32).eval()
    return LlamaEngine.from_pretrained(fetched.path), hf, AutoTokenizer.from_pretrained(fetched.path)


@pytest.fixture(scope="module")
def long_prompt(fetched, both) -> list[int]:
    ids = license_prompt(fetched.path, both[2], PROMPT_TOKENS)
    assert PROMPT_TOKENS - 8 <= len(ids) <= PROMPT_TOKENS
    return ids


def test_logits_match_transformers_on_a_1k_token_prompt(both, long_prompt):
    engine, hf, _ = both
    ids = torch.tensor([long_prompt])
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [T, V]
    got, kv = engine.prefill(ids[0])
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel <= 1e-4, rel
    assert kv[0][0].shape == (3, len(long_prompt), 64)


@pytest.mark.parametrize("question", ["long", "short"])
def test_greedy_generation_is_identical_to_transformers(fetched, both, long_prompt, question):
    engine, hf, tok = both
    prompt = long_prompt if question == "long" else chat(
        tok, "The Eiffel Tower is in Paris. It was completed in 1889.", "When was the Eiffel Tower completed?")
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
    logits, kv = engine.prefill(ids[0], all_logits=False)
    got = greedy(engine, logits, kv, NEW_TOKENS, stop_tokens(fetched.path))
    assert list(got.tokens) == ref, (tok.decode(got.tokens), tok.decode(ref))
