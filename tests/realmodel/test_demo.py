"""`kvcraft demo` part 0 on the real model: the answers it prints are the model's.

The full-prefill answer printed must equal the test's own `LlamaEngine.prefill` + greedy
decode of the same MuSiQue prompt; the reuse line must show stored KV serving every chunk
at a small share of row-layers computed, with an answer of its own."""

from __future__ import annotations

import re

import torch

from engine_adapter import LlamaEngine, greedy, stop_tokens
from kvcli import demo
from kvbench.common import musique


def test_demo_prints_the_real_models_answers(fetched, capsys, tmp_path):
    from transformers import AutoTokenizer

    code = demo.run_demo(str(tmp_path / "data"), model_dir=str(fetched.path), synthetic=False)
    out = capsys.readouterr().out

    tok = AutoTokenizer.from_pretrained(fetched.path)
    rec = musique.load()[demo.REAL_RECORD]
    p = musique.prompt(tok, rec)
    engine = LlamaEngine.from_pretrained(fetched.path)
    stop = stop_tokens(fetched.path)
    with torch.no_grad():
        logits, kv = engine.prefill(torch.tensor(p.tokens), all_logits=False)
    gen = greedy(engine, logits, kv, demo.REAL_ANSWER_TOKENS, stop)
    expected = tok.decode([t for t in gen.tokens if t not in stop]).strip()

    assert f"question: {rec.question}" in out
    assert f"gold answer: {' / '.join(rec.answers)}" in out
    full = re.search(r"^full prefill: TTFT (\d+) ms, row-layers computed 100%, answer: (.*)$", out, re.M)
    assert full, out
    assert full.group(2) == repr(expected)
    label = re.escape(demo.REAL_POLICY.label())
    reuse = re.search(rf"^{label}: TTFT (\d+) ms \(.*\), (\d+)/(\d+) chunks reused, row-layers computed "
                      r"([\d.]+)%, answer: (.*)$", out, re.M)
    assert reuse, out
    assert reuse.group(2) == reuse.group(3) == str(len(p.chunks()))  # every chunk served from the service
    assert float(reuse.group(4)) < 25.0
    assert reuse.group(5).startswith(("'", '"'))
    assert "service stopped cleanly (exit 0)" in out
    assert code in (0, 1)  # 1 only if reuse lost on speed on this shared machine
