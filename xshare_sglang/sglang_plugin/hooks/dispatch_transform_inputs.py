"""AROUND ``sglang.srt.eplb.expert_location_dispatch.transform_select_experts_inputs``
(checked: expert_location_dispatch.py:74, called at topk.py:2886, 0.5.23).

Why: it receives the router logits and the correction bias right before every STANDARD routing
variant (softmax, sigmoid, grouped, biased grouped, custom); masking both there makes SGLang's own
routing choose among the kept experts.
How: run SGLang's transform first; return its result for a call the fused path routes; for a call
on the masked path compute the keep mask of the current layer call and mask the logits in place and
the bias into a per-layer buffer (large finite negative value).  A failure
returns SGLang's inputs untouched: that layer call stays unpruned.
Remove when: SGLang has a routing-mask hook of its own.
"""

from __future__ import annotations

from ..runtime import get_runtime

TARGET = "sglang.srt.eplb.expert_location_dispatch.transform_select_experts_inputs"
KIND = "around"


def hook(original, *args, **kwargs):
    router_logits, correction_bias = original(*args, **kwargs)
    runtime = get_runtime()
    call = runtime.call if runtime is not None else None
    if call is None or call.fused:  # the fused path routes this call itself
        return router_logits, correction_bias
    return runtime.select_and_mask(call, router_logits, correction_bias)
