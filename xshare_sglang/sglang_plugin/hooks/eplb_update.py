"""AFTER ``sglang.srt.eplb.expert_location.ExpertLocationMetadata.update`` (checked:
expert_location.py:312, called by ``ExpertLocationUpdater.update`` at expert_location_updater.py:72
after each chunk of an EPLB rebalance, in every rank's scheduler process; 0.5.23).

Why: ``xshare-ep`` balances kept experts over the expert-parallel ranks with a per-layer table of
which rank holds each expert.  An EPLB rebalance moves experts between ranks; a table read once at
start-up would balance over a placement that no longer exists.
How: when SGLang has updated its global placement in place, recompute the owner table of each
updated layer from the new physical-to-logical map and copy it into the plugin's existing tensor
(same memory: the captured CUDA graphs read it on their next replay).  The update runs eagerly at
the end of a forward, on the forward's stream, never during a capture.
Remove when: SGLang publishes expert owners per rank, or the pruner reads SGLang's own tables.
"""

from __future__ import annotations

from ..model_layers import expert_owner_of
from ..runtime import get_runtime

TARGET = "sglang.srt.eplb.expert_location.ExpertLocationMetadata.update"
KIND = "after"


def hook(result, self, *args, **kwargs):
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    runtime = get_runtime()
    if runtime is None or self is not get_global_expert_location_metadata():
        return None
    update_layer_ids = kwargs.get("update_layer_ids", args[1] if len(args) > 1 else None)
    updated = None if update_layer_ids is None else {int(layer_id) for layer_id in update_layer_ids}
    for state in runtime.layers.values():
        if state.expert_to_rank is None or (updated is not None and state.layer_id not in updated):
            continue
        try:
            state.expert_to_rank.copy_(expert_owner_of(state.layer_id, self))
        except Exception as exc:  # the layer keeps its previous owners; counted and logged
            runtime.record_fault(f"refreshing the expert owners of layer {state.layer_id}", exc)
    return None
