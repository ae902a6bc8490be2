"""The quality model: a small Llama (HF format) and its word-level tokenizer.

The committed directory ``bench/quality/model/`` holds config.json,
model.safetensors and tokenizer files; ``load()`` reads it with transformers only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .data import EOS, PAD, UNK, Example, vocabulary

MODEL_DIR = Path(__file__).resolve().parent / "model"
LONG_MODEL_DIR = Path(__file__).resolve().parent / "model-long"  # the long task's (`longdata`)


def build_tokenizer(words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over a task's fixed vocabulary (default: the first task's);
    adds no BOS/EOS."""
    vocab = {w: i for i, w in enumerate(words or vocabulary())}
    core = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token=UNK, pad_token=PAD, eos_token=EOS
    )


def build_config(vocab_size: int, **overrides) -> LlamaConfig:
    """Llama shape used for the committed model: 4 layers, 4 heads, 2 KV heads (GQA)."""
    tok_ids = {w: i for i, w in enumerate(vocabulary())}
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=tok_ids[PAD],
        eos_token_id=tok_ids[EOS],
        bos_token_id=None,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def load(model_dir: str | Path = MODEL_DIR) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The trained model (fp32, eval mode, CPU) and its tokenizer."""
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return model, tok


@dataclass(frozen=True)
class EncodedExample:
    """Token ids of one example: per chunk, the question, the answer (+ EOS)."""

    chunk_ids: tuple[tuple[int, ...], ...]
    question_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]  # answer words then EOS

    @property
    def prompt_ids(self) -> list[int]:
        return [t for c in self.chunk_ids for t in c] + list(self.question_ids)


def encode(tok: PreTrainedTokenizerFast, ex: Example) -> EncodedExample:
    def ids(text: str) -> tuple[int, ...]:
        out = tok.encode(text, add_special_tokens=False)
        if tok.unk_token_id in out:
            raise ValueError(f"out-of-vocabulary word in {text!r}")
        return tuple(out)

    return EncodedExample(
        chunk_ids=tuple(ids(c) for c in ex.chunks),
        question_ids=ids(ex.question),
        answer_ids=ids(ex.answer) + (tok.eos_token_id,),
    )
