"""vLLM token blocks as kvcraft variants, and what the scheduler side tells the worker side.

Block i of a prompt is stored as a variant of the "chunk" made of that block's token
ids, behind the variant id of block i-1 (empty for block 0), so a block's variant id is
a chained hash of every token before it, exactly like vLLM's prefix cache:

    vid_0 = variant_id(chunk_key(M, tokens[0:B]), [])
    vid_i = variant_id(chunk_key(M, tokens[iB:(i+1)B]), [vid_{i-1}])

M is the block namespace (config.spec_from_vllm): vLLM's cached K is *after* RoPE, at
the block's absolute positions, unlike kvcraft's chunk caches (K without RoPE), and it
names the weights, so no block is ever read by another model or other weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvcraft.keys import chunk_key, variant_id
from kvcraft.plans import Plan


def block_chain(model_id: str, token_ids: list[int], block_size: int) -> tuple[list[str], list[str]]:
    """(chunk keys, chained variant ids) of the full blocks of `token_ids`."""
    keys: list[str] = []
    vids: list[str] = []
    prev: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        k = chunk_key(model_id, token_ids[start:start + block_size])
        v = variant_id(k, prev)
        keys.append(k)
        vids.append(v)
        prev = [v]
    return keys, vids


@dataclass(frozen=True)
class BlockLoad:
    """Load these service blocks into these vLLM blocks, then report the request done."""

    req_id: str
    block_ids: tuple[int, ...]
    chunk_keys: tuple[str, ...]
    variant_ids: tuple[str, ...]
    tokens: int  # tokens vLLM accepted from this load (counted as loaded or failed)


@dataclass(frozen=True)
class BlockSave:
    """Store the KV of vLLM block `block_id` (computed this step) as this variant."""

    block_id: int
    token_ids: tuple[int, ...]
    prefix_vid: str  # "" for block 0
    variant_id: str


@dataclass(frozen=True)
class BlendLoad:
    """Build the KV of a RAG request's prompt (its chunks blended by `policy`) and write
    tokens [first_token, first_token + tokens) into these vLLM blocks (first_token is
    block-aligned; the last block may be partly written)."""

    req_id: str
    block_ids: tuple[int, ...]
    first_token: int
    tokens: int                       # tokens vLLM accepted (counted as loaded or failed)
    prompt: tuple[int, ...]           # the prompt's token ids
    chunk_tokens: tuple[int, ...]     # token count of each chunk, in prompt order; the rest is the question
    plan: Plan                        # the scheduler side's Plan of those chunks
    policy: str
    options: tuple[tuple[str, Any], ...] = ()


def unblended(policy: str, prompt_tokens: int, num_layers: int, budget: float, why: str) -> dict[str, Any]:
    """What a RAG request reports when vLLM computes it alone (`why`: what failed, or why it was not blended)."""
    return {"blended": False, "policy": policy, "prompt_tokens": prompt_tokens, "claimed_tokens": 0,
            "vllm_computed_tokens": prompt_tokens, "kvcraft_row_layers": 0, "num_layers": num_layers,
            "computed_share": 1.0, "reused_chunks": 0, "fresh_chunks": 0, "fallback": why, "budget": budget,
            "sampled": False}


@dataclass
class KVCraftMetadata(KVConnectorMetadata):
    """Scheduler -> worker side, each step. vLLM pickles it to the worker processes (its
    executor's message queue), so it holds plain picklable records only: a BlendLoad's
    Plan crosses as it is."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)
    blends: list[BlendLoad] = field(default_factory=list)
    idle: bool = False  # vLLM scheduled no tokens this step (the worker may wait for its loads)
    # the step's requests where its every token is the last prompt token after a blend's claim
    # (the blends may answer them: `last_token`), else empty
    last_tokens: tuple[str, ...] = ()


@dataclass
class KVCraftWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler side, each step: what each finished blend computed (request id ->
    the numbers RequestOutput.kv_transfer_params["kvcraft"] reports), and the blends'
    per-layer load/compute timings (a serialized kvcraft TimingReport) for the scheduler
    side's next Plan: the service's loading controller learns from them (CacheBlend §5);
    and the finished blends whose last prompt token the worker side holds (`last_token`)."""

    blends: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: bytes = b""
    last_ready: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVCraftWorkerMeta":
        """Another rank's (tensor parallel > 1, the same step): a request's numbers are one
        rank's, with `ranks` counting the ranks that reported it and `ranks_differ` naming
        what they disagreed on (they compute the same rows, `engine_adapter.ranks`)."""
        if isinstance(other, KVCraftWorkerMeta):
            for req_id, theirs in other.blends.items():
                mine = self.blends.setdefault(req_id, theirs)
                if mine is theirs:
                    continue
                mine["ranks"] = mine.get("ranks", 1) + theirs.get("ranks", 1)
                differ = [k for k in RANK_AGREED if mine.get(k) != theirs.get(k)]
                if differ:
                    mine["ranks_differ"] = sorted(set(mine.get("ranks_differ", [])) | set(differ))
            self.timings += other.timings  # concatenated protobuf messages merge on parsing
            self.last_ready |= other.last_ready
        return self


# What every rank of a blend computes alike (the rest, timings, is its own)
RANK_AGREED = ("blended", "fallback", "claimed_tokens", "kvcraft_row_layers", "reused_chunks", "fresh_chunks")


def kv_views(t: torch.Tensor, block_size: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) views of one layer's paged KV in vLLM, each [num_blocks, kv_heads, block_size, head_dim]."""
    bs, h, d = block_size, kv_heads, head_dim
    nb = t.shape[0]
    if t.dim() == 4 and tuple(t.shape[1:]) == (h, bs, 2 * d):
        # CPU backend: [blocks, heads, block, 2*hd], K rows then V rows per (block, head)
        v = t.view(nb, h, 2, bs, d)
        return v[:, :, 0], v[:, :, 1]
    if t.dim() == 5 and tuple(t.shape[1:]) == (2, bs, h, d):
        # flash-attention NHD: [blocks, 2, block, heads, hd]
        return t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)
    raise ValueError(f"KVCraftConnector does not know the paged KV layout {tuple(t.shape)} "
                     f"(block {bs}, kv heads {h}, head dim {d})")


def block_mismatch(blocks: Any, shape: tuple[int, ...], k_dtype: torch.dtype, v_dtype: torch.dtype) -> str:
    """Why these stored (K, V) blocks do not fit vLLM's cache blocks ("" when they do)."""
    for k, v in blocks:
        if tuple(k.shape) != shape or tuple(v.shape) != shape or k.dtype != k_dtype or v.dtype != v_dtype:
            return f"a block of shape {tuple(k.shape)} {k.dtype}, not {shape} {k_dtype}"
    return ""
