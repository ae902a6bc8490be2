"""The connector's settings and the namespace of its blocks (which model's KV they are)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from kvcraft.keys import ModelSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MODULE_PATH = "engine_adapter.vllm.connector"
CONNECTOR_NAME = "KVCraftConnector"


def kv_transfer_config(address: str, **extra: Any) -> dict[str, Any]:
    """The `kv_transfer_config` argument of `vllm.LLM` / `--kv-transfer-config`."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        # A failed load must be recomputed, never fail the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": address, **extra},
    }


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, validated once (docs/vllm.md has the table)."""

    address: str = "127.0.0.1:50051"
    model_name: str = ""             # default: a fingerprint of the weights (weights_fingerprint)
    lookup_timeout_s: float = 1.0    # a request waits at most this for its MatchPrefix answer
    breaker_failures: int = 3        # consecutive failed lookups that switch lookups off ...
    retry_after_s: float = 5.0       # ... for this long
    load_timeout_s: float = 5.0      # one request's whole load (all layers), in the background
    load_concurrency: int = 2        # loader threads: prefix loads (and a GPU's blends) of this many requests at once
    store_timeout_s: float = 10.0    # one block's Store
    save_concurrency: int = 4        # Store RPCs in flight at once
    max_pending_saves: int = 4096    # blocks waiting for Store; more are dropped (a later miss)
    shutdown_drain_s: float = 5.0    # shutdown waits at most this for queued saves
    idle_wait_s: float = 0.05        # a step with nothing to compute waits at most this for a load to end
    local: bool = True               # read stored KV (prefix loads, blends) from the service's shared memory
                                     # when it runs on this host; false: always one gRPC stream
    token: str | None = None
    # Blending (docs/vllm.md "Blending"): requests whose kv_transfer_params carry chunk
    # boundaries get their context KV built by kvcraft with this reuse policy.
    blend_policy: str = "off"        # "off" or a name of engine_adapter.policy.POLICIES
    blend_options: dict = field(default_factory=dict)  # make_blend_policy(blend_policy, blend_options)
    blend_store_back: bool = True    # store the chunks kvcraft computed in full (fresh) as variants
    chunk_model_id: str = ""         # chunk namespace; default: the reference engine's ModelSpec fingerprint
    plan_timeout_s: float = 1.0      # a blend request waits at most this for its Plan (then: vLLM alone)
    blend_graphs: bool = False       # the blend's layers as static steps, CUDA graphs (CUDA only; docs/vllm.md)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "ConnectorSettings":
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        s = cls(**extra)
        for name in ("lookup_timeout_s", "load_timeout_s", "store_timeout_s", "retry_after_s"):
            if not getattr(s, name) > 0:
                raise ValueError(f"kv_connector_extra_config {name} must be > 0, got {getattr(s, name)!r}")
        for name in ("breaker_failures", "save_concurrency", "max_pending_saves", "load_concurrency"):
            if not (isinstance(getattr(s, name), int) and getattr(s, name) >= 1):
                raise ValueError(f"kv_connector_extra_config {name} must be an integer >= 1, got {getattr(s, name)!r}")
        for name in ("local", "blend_store_back", "blend_graphs"):
            if not isinstance(getattr(s, name), bool):
                raise ValueError(f"kv_connector_extra_config {name} must be true or false, got {getattr(s, name)!r}")
        if not s.plan_timeout_s > 0:
            raise ValueError(f"kv_connector_extra_config plan_timeout_s must be > 0, got {s.plan_timeout_s!r}")
        if s.blend_policy != "off":
            make_blend_policy(s.blend_policy, s.blend_options)  # raises naming the problem
        else:
            for name in ("blend_options", "blend_graphs"):
                if getattr(s, name):
                    raise ValueError(f"kv_connector_extra_config {name} given but blend_policy is 'off'")
        for name in ("shutdown_drain_s", "idle_wait_s"):
            if not getattr(s, name) >= 0:
                raise ValueError(f"kv_connector_extra_config {name} must be >= 0, got {getattr(s, name)!r}")
        return s


def check_device(settings: ConnectorSettings, device_type: str) -> None:
    """What the settings need of vLLM's device; ValueError naming the key otherwise."""
    if settings.blend_graphs and device_type != "cuda":
        raise ValueError(f"kv_connector_extra_config blend_graphs needs a CUDA device (vLLM's is {device_type!r})")


def make_blend_policy(name: Any, options: Any) -> Any:
    """engine_adapter.policy.Policy(name, **options); ValueError naming the key otherwise.
    name: a policy name, as `ConnectorSettings.blend_policy` or a request gives it."""
    from engine_adapter.policy import POLICIES, Policy

    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"blend policy {name!r} unknown; known: 'off', {', '.join(map(repr, POLICIES))}")
    if not isinstance(options, dict):
        raise ValueError(f"blend options must be a mapping, got {type(options).__name__}")
    try:
        return Policy(name, **options)
    except (TypeError, ValueError) as e:
        raise ValueError(f"blend policy {name!r} with options {options}: {e}") from None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE = 64 << 10


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """A cheap id of the weights vLLM loads from `model`.

    A local folder: for every weight file (suffixes WEIGHT_SUFFIXES, any depth) its
    relative path, size, modification time (ns) and an xxh3 of three 64 KiB samples
    (start, middle, end), plus the bytes of config.json. Rewriting a weight file changes
    its mtime (and almost surely its samples), so different weights at the same path get
    a different id; copies of the same weights elsewhere usually get another id too
    (mtime), which only costs reuse, never correctness. Cost: a stat and 192 KiB read per
    file. A hub name: the name and revision (what vLLM resolves it to).
    """
    root = Path(model)
    h = xxhash.xxh3_128()
    if not root.is_dir():
        h.update(f"hub:{model}@{revision or 'default'}".encode())
        return h.hexdigest()
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(p, "rb") as f:
            for off in (0, max(0, st.st_size // 2 - _SAMPLE // 2), max(0, st.st_size - _SAMPLE)):
                f.seek(off)
                h.update(f.read(_SAMPLE))
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    return h.hexdigest()


def block_model_spec(weights: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: str, rope_theta: float) -> ModelSpec:
    """Identity of vLLM block KV: post-RoPE, fixed positions, one block per chunk."""
    return ModelSpec(f"vllm-blocks/post-rope/{weights}/block{block_size}", num_layers, num_kv_heads, head_dim,
                     dtype, rope_theta)


def spec_from_vllm(vllm_config: "VllmConfig", settings: ConnectorSettings) -> ModelSpec:
    """The block namespace of this vLLM: weights (or `model_name`), shape, dtype, RoPE, quantization."""
    mc = vllm_config.model_config
    par = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype in ("auto", None) else str(cache_dtype)
    rope = getattr(mc.hf_config, "rope_theta", None)
    if rope is None:
        rope = (getattr(mc.hf_config, "rope_parameters", None) or {}).get("rope_theta", 0.0)
    weights = settings.model_name or weights_fingerprint(str(mc.model), getattr(mc, "revision", None))
    quant = getattr(mc, "quantization", None)
    if quant:
        weights = f"{weights}/{quant}"
    return block_model_spec(weights, vllm_config.cache_config.block_size, mc.get_num_layers(par),
                            mc.get_num_kv_heads(par), mc.get_head_size(), dtype, float(rope))



def chunk_spec(vllm_config: "VllmConfig") -> ModelSpec:
    """The ModelSpec chunk variants are keyed by when blending: the one
    `engine_adapter.llama.LlamaEngine.from_pretrained(model dir)` gives (folder name,
    shape, dtype, RoPE), so chunks stored by the reference engine (RAGAdapter) and by
    this connector serve each other; a quantized model's name carries its quantization
    (`blend_name`: its KV is not the unquantized model's)."""
    from engine_adapter.llama import LlamaConfig

    mc = vllm_config.model_config
    c = LlamaConfig.from_hf(mc.hf_config.to_dict(), name=blend_name(mc))
    return ModelSpec(name=c.name, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                     dtype=str(mc.dtype).removeprefix("torch."), rope_theta=c.rope_theta,
                     rope_scaling=c.rope_scaling)


def blend_name(model_config: Any) -> str:
    """The name chunk variants of this vLLM model are keyed by: its folder's (the reference
    engine's), with "/<quantization>" where vLLM quantized it."""
    quant = getattr(model_config, "quantization", None)
    return Path(str(model_config.model)).name + (f"/{quant}" if quant else "")


def chunk_namespace(vllm_config: "VllmConfig", settings: ConnectorSettings) -> str:
    """The model id chunk variants are keyed by when blending: `chunk_model_id`, else
    `chunk_spec`'s fingerprint."""
    return settings.chunk_model_id or chunk_spec(vllm_config).fingerprint()
