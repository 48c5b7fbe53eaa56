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


def apply_echo_hooks() -> None:
    """Register and apply the plugin's ECHO hooks through SGLang's HookRegistry (idempotent)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from xshare_sglang.sglang_plugin import hooks, liveness

    if liveness.unhooked(hooks.ECHO_HOOKS):
        for module in hooks.ECHO_HOOKS:
            HookRegistry.register(module.TARGET, module.hook, HookType(module.KIND))
        HookRegistry.apply_hooks()
    assert liveness.unhooked(hooks.ECHO_HOOKS) == []


def deepseek_topk_config(*, top_k: int, layer_id: int, correction_bias: torch.Tensor, **fields):
    """SGLang's ``TopKConfig`` of a DeepSeek-V3 router: sigmoid scores plus a correction bias, 8 expert
    groups of which the best 4 are kept, routed scaling 2.5 (``fields`` adds or overrides)."""
    from sglang.srt.layers.moe.topk import TopKConfig

    settings = dict(
        top_k=top_k,
        renormalize=True,
        scoring_func="sigmoid",
        use_grouped_topk=True,
        num_expert_group=8,
        topk_group=4,
        correction_bias=correction_bias,
        routed_scaling_factor=2.5,
        layer_id=layer_id,
    )
    return TopKConfig(**(settings | fields))


def sglang_select_experts(config, logits: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids, topk_weights)`` of SGLang's own ``select_experts`` on ``logits`` (hooked when the
    plugin's routing hooks are applied and a runtime is published); the input is not modified."""
    from sglang.srt.layers.moe import topk

    out = topk.select_experts(
        hidden_states=torch.zeros(logits.shape[0], 16),
        router_logits=logits.clone(),
        topk_config=config,
        layer_id=config.layer_id,
        **kwargs,
    )
    return out.topk_ids.clone(), out.topk_weights.clone()


def runner_attributes(model, *, is_draft_worker: bool = False) -> dict:
    """What the plugin's ``ModelRunner.__init__`` hook reads from SGLang's ModelRunner."""
    return {
        "is_draft_worker": is_draft_worker,
        "model": model,
        "device": "cpu",
        "tp_rank": 0,
        "capture_head_hooks": [],
        "capture_tail_hooks": [],
    }


def stand_in_topk(config, *, layer_id: int, is_draft: bool = False):
    """Stand-in: a real ``TopK`` instance whose constructor is bypassed (a real one needs SGLang's
    published config namespaces), carrying a real ``TopKConfig``."""
    from sglang.srt.layers.moe.topk import TopK

    module = TopK.__new__(TopK)
    torch.nn.Module.__init__(module)
    module.layer_id, module.is_draft, module.topk_config = layer_id, is_draft, config
    return module


def stand_in_experts(*, layer_id: int, num_experts: int, num_fused_shared_experts: int = 0, runner: str = "triton"):
    """Stand-in: a real ``FusedMoE`` instance with its constructor bypassed (a real one needs the
    parallel config and allocates weights); only the attributes the plugin reads are set.  ``runner``
    is the resolved MoE runner backend (default: Triton, as on a CUDA server)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    module = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(module)
    module.layer_id, module.num_experts = layer_id, num_experts + num_fused_shared_experts
    module.num_fused_shared_experts = num_fused_shared_experts
    module.moe_runner_config = SimpleNamespace(runner_backend=MoeRunnerBackend(runner))
    return module


def sglang_draft(batch: int, topk: int, num_steps: int, *, vocab: int = 50, seed: int = 0):
    """``(score_list, token_list, parents_list)`` as SGLang's own draft step functions build them, from
    random draft distributions."""
    from sglang.srt.speculative import spec_utils

    later = spec_utils._select_top_k_tokens_later
    later = getattr(later, "__wrapped__", later)  # the torch.compile wrapper needs a compiler on CPU
    gen = torch.Generator().manual_seed(seed)
    lists = ([], [], [])
    scores = None
    for step in range(num_steps):
        rows = batch if step == 0 else batch * topk
        probs = (torch.randn(rows, vocab, generator=gen) * 2).softmax(-1)
        topk_p, topk_index = probs.topk(topk, dim=-1)
        if step == 0:
            _, _, scores, tree_info = spec_utils._select_top_k_tokens_first(topk_p, topk_index, None, topk)
        else:
            _, _, scores, tree_info = later(step, topk_p, topk_index, None, scores, topk)
        for out, item in zip(lists, tree_info, strict=True):
            out.append(item)
    return lists


def build_tree_links(parent_list: torch.Tensor, top_scores_index: torch.Tensor, topk: int):
    """``retrieve_next_token`` / ``retrieve_next_sibling`` as SGLang's ``build_tree_kernel_efficient``
    links them (eagle.cuh: a node's parent is the root when ``index // topk == 0``, else the selected
    node holding ``parent_list[index // topk]``; children are chained in increasing node order)."""
    batch, slots = top_scores_index.shape
    width = slots + 1
    next_token = torch.full((batch, width), -1, dtype=torch.int64)
    next_sibling = torch.full((batch, width), -1, dtype=torch.int64)
    for b in range(batch):
        selected = top_scores_index[b].tolist()
        for node in range(width - 1, 0, -1):
            owner = selected[node - 1] // topk
            parent = 0 if owner == 0 else 1 + selected.index(int(parent_list[b, owner]))
            next_sibling[b, node] = next_token[b, parent]
            next_token[b, parent] = node
    return next_token, next_sibling


def publish_runtime(configs, names, pruner, *, num_experts: int, num_valid: int, phase: str = "decode", d: int = 1):
    """Publish a CPU runtime pruning the layers ``configs[name]`` (rows in the order of ``names``) in a
    forward of ``phase`` with ``num_valid`` real tokens and ``d`` tokens per request."""
    from xshare_sglang.sglang_plugin.model_layers import make_layer_state, make_runtime
    from xshare_sglang.sglang_plugin.runtime import ForwardScope, set_runtime
    from xshare_sglang.sglang_plugin.settings import PluginSettings

    states = {
        id(configs[name]): make_layer_state(
            configs[name], layer_id=configs[name].layer_id, row=row, num_experts=num_experts, device="cpu"
        )
        for row, name in enumerate(names)
    }
    runtime = make_runtime(PluginSettings(pruner=pruner), states, "cpu")
    runtime.num_valid_buffer.fill_(num_valid)
    scope = ForwardScope(
        phase=phase, tokens_per_request=d, num_valid=runtime.num_valid_buffer, cfg=runtime.config_for(phase)
    )
    runtime.enter(scope)
    set_runtime(runtime)
    return runtime
