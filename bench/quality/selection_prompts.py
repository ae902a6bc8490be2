"""The prompts `kvbench.quality.selection` scores: held-out examples whose chunks' stored
variants were computed behind a chunk of ANOTHER prompt (as an earlier request would have
left them), with what later requests that computed a chunk in full observed (the learned
lists' inputs), and the default learned lists saved for a test fixture and loaded back."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from rich.progress import track
from torch import Tensor

from engine_adapter import LlamaEngine, Policy
from engine_adapter.blend import FreshChunk, blend_prefill
from engine_adapter.learned import DEFAULT_ROUNDS, fresh_gain, gain_case, path_scores, recompute_gain
from engine_adapter.observe import Observation, Request, observe_many
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from kvbench.quality import data, longdata
from kvbench.quality.modeling import build_tokenizer, encode
from kvcraft.keys import chunk_key
from kvcraft.records import VariantStats


@dataclass(frozen=True)
class Prompt:
    chunks: list[list[int]]
    question: list[int]
    answer: int  # first answer token (answers are one word)
    kind: str
    stored: dict[int, FreshChunk]  # chunk index -> its variant, computed behind a stranger
    # chunk index -> the same chunk computed in full in a second request, behind a second
    # stranger, with a question about the chunk's city after it (what a later request
    # that computed the chunk instead of reusing it saw): its KV and what its question read.
    observed: dict[int, Observation] = field(default_factory=dict)
    # chunk index -> the stored variant's learned list by fresh gain (`learned.fresh_gain`),
    # merged (max) over the `observe` requests that computed the chunk in full
    gains: dict[int, Tensor] = field(default_factory=dict)
    # the greedy paths of `recompute_gain` (chosen tokens, KLs), one per observing request
    paths: dict[int, list[tuple[list[int], list[float]]]] = field(default_factory=dict)
    # chunk index -> the stored variant's default learned list (`learned.learn`: the greedy
    # recompute gain at DEFAULT_ROUNDS), merged (max) over the observing requests
    lists: dict[int, Tensor] = field(default_factory=dict)


def _variant(engine: LlamaEngine, behind: list[int], chunk: list[int]) -> FreshChunk:
    """The chunk's variant computed behind `behind` through the adapter, with Cache-Craft
    statistics (eq. 14 reads them)."""
    r = blend_prefill(engine, [Segment(behind), Segment(chunk)], Policy("full"), InMemoryLayerSource({}),
                      gate=TRUSTED)
    return r.fresh[1]


def _question(tok, text: str) -> list[int]:
    """"who lives in <the chunk's city>": what a request that retrieved this chunk asked."""
    return tok.encode(data.question_about(data.city_of(text)), add_special_tokens=False)


TASKS = {"short": data, "long": longdata}  # task name -> example module


def prompts(engine: LlamaEngine, n: int, seed: int = 1, progress: bool = False,
            observe: int = 0, stats: bool = True, task: str = "short") -> list[Prompt]:
    """`n` held-out prompts (draw `seed`) of `task` with their chunks' variants computed
    behind another prompt's chunk; with `observe` = k >= 1, each chunk also computed in k
    later requests, each behind a chunk of yet another prompt (learned lists: `observed`
    is the first, `gains` and `lists` merge all k). `stats=False` skips
    the stored variants' attention statistics (eq. 14 needs them; nothing else here does)
    and computes every variant in batches (`observe.observe_many`, seconds for hundreds
    of prompts)."""
    mod = TASKS[task]
    tok = build_tokenizer(mod.vocabulary())
    exs = mod.examples("heldout", n + 1 + max(1, int(observe)), seed=seed)
    enc = [encode(tok, e) for e in exs]
    chunks = [[list(c) for c in e.chunk_ids] for e in enc]
    # the chunk before position j, of another prompt (j = 0: that prompt's last chunk)
    behind = [[chunks[i + 1][(j - 1) % len(chunks[i + 1])] for j in range(len(chunks[i]))] for i in range(n)]
    # the k-th later request's chunk before position j: prompt i + 1 + k's
    others = [[[chunks[i + 1 + k][(j - 1) % len(chunks[i + 1 + k])] for j in range(len(chunks[i]))]
               for k in range(1, int(observe) + 1)] for i in range(n)]
    todo: list[tuple[str, int, int, Request]] = []  # (what, prompt, chunk, request)
    for i in range(n):
        for j, c in enumerate(chunks[i]):
            b = behind[i][j]
            if not stats:
                todo.append(("stored", i, j, (b + c, (len(b), len(b) + len(c)), (0, 0))))
            for k, other in enumerate(others[i]):
                o, q = other[j], _question(tok, exs[i].chunks[j])
                m = len(o) + len(c)
                todo.append((f"observed{k}", i, j, (o + c + q, (len(o), m), (m, m + len(q)))))
    got = observe_many(engine, [r for *_, r in todo], context=bool(observe))
    found: dict[tuple[str, int, int], Observation] = {(w, i, j): ob for (w, i, j, _), ob in zip(todo, got)}
    fp = engine.model_spec().fingerprint()
    out = []
    for i in (track(range(n), description="variants") if progress else range(n)):
        stored, observed = {}, {}
        for j, c in enumerate(chunks[i]):
            prefix = (chunk_key(fp, behind[i][j]),)
            stored[j] = (_variant(engine, behind[i][j], c) if stats
                         else FreshChunk(prefix, found["stored", i, j].kv, VariantStats))
            if observe:
                observed[j] = found["observed0", i, j]
        out.append(Prompt(chunks[i], list(enc[i].question_ids), enc[i].answer_ids[0], exs[i].kind, stored,
                          observed))
    if observe:
        # every later request's fresh gains against the stored variant, merged per chunk
        cases = [(i, j, gain_case(found[f"observed{k}", i, j], p.stored[j].kv))
                 for i, p in enumerate(out) for j in p.stored for k in range(int(observe))]
        case_gains = fresh_gain(engine, [c for *_, c in cases])
        for (i, j, _), gain in zip(cases, case_gains):
            old = out[i].gains.get(j)
            out[i].gains[j] = gain if old is None else torch.maximum(old, gain)
        # the greedy recompute paths (the default list is their first DEFAULT_ROUNDS)
        first = [int(g.argmax()) if float(g.max()) > 0 else None for g in case_gains]
        got: list = []
        recompute_gain(engine, [c for *_, c in cases], DEFAULT_ROUNDS, first, paths=got)
        for (i, j, _), path in zip(cases, got):
            out[i].paths.setdefault(j, []).append(path)
        for p in out:
            for j, ps_ in p.paths.items():
                p.lists[j] = torch.stack([path_scores(c, k, len(p.chunks[j]), DEFAULT_ROUNDS)
                                          for c, k in ps_]).amax(0)
        for p in out:  # the contexts were needed for the gains only
            for j, ob in p.observed.items():
                p.observed[j] = Observation(ob.kv, ob.received, ob.received_per_layer)
    return out


def save_lists(ps: Sequence[Prompt], path: Path) -> None:
    """The prompts' default learned lists (`Prompt.lists`), for a test fixture: the chunks'
    lengths per prompt and the nonzero scores (flat index into all chunks back to back, value)."""
    lengths = [[len(p.lists[j]) for j in sorted(p.lists)] for p in ps]
    flat = torch.cat([p.lists[j].to(torch.float32) for p in ps for j in sorted(p.lists)])
    at = flat.nonzero().flatten()
    torch.save({"lengths": lengths, "index": at.to(torch.int32), "scores": flat[at]}, path)


def load_lists(ps: Sequence[Prompt], path: Path) -> None:
    """Attach the lists saved by `save_lists` for the same prompts (same draw and task, the
    same count or fewer), checking every chunk's length."""
    saved = torch.load(path)
    lengths = saved["lengths"]
    if len(lengths) < len(ps):
        raise ValueError(f"{path} holds {len(lengths)} prompts, {len(ps)} asked")
    flat = torch.zeros(sum(map(sum, lengths)))
    flat[saved["index"].long()] = saved["scores"]
    at = 0
    for p, lens in zip(ps, lengths):
        if lens != [len(c) for c in p.chunks]:
            raise ValueError(f"{path}: chunk lengths differ from the prompts' (another draw or task?)")
        for j, n in enumerate(lens):
            p.lists[j] = flat[at:at + n]
            at += n
