"""``moe-spec``: keep the top-B experts by aggregate router score, or by calibration counts.

Source: MoE-Spec section 3.2 (router-based ranking, eq. 5; static ranking, eq. 4) and App. B.
B is ``max_experts``.  The mask always has ``min(B, E)`` experts when the batch has a real token
(experts with zero aggregate fill the budget in index order), and is empty when it has none.

``scope="request"`` (for speculative verify batches; MoE-Spec budgets a single draft tree): every
request (D consecutive rows) with a voting token gets its own top-B by its own aggregate, and the
union is kept.
"""

from __future__ import annotations

import torch

from ..config import PrunerConfig
from ._batch import LayerBatch, Selection
from .scores import descending_order, per_request_sums, positions_in_order


def _top(values: torch.Tensor, count: int) -> torch.Tensor:
    return positions_in_order(descending_order(values)) < count


def static_positions(cfg: PrunerConfig, layer_id: int | None, device: torch.device) -> torch.Tensor:
    """Place of each expert in one layer's calibration ranking, int32 [E] on ``device`` (cached).

    ``layer_id`` may be omitted only when the ranking file has a single layer.
    """
    ranking = cfg.static_ranking
    layer = layer_id
    if layer is None:
        if ranking.num_layers != 1:
            raise ValueError(
                f"moe-spec with ranking='static' needs layer_id: the ranking file has {ranking.num_layers} layers"
            )
        layer = 0
    if not 0 <= layer < ranking.num_layers:
        raise ValueError(f"layer_id={layer} is outside the static ranking file's {ranking.num_layers} layers")
    return ranking.layer_positions(layer, device)


def select_moe_spec(batch: LayerBatch) -> Selection:
    """``moe-spec`` with ``ranking`` = ``router`` (batch aggregate) or ``static`` (file counts)."""
    cfg = batch.cfg
    if cfg.ranking == "static":
        keep = (static_positions(cfg, batch.layer_id, batch.logits.device) < cfg.max_experts) & (batch.num_valid > 0)
        return Selection(keep, torch.zeros_like(keep))
    if cfg.scope == "request":
        agg_per_request = per_request_sums(batch.valid_scores, batch.tokens_per_request)
        votes = per_request_sums(batch.valid.to(torch.int64)[:, None], batch.tokens_per_request)[:, 0] > 0
        keep = (_top(agg_per_request, cfg.max_experts) & votes[:, None]).any(dim=0)
        return Selection(keep, torch.zeros_like(keep))
    keep = _top(batch.batch_aggregate, cfg.max_experts) & (batch.num_valid > 0)
    return Selection(keep, torch.zeros_like(keep))
