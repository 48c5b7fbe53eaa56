"""AROUND ``sglang.srt.layers.moe.topk.TopK.forward_cuda`` (checked: topk.py:860, routing at
topk.py:906, hand-off at topk.py:927, 0.5.23).

Why: with the ``TRITON_KERNEL`` top-k output format (``--moe-runner-backend triton_kernel``, GPT-OSS's
default on H100/H200) and the ``BYPASSED`` format (``flashinfer_trtllm``, ``flashinfer_mxfp4``) this
method never calls ``select_experts``: it routes the router logits with ``triton_kernels``' routing,
or hands them to the fused MoE kernel, which routes inside.  It is the narrowest place that sees
both the logits and the layer (its ``TopKConfig``) before that routing.
How: for a pruned layer call of one of these formats (STANDARD calls pass through: the
``select_experts`` hooks prune them), compute the keep mask with the selection kernels in select-only
mode and mask a copy of the logits (and the correction bias, into a per-layer buffer), then run
SGLang's method on the masked logits: the routing is SGLang's own on masked inputs (substitution
coverage; truncation is refused at model load).  ``TRITON_KERNEL``: the call's metrics take the
activated experts from the routing's expert histogram (its ragged metadata's slice sizes).
``BYPASSED``: from the layer's reference router on the masked inputs; the output carries a copy of
the layer's ``TopKConfig`` holding the masked bias, which the in-kernel router reads, and which is
not one of the runtime's layers, so that a later ``to_standard()`` (``select_experts``) routes the
masked inputs as they are instead of pruning them a second time.  The trace recorder gets the
unmasked logits first.  A fault in the selection runs the call unpruned.
Remove when: SGLang's TopK takes a routing mask (or a pluggable router) on every output format.
"""

from __future__ import annotations

import dataclasses

from ..model_layers import kernel_routing_format
from ..runtime import get_runtime
from .topk_select_experts import _record

TARGET = "sglang.srt.layers.moe.topk.TopK.forward_cuda"
KIND = "around"

_NAMES = ("hidden_states", "router_logits")


def hook(original, topk_module, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None:
        return original(topk_module, *args, **kwargs)
    bound = dict(zip(_NAMES, args, strict=False))
    bound.update(kwargs)
    config = topk_module.topk_config
    output_format = kernel_routing_format(config)
    if bound.get("dynamic_expert_bias") is not None or output_format is None:
        return original(topk_module, *args, **kwargs)  # STANDARD: select_experts and its hooks
    if bound.get("router_logits_partials") is not None:
        # ROCm's split-K router: SGLang sums the partials into the logits first on these formats
        from sglang.srt.layers.moe import topk

        topk.rocm_router_reduce_partials(bound["router_logits_partials"], bound["router_logits"])
        bound["router_logits_partials"] = None
    router_logits = bound["router_logits"]
    recorded = runtime.recorder is not None and runtime.recorder.current is not None
    if recorded:
        _record(runtime, config, router_logits)
    call = _begin(runtime, topk_module, bound)
    if call is None:
        output = original(topk_module, **bound)
        if recorded and output_format == "BYPASSED" and id(config) in runtime.layers:
            # a later to_standard() must not record these logits a second time
            output = output._replace(topk_config=dataclasses.replace(config))
        return output
    try:
        bias = config.correction_bias if output_format == "BYPASSED" else None  # triton_kernels takes none
        masked = runtime.mask_for_kernel(call, router_logits, bias)
        if masked is None:  # the selection failed: this call runs unpruned
            return original(topk_module, **bound)
        masked_logits, masked_bias = masked
        output = original(topk_module, **{**bound, "router_logits": masked_logits})
        if output_format == "TRITON_KERNEL":
            metadata = getattr(output, "a_ragged_metadata", None)  # a missing histogram is a counted fault
            runtime.count_kernel_routing(call, expert_counts=getattr(metadata, "slice_sizes", None))
            return output
        try:
            output = output._replace(topk_config=dataclasses.replace(config, correction_bias=masked_bias))
        except Exception as exc:  # the kernel would read the unmasked bias: run the call unpruned
            runtime.record_fault(call.layer, exc)
            return original(topk_module, **bound)
        runtime.count_kernel_routing(call, masked_logits=masked_logits, masked_bias=masked_bias)
        return output
    finally:
        runtime.end_call()


def _begin(runtime, topk_module, bound: dict):
    """The runtime's layer call, with SGLang's real-token count of this call; None when unpruned."""
    if not runtime.pruning_phase():
        return None
    try:
        num_token_non_padded, _ = topk_module._resolve_routing_inputs(
            bound.get("num_token_non_padded"), bound.get("expert_location_dispatch_info")
        )
    except Exception as exc:  # SGLang's own forward raises the same; the pruner stays out of it
        runtime.record_fault("the routing inputs of a MoE kernel call", exc)
        return None
    return runtime.begin_call(topk_module.topk_config, num_token_non_padded)
