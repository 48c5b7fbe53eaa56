"""Programmatic dependent launch in serving: which devices get it, and that the plugin asks for it.

The launches themselves are checked elsewhere: the PTX (``tests/test_kernels_ptx.py``: every kernel
waits before it touches memory), the refusal below compute capability 9.0
(``tests/test_kernels.py::test_dependent_launch_needs_hopper``) and CUDA-graph replays against the
reference on a GPU (``tests/test_kernels_gpu.py``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.strategies import make_logits
from xshare_sglang import PrunerConfig

NUM_TOKENS, NUM_EXPERTS, TOP_K = 12, 64, 8


@pytest.mark.parametrize(
    ("device", "capability", "interpreting", "expected"),
    [
        ("cuda:0", (9, 0), False, True),
        ("cuda:0", (10, 0), False, True),
        ("cuda:0", (8, 9), False, False),
        ("cuda:0", (9, 0), True, False),
        ("cpu", (9, 0), False, False),
        ("cpu", (9, 0), True, False),
    ],
)
def test_dependent_launch_supported(monkeypatch, device, capability, interpreting, expected) -> None:
    """Hopper and newer GPUs with compiled kernels; never CPU tensors or the interpreter."""
    wrapper = importlib.import_module("xshare_sglang.kernels.launch")
    monkeypatch.setattr(wrapper, "_capability", lambda device: capability)
    if interpreting:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert wrapper.dependent_launch_supported(torch.device(device)) is expected


def _decode_runtime():
    """A plugin runtime over one softmax layer, in a decode forward of NUM_TOKENS real tokens (CPU
    tensors: the fused path takes the reference, which has no launches to overlap)."""
    from sglang.srt.layers.moe.topk import TopKConfig

    from xshare_sglang.sglang_plugin.model_layers import make_layer_state, make_runtime
    from xshare_sglang.sglang_plugin.runtime import ForwardScope
    from xshare_sglang.sglang_plugin.settings import PluginSettings

    cfg = PrunerConfig(policy="xshare", k0=1, budget=8)
    config = TopKConfig(top_k=TOP_K, renormalize=True, scoring_func="softmax", layer_id=0)
    state = make_layer_state(config, layer_id=0, row=0, num_experts=NUM_EXPERTS, device="cpu")
    runtime = make_runtime(PluginSettings(pruner=cfg), {id(config): state}, "cpu")
    runtime.num_valid_buffer.fill_(NUM_TOKENS)
    runtime.enter(ForwardScope(phase="decode", tokens_per_request=1, num_valid=runtime.num_valid_buffer, cfg=cfg))
    return runtime, config


@pytest.mark.sglang
@pytest.mark.parametrize("supported", [True, False])
def test_plugin_launches_dependently_where_supported(monkeypatch, caplog, supported) -> None:
    """The plugin's fused path asks ``prune_route`` for dependent launches exactly where the device
    supports them, decides once per device, and says so in the log when it does."""
    from xshare_sglang.sglang_plugin import runtime as runtime_module

    asked: list[torch.device] = []
    monkeypatch.setattr(runtime_module, "dependent_launch_supported", lambda device: asked.append(device) or supported)
    seen: list[bool] = []
    real_prune_route = runtime_module.prune_route

    def recording_prune_route(*args, enable_pdl=False, **kwargs):
        seen.append(enable_pdl)
        return real_prune_route(*args, **kwargs)

    monkeypatch.setattr(runtime_module, "prune_route", recording_prune_route)
    runtime, config = _decode_runtime()
    with caplog.at_level("INFO", logger=runtime_module.__name__):
        for seed in range(3):
            call = runtime.begin_call(config, None)
            assert call is not None
            assert runtime.route(call, make_logits(NUM_TOKENS, NUM_EXPERTS, "normal", seed=seed), None) is not None
            runtime.end_call()
    runtime.leave(None)
    assert runtime.faults == 0
    assert seen == [supported] * 3
    assert asked == [torch.device("cpu")]  # decided once for the device
    logged = [r for r in caplog.records if "programmatic dependents" in r.getMessage()]
    assert len(logged) == (1 if supported else 0)


@pytest.mark.sglang
def test_a_fault_with_dependent_launches_turns_them_off(monkeypatch, caplog) -> None:
    """A call whose dependent launch fails runs unpruned (counted as a fault), and the device's later
    calls launch plainly and prune again: a driver or graph that refuses them costs one call."""
    from xshare_sglang.sglang_plugin import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "dependent_launch_supported", lambda device: True)
    seen: list[bool] = []
    real_prune_route = runtime_module.prune_route

    def refusing_prune_route(*args, enable_pdl=False, **kwargs):
        seen.append(enable_pdl)
        if enable_pdl:
            raise RuntimeError("programmatic dependent launch refused")
        return real_prune_route(*args, **kwargs)

    monkeypatch.setattr(runtime_module, "prune_route", refusing_prune_route)
    runtime, config = _decode_runtime()
    routed = []
    with caplog.at_level("WARNING", logger=runtime_module.__name__):
        for seed in range(3):
            call = runtime.begin_call(config, None)
            routed.append(runtime.route(call, make_logits(NUM_TOKENS, NUM_EXPERTS, "normal", seed=seed), None))
            runtime.end_call()
    runtime.leave(None)
    assert seen == [True, False, False]
    assert routed[0] is None and routed[1] is not None and routed[2] is not None
    assert runtime.faults == 1
    assert any("dependent launches turned off" in r.getMessage() for r in caplog.records)
