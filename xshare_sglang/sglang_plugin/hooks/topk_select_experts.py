"""AROUND ``sglang.srt.layers.moe.topk.select_experts`` (checked: topk.py:2821, 0.5.23).

Why: the masking and rewrite points below it see neither the layer nor the TopK config; this is
the one routing entry every STANDARD MoE layer goes through, with both.
How: open a "layer call" in the runtime when the target model is being pruned (the config object
identifies the target model's layers, so the draft model's are never touched), run SGLang's
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
    call = runtime.begin_call(topk_config, kwargs.get("num_token_non_padded"))
    if call is None:
        return original(*args, **kwargs)
    try:
        return original(*args, **kwargs)
    finally:
        runtime.end_call()
