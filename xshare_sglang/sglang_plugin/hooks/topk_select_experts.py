"""AROUND ``sglang.srt.layers.moe.topk.select_experts`` (checked: topk.py:2821, 0.5.23).

Why: this is the one routing entry every STANDARD MoE layer goes through, with the layer's TopK
config; a pruned layer call is routed here by the fused selection kernels instead of SGLang's top-k
(selection and routing in one or two launches, no masking and no rewrite afterwards).
How: hand the router logits to the trace recorder when a recorded forward is running (before any
masking); open a "layer call" in the runtime when the target model is being pruned (the config
object identifies the target model's layers, so the draft model's are never touched).  When the
layer's router is one the kernels reproduce and SGLang would not override this call's routing
(per-token bias, partial logits, a routing simulation, ROCm aiter, LoRA's packed top-k), run
SGLang's input transform, route with :meth:`PrunerRuntime.route`, then SGLang's own post-processing
(logical-to-physical expert mapping, padding, routed-experts capture) and its expert-distribution
recorder, and return SGLang's ``StandardTopKOutput``.  Where SGLang would route the layer with its
torch-native top-k (the CPU engine), the runtime is also handed that top-k of the unmasked logits,
so tokens whose own experts are all kept get SGLang's routing bit for bit.  Otherwise run
SGLang's function, where the masking and rewrite hooks prune it.  A fault in the fused path leaves the call unpruned.
Remove when: SGLang routes through a pluggable TopK whose subclass can carry this state.
"""

from __future__ import annotations

from ..runtime import get_runtime

TARGET = "sglang.srt.layers.moe.topk.select_experts"
KIND = "around"

_NAMES = ("hidden_states", "router_logits", "topk_config")


def hook(original, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None:
        return original(*args, **kwargs)
    bound = dict(zip(_NAMES, args, strict=False))
    bound.update(kwargs)
    topk_config = bound["topk_config"]
    if runtime.recorder is not None and runtime.recorder.current is not None:
        _record(runtime, topk_config, bound["router_logits"])
    info = bound.get("expert_location_dispatch_info")
    call = runtime.begin_call(topk_config, bound.get("num_token_non_padded"), ids_physical=info is not None)
    if call is None:
        return original(*args, **kwargs)
    try:
        if call.layer.router is not None and _fusable(bound):
            output = _route_fused(runtime, call, bound)
            if output is not None:
                return output
            runtime.end_call()  # the fused path failed: this call runs unpruned
        return original(*args, **kwargs)
    finally:
        runtime.end_call()


def _fusable(bound: dict) -> bool:
    """Whether SGLang would route this call with the layer's plain router (nothing overrides it)."""
    from sglang.srt.layers.moe import topk

    if bound.get("dynamic_expert_bias") is not None or bound.get("router_logits_partials") is not None:
        return False
    if getattr(topk, "_use_aiter", False) or getattr(topk, "_SGLANG_EXPERIMENTAL_LORA_OPTI", False):
        return False
    envs = topk.envs
    return not (envs.SGLANG_SIMULATE_UNIFORM_EXPERTS.get() or envs.SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS.get())


def _route_fused(runtime, call, bound: dict):
    """Route the call with the fused kernels and SGLang's post-processing; None on a fault."""
    from sglang.srt.layers.moe import topk

    topk_config = bound["topk_config"]
    info = bound.get("expert_location_dispatch_info")
    call.fused = True
    router_logits, correction_bias = topk.expert_location_dispatch.transform_select_experts_inputs(
        router_logits=bound["router_logits"], correction_bias=topk_config.correction_bias, info=info
    )
    routed = runtime.route(call, router_logits, correction_bias, _model_routing(bound, router_logits, correction_bias))
    if routed is None:
        return None
    ids, weights = routed
    topk_ids, topk_weights, recorder_ids = topk._post_process_topk_ids(
        topk_ids=ids,
        topk_weights=weights,
        topk_config=topk_config,
        router_logits=router_logits,
        layer_id=bound.get("layer_id"),
        num_token_non_padded=bound.get("num_token_non_padded"),
        expert_location_dispatch_info=info,
        padded_rows_masked=True,
    )
    if info is not None and not call.layer.fill_dropped and topk_ids is not ids:
        # SGLang's logical-to-physical table reads -1 as its last entry: put the empty slots back
        empty = ids < 0
        topk_ids.masked_fill_(empty, -1)
        if recorder_ids is not None and recorder_ids.data_ptr() != topk_ids.data_ptr():
            recorder_ids.masked_fill_(empty[:, : recorder_ids.shape[1]], -1)
    if recorder_ids is not None:
        topk.get_global_expert_distribution_recorder().on_select_experts(topk_ids=recorder_ids)
    return topk.StandardTopKOutput(topk_weights, topk_ids, router_logits)


def _model_routing(bound: dict, router_logits, correction_bias):
    """SGLang's own routing of the unmasked logits, as a deferred call, where select_experts would
    run SGLang's torch-native top-k for this layer (its CPU path); None elsewhere."""
    from sglang.srt.layers.moe import topk

    topk_config = bound["topk_config"]
    if (
        not topk_config.torch_native
        or topk_config.use_grouped_topk
        or topk_config.custom_routing_function is not None
        or topk_config.num_shared_topk_slots
    ):
        return None

    def run():
        weights, ids = topk.fused_topk_native(
            hidden_states=bound["hidden_states"],
            gating_output=router_logits,
            topk=topk_config.top_k,
            renormalize=topk_config.renormalize,
            correction_bias=correction_bias,
            scoring_func=topk_config.scoring_func,
        )
        return ids, weights

    return run


def _record(runtime, topk_config, router_logits) -> None:
    """Hand the unpruned router logits of a target-model layer to the trace recorder."""
    layer = runtime.layers.get(id(topk_config))
    if layer is None or layer.topk_config is not topk_config:
        return
    try:
        runtime.recorder.record(layer.row, router_logits)
    except Exception as exc:  # the forward goes on; this sample is incomplete and dropped
        runtime.recorder.current = None
        runtime.record_fault("the trace recorder", exc)
