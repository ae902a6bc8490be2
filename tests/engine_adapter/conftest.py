"""Shared fixture: a random-weight tiny Llama (fp32)."""

import pytest

from engine_adapter.llama import LlamaEngine


@pytest.fixture(scope="session")
def engine() -> LlamaEngine:
    # std 0.1 (not HF's 0.02) so attention is peaked enough for context to matter.
    return LlamaEngine.random("tiny", seed=0, std=0.1)
