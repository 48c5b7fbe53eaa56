"""AFTER ``sglang.srt.layers.moe.topk._post_process_topk_ids`` (checked: topk.py:2548, called at
topk.py:3126, 0.5.23).

Why: after masking, a token with fewer kept candidates than k (or grouped routing reaching a group
without kept experts) still picks pruned experts at weight ~0, and CUDA-graph padding rows are routed
too; the fused MoE kernel would read those experts.  This is the last step before SGLang's
expert-distribution recorder, so rewriting here keeps the recorder consistent.
How: in place, set leftover picks and padding rows to -1 with weight 0 and add the activated experts
to the layer's metrics (torch ops, ``policies.rewrite``); mirror the drops into the recorder's id
tensor when it is a separate tensor (its routed columns come first in every layout SGLang uses, and
may hold other ids than ``topk_ids``, e.g. before a shared-slot renumbering, so only the dropped
slots are copied).
Remove when: SGLang's router accepts a keep mask and drops pruned experts itself.
"""

from __future__ import annotations

from ..runtime import get_runtime

TARGET = "sglang.srt.layers.moe.topk._post_process_topk_ids"
KIND = "after"


def hook(result, *args, **kwargs):
    runtime = get_runtime()
    call = runtime.call if runtime is not None else None
    if call is None or not call.masked:
        return None
    topk_ids, topk_weights, recorder_ids = result
    runtime.rewrite(call, topk_ids, topk_weights)
    if recorder_ids is not None and recorder_ids.data_ptr() != topk_ids.data_ptr():
        width = recorder_ids.shape[1]
        dropped = topk_ids[:, :width] < 0
        if call.layer.fill_dropped:  # dropped slots hold a weight-0 filler expert instead of -1
            dropped |= topk_weights[:, :width] == 0
        recorder_ids.masked_fill_(dropped, -1)
    return None
