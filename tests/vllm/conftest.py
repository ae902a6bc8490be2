"""Fixtures of the vLLM tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """The tiny random-weight Llama (`kvbench.vllm.rag.build_tiny_llama`) that the vLLM tests
    serve, built once per worker; a test that rewrites weights builds its own."""
    from kvbench.vllm.rag import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model"))
