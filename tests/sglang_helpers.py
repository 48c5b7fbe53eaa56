"""Helpers for the tests that run SGLang's own code on CPU."""

from __future__ import annotations

import torch


def apply_routing_hooks() -> None:
    """Register and apply the plugin's routing hooks through SGLang's HookRegistry (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from xshare_sglang.sglang_plugin import hooks, liveness

    if not liveness.unhooked(hooks.ROUTING_HOOKS):
        return
    for module in hooks.ROUTING_HOOKS:
        HookRegistry.register(module.TARGET, module.hook, HookType(module.KIND))
    HookRegistry.apply_hooks()
    assert liveness.unhooked(hooks.ROUTING_HOOKS) == []


def stand_in_topk(config, *, layer_id: int, is_draft: bool = False):
    """Stand-in: a real ``TopK`` instance whose constructor is bypassed (a real one needs SGLang's
    published config namespaces), carrying a real ``TopKConfig``."""
    from sglang.srt.layers.moe.topk import TopK

    module = TopK.__new__(TopK)
    torch.nn.Module.__init__(module)
    module.layer_id, module.is_draft, module.topk_config = layer_id, is_draft, config
    return module


def stand_in_experts(*, layer_id: int, num_experts: int, num_fused_shared_experts: int = 0):
    """Stand-in: a real ``FusedMoE`` instance with its constructor bypassed (a real one needs the
    parallel config and allocates weights); only the attributes the plugin reads are set."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    module = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(module)
    module.layer_id, module.num_experts = layer_id, num_experts + num_fused_shared_experts
    module.num_fused_shared_experts = num_fused_shared_experts
    return module
