"""`ape`: APE's query attention over chunks encoded apart (Yang, Chen and Chen, "APE: Faster and
Longer Context-Augmented Generation via Adaptive Parallel Encoding", ICLR 2025), training-free.

Chunks encoded apart and read side by side are not one context; APE brings them closer in two
ways, recomputing nothing:
  - each chunk's KV is computed behind a shared prefix (the prefix takes the attention sink
    every sequence grows, so the chunks' own first tokens do not); here, the
    chunk at the prompt's start is that prefix (the instruction, exact from position 0), and
    the variants the service keeps were computed behind it and whatever preceded them;
  - the query reads many chunks whose keys were never normalised against each other: within
    the chunks' keys its logits are divided by a temperature T < 1 (sharper), and the
    weight of all the chunks' keys together is rescaled by S, combined with the rest's
    (the prefix, the query) by their log-sum-exps (`selection.Rescale`,
    `attention.rescaled_attention`).
So: naive reuse (every cached chunk served as stored, the fresh chunks and the question
computed), the question's rows reading every reused chunk but the prompt's first as APE
does. Through kvcraft's own decode (`generate.greedy` with `rescale`), the answer's tokens
read that way too; inside vLLM only the prefill's rows do (its decode is vLLM's own).
T and S depend on the model and the data. The defaults are the mildest of the grid tried on
MuSiQue with SmolLM2-135M, where no setting kept more of full prefill's answers than naive
reuse on held-out records (docs/quality.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine_adapter.policies.base import Passes, Prompt, ReusePolicy
from engine_adapter.prompt import Layout
from engine_adapter.selection import Pass, Rescale


@dataclass(frozen=True)
class Ape(ReusePolicy):
    temperature: float = 0.9  # T: the query's logits over the chunks' keys divided by it
    scale: float = 1.0  # S: the chunks' keys' total weight multiplied by it (before normalising)

    name = "ape"

    def __post_init__(self) -> None:
        super().__post_init__()
        Rescale(self.temperature, self.scale, torch.zeros(0, dtype=torch.bool))  # refuses T, S out of range

    def rescale(self, layout: Layout, reused: "tuple[int, ...] | None" = None) -> Rescale:
        """The question's rows' attention over the reused chunks but the prompt's first
        (`reused`: the segments served from stored KV; None: every cached one) as APE reads;
        `rows` None: what a decode step after the prefill reads with."""
        apart = {s for s in (self.reused(layout) if reused is None else reused) if layout.edges[s] > 0}
        keys = [s in apart for s, seg in enumerate(layout.segments) for _ in seg.tokens]
        return Rescale(self.temperature, self.scale, torch.tensor(keys, dtype=torch.bool))

    def passes(self, prompt: Prompt) -> Passes:
        lay = prompt.layout
        question = torch.tensor(list(lay.question_rows()))
        yield Pass(prompt.reused, prompt.computed(), stats=prompt.stats,
                   rescale=dataclasses.replace(self.rescale(lay, prompt.reused), rows=question))


__all__ = ["Ape"]
