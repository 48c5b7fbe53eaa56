"""One GPT-OSS-shaped layer of the plugin's runtime, for the kernel-routing benchmark and its GPU test.

Where SGLang routes inside the MoE kernel (``TRITON_KERNEL`` top-k format), the plugin's
``TopK.forward_cuda`` hook runs three steps: the keep mask and masked logits
(:meth:`PrunerRuntime.mask_for_kernel`), ``triton_kernels``' top-k on them, and the call's metrics
(:meth:`PrunerRuntime.count_kernel_routing`).  The GPU machine has no SGLang, so the benchmark and
the GPU test build the runtime around a stand-in for SGLang's ``TopKConfig`` with the fields the
plugin reads.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..config import PrunerConfig
from ..sglang_plugin.model_layers import make_layer_state, make_runtime
from ..sglang_plugin.runtime import ForwardScope, PrunerRuntime
from ..sglang_plugin.settings import PluginSettings


def gptoss_layer_runtime(num_experts: int, top_k: int, cfg: PrunerConfig, device) -> tuple[PrunerRuntime, object]:
    """A runtime pruning one GPT-OSS-shaped layer (softmax router renormalized over its top-k) in a
    decode forward; returns it and the layer's config object (the key of its layer state)."""
    config = SimpleNamespace(
        top_k=top_k,
        num_shared_topk_slots=0,
        scoring_func="softmax",
        custom_routing_function=None,
        correction_bias=None,
        use_grouped_topk=False,
        num_expert_group=None,
        topk_group=None,
        renormalize=True,
        routed_scaling_factor=None,
        apply_routed_scaling_factor_on_output=False,
    )
    state = make_layer_state(config, layer_id=0, row=0, num_experts=num_experts, device=device)
    runtime = make_runtime(PluginSettings(pruner=cfg), {id(config): state}, device)
    runtime.enter(ForwardScope(phase="decode", num_valid=runtime.num_valid_buffer, cfg=runtime.config_for("decode")))
    return runtime, config


def pruned_kernel_routing(topk, runtime: PrunerRuntime, config, logits: torch.Tensor, num_valid, top_k: int):
    """The hook's three steps on ``logits`` [T, E]: returns the masked logits and ``triton_kernels``'
    sparse top-k of them (``topk`` is ``triton_kernels.topk.topk``)."""
    call = runtime.begin_call(config, num_valid)
    masked, _ = runtime.mask_for_kernel(call, logits, None)
    sparse = topk(masked, top_k, apply_softmax=True, n_rows=num_valid)
    runtime.count_kernel_routing(call, expert_counts=sparse.mask_metadata.col_sum)
    runtime.end_call()
    return masked, sparse
