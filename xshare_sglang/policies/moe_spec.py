"""``moe-spec``: keep the top-B experts by aggregate router score, or by calibration counts.

Source: MoE-Spec section 3.2 (router-based ranking, eq. 5; static ranking, eq. 4) and App. B.
B is ``max_experts``.  The mask always has ``min(B, E)`` experts when the batch has a real token
(experts with zero aggregate fill the budget in index order), and is empty when it has none.
"""

from __future__ import annotations

import torch

from ._batch import LayerBatch, Selection
from .scores import descending_order, positions_in_order


def _top(values: torch.Tensor, count: int) -> torch.Tensor:
    return positions_in_order(descending_order(values)) < count


def select_moe_spec(batch: LayerBatch) -> Selection:
    """``moe-spec`` with ``ranking`` = ``router`` (batch aggregate) or ``static`` (file counts)."""
    cfg = batch.cfg
    if cfg.ranking == "static":
        ranking = cfg.static_ranking
        layer = batch.layer_id
        if layer is None:
            if ranking.num_layers != 1:
                raise ValueError(
                    f"moe-spec with ranking='static' needs layer_id: the ranking file has {ranking.num_layers} layers"
                )
            layer = 0
        if not 0 <= layer < ranking.num_layers:
            raise ValueError(f"layer_id={layer} is outside the static ranking file's {ranking.num_layers} layers")
        values = ranking.layer_counts(layer, batch.logits.device)
    else:
        values = batch.batch_aggregate
    keep = _top(values, cfg.max_experts) & (batch.num_valid > 0)
    return Selection(keep, torch.zeros_like(keep))
