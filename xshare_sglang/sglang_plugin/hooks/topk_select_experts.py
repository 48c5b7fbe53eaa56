"""AROUND ``sglang.srt.layers.moe.topk.select_experts`` (checked: topk.py:2821, 0.5.23).

Why: the masking and rewrite points below it see neither the layer nor the TopK config; this is
the one routing entry every STANDARD MoE layer goes through, with both.
How: hand the router logits to the trace recorder when a recorded forward is running (before any
masking); open a "layer call" in the runtime when the target model is being pruned (the config
object identifies the target model's layers, so the draft model's are never touched; an expert-
location dispatch info tells that SGLang will map the routed ids to physical slots), run SGLang's
function unchanged, close the call.
Remove when: SGLang routes through a pluggable TopK whose subclass can carry this state.
"""

from __future__ import annotations

from ..runtime import get_runtime

TARGET = "sglang.srt.layers.moe.topk.select_experts"
KIND = "around"


def hook(original, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None:
        return original(*args, **kwargs)
    topk_config = kwargs["topk_config"] if "topk_config" in kwargs else args[2]
    if runtime.recorder is not None and runtime.recorder.current is not None:
        _record(runtime, topk_config, kwargs["router_logits"] if "router_logits" in kwargs else args[1])
    call = runtime.begin_call(
        topk_config,
        kwargs.get("num_token_non_padded"),
        ids_physical=kwargs.get("expert_location_dispatch_info") is not None,
    )
    if call is None:
        return original(*args, **kwargs)
    try:
        return original(*args, **kwargs)
    finally:
        runtime.end_call()


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
