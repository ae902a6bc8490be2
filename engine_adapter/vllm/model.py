"""The model handle blending needs: vLLM's own model class, registered under another name.

The connector's worker side builds a RAG request's context KV with the serving model's own
layers (`vllm.layers.VllmLayers` under `step.layer_step`). vLLM gives a connector no handle
to the model, so a subclass of vLLM's class publishes one:

    LLM(model_dir, hf_overrides={"architectures": ["KVCraftLlamaForCausalLM"]}, ...)

One such name for each architecture kvcraft blends (`ARCHITECTURES`: Llama, Mistral, Qwen2,
Qwen3), each made by one class factory over vLLM's own class (`_blending`). Its forward pass is
vLLM's, but for a step made of blended requests' last prompt tokens: their blends answer them
(`last_token`); on a CPU it takes turns with the blend (`CPU_TURN`). They are registered
through vLLM's plugin entry point (pyproject.toml:
`[project.entry-points."vllm.general_plugins"] kvcraft = "engine_adapter.vllm.model:register"`),
which vLLM runs in every process it starts; no vLLM source is patched. Without the installed
entry point (a source checkout on PYTHONPATH), call `register()` before `LLM(...)` in the
process that builds the model.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import weakref
from typing import Any

from engine_adapter.vllm import last_token

# kvcraft's class name -> (vLLM's module under vllm.model_executor.models, vLLM's class)
ARCHITECTURES = {
    "KVCraftLlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "KVCraftMistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "KVCraftQwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "KVCraftQwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}
ARCHITECTURE = "KVCraftLlamaForCausalLM"  # the one the examples and docs start vLLM with

_lock = threading.Lock()
_current: "weakref.ref[Any] | None" = None

# vLLM's CPU kernels share one scratch buffer per process (its `cpu_utils::ScratchPadManager`):
# a kernel that needs more than it holds frees it and allocates a larger one, under whatever
# kernel of another thread is writing into it at that moment (the heap is then corrupt). oneDNN
# matmuls (vLLM's linear layers, and the blend's calls of them through `VllmLayers`) grow it,
# and so does CPU attention's scheduler metadata, which vLLM builds before each forward pass.
# So on a CPU every call of vLLM's kernels in this process takes this turn: vLLM's forward pass,
# its logits, its attention metadata builds, and the blend's calls. (Their primitive handles
# are not safe from two threads at once either.) On a GPU they run side by side.
CPU_TURN = threading.RLock()
_turn_taking: dict[type, type] = {}  # vLLM's attention backend -> the same, building under CPU_TURN


def _building_in_turn(backend: type) -> type:
    """`backend` (a vLLM attention backend class) whose metadata builder takes `CPU_TURN`."""
    with _lock:
        made = _turn_taking.get(backend)
        if made is None:
            builder = backend.get_builder_cls()

            def build(self: Any, *args: Any, **kw: Any) -> Any:
                with CPU_TURN:
                    return builder.build(self, *args, **kw)

            turn_builder = type(builder.__name__, (builder,), {"build": build, "__module__": __name__})
            made = _turn_taking[backend] = type(backend.__name__, (backend,), {
                "get_builder_cls": staticmethod(lambda: turn_builder), "__module__": __name__})
        return made


def register() -> None:
    """vLLM general plugin: make every name of `ARCHITECTURES` known to vLLM's ModelRegistry
    (idempotent). Registered as classes, not "module:Class" names: vLLM inspects a class it
    has by name in a fresh Python process the first time on each machine (and again whenever
    this file changes), ~10 s of CPU an architecture; a class it is handed is inspected in
    this process. Making them imports vLLM's four model modules (~0.15 s)."""
    from vllm import ModelRegistry

    known = ModelRegistry.get_supported_archs()
    for name in ARCHITECTURES:
        if name not in known:
            ModelRegistry.register_model(name, _class(name))


def current_model() -> Any | None:
    """The blending model built last in this process (None if none is alive)."""
    with _lock:
        return _current() if _current is not None else None


def _blending(name: str) -> type:
    """kvcraft's class `name`: vLLM's class of that architecture plus a handle on the model."""
    module, base_name = ARCHITECTURES[name]
    base = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), base_name)

    def __init__(self: Any, *, vllm_config: Any, prefix: str = "", **kw: Any) -> None:
        from engine_adapter.vllm.config import blend_name

        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kw)
        self.kvcraft_name = blend_name(vllm_config.model_config)
        self._kvcraft_layers = None
        self.kvcraft_max_rows = vllm_config.scheduler_config.max_num_batched_tokens
        on_cpu = vllm_config.device_config.device_type == "cpu"
        self.kvcraft_turn = CPU_TURN if on_cpu else contextlib.nullcontext()  # see CPU_TURN
        if on_cpu:
            for module in self.modules():
                backend = getattr(module, "attn_backend", None)
                if isinstance(backend, type) and hasattr(backend, "get_builder_cls"):
                    module.attn_backend = _building_in_turn(backend)
        global _current
        with _lock:
            _current = weakref.ref(self)

    def forward(self: Any, input_ids: Any = None, positions: Any = None, *args: Any, **kw: Any) -> Any:
        with self.kvcraft_turn:
            plain = not args and kw.get("inputs_embeds") is None and kw.get("intermediate_tensors") is None
            answered = last_token.answer(self, input_ids, positions) if plain else None
            return answered if answered is not None else base.forward(self, input_ids, positions, *args, **kw)

    def compute_logits(self: Any, *args: Any, **kw: Any) -> Any:
        with self.kvcraft_turn:
            return base.compute_logits(self, *args, **kw)

    def kvcraft_engine(self: Any) -> Any:
        """The layer step's model over this model's own layers (`VllmLayers`, made once)."""
        if self._kvcraft_layers is None:
            from engine_adapter.vllm.layers import VllmLayers

            self._kvcraft_layers = VllmLayers(self, self.kvcraft_name)
        return self._kvcraft_layers

    cls = type(name, (base,), {"__init__": __init__, "forward": forward, "compute_logits": compute_logits,
                               "kvcraft_engine": kvcraft_engine,
                               "__module__": __name__,
                               "__doc__": f"vLLM's {base_name} plus a handle kvcraft blends with."})
    cls.__qualname__ = name
    return cls


def _class(name: str) -> type:
    """kvcraft's class `name`, made once (`_blending`)."""
    cls = globals().get(name)
    if cls is None:
        cls = globals()[name] = _blending(name)
    return cls


def __getattr__(name: str) -> Any:
    # `engine_adapter.vllm.model.KVCraft...ForCausalLM`, made when first asked for (vllm is imported then)
    if name in ARCHITECTURES:
        return _class(name)
    raise AttributeError(name)


__all__ = ["ARCHITECTURE", "ARCHITECTURES", "current_model", "register"]
