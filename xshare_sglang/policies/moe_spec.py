"""``moe-spec``: keep the top-B experts by aggregate router score, or by calibration counts.

Source: MoE-Spec section 3.2 (router-based ranking, eq. 5; static ranking, eq. 4) and App. B.
B is ``max_experts``.  The mask always has ``min(B, E)`` experts when the batch has a real token
(experts with zero aggregate fill the budget in index order), and is empty when it has none.

``scope="request"`` (for speculative verify batches; MoE-Spec budgets a single draft tree): every
request (D consecutive rows) with a voting token gets its own top-B by its own aggregate, and the
union is kept.

Two extensions beyond the paper (its section 6 names both as future work), each read from the
calibration file that ``xshare-sglang calibrate`` writes:

* ``budget_allocation="calibrated"``: B differs per layer (:meth:`PrunerConfig.layer_budget`), the
  budgets averaging ``max_experts`` and placed where calibration batches needed them most;
* ``ranking="coactivation"``: greedy on the batch aggregate, each candidate discounted by how often
  calibration tokens picked it together with an expert already kept (:func:`coactivation_add`).

and one that needs no calibration: ``ranking="coverage"`` is greedy on the batch's own per-token
scores, a candidate's score from each token weighted by how much of that token's routing mass the
experts kept so far leave uncovered (:func:`coverage_add`).
"""

from __future__ import annotations

import torch

from ..config import PrunerConfig
from ._batch import LayerBatch, Selection
from .greedy import coactivation_add, coverage_add
from .scores import descending_order, per_request_sums, positions_in_order


def _top(values: torch.Tensor, count: int) -> torch.Tensor:
    return positions_in_order(descending_order(values)) < count


def _file_layer(cfg: PrunerConfig, layer_id: int | None) -> int:
    ranking = cfg.static_ranking
    if layer_id is None:
        if ranking.num_layers != 1:
            raise ValueError(
                f"moe-spec with ranking={cfg.ranking!r} needs layer_id: "
                f"the ranking file has {ranking.num_layers} layers"
            )
        return 0
    if not 0 <= layer_id < ranking.num_layers:
        raise ValueError(f"layer_id={layer_id} is outside the static ranking file's {ranking.num_layers} layers")
    return layer_id


def static_positions(cfg: PrunerConfig, layer_id: int | None, device: torch.device) -> torch.Tensor:
    """Place of each expert in one layer's calibration ranking, int32 [E] on ``device`` (cached).

    ``layer_id`` may be omitted only when the ranking file has a single layer.
    """
    return cfg.static_ranking.layer_positions(_file_layer(cfg, layer_id), device)


def layer_redundancy(cfg: PrunerConfig, layer_id: int | None, device: torch.device) -> torch.Tensor:
    """Fixed-point pair redundancy of one layer, int32 [E, E] on ``device`` (cached)."""
    return cfg.static_ranking.layer_redundancy(_file_layer(cfg, layer_id), device)


def select_moe_spec(batch: LayerBatch) -> Selection:
    """``moe-spec`` with ``ranking`` = ``router`` (batch aggregate), ``static`` (file counts),
    ``coverage`` (greedy on uncovered per-token mass) or ``coactivation`` (greedy on the aggregate
    with co-activation discounts); B from
    :meth:`PrunerConfig.layer_budget`."""
    cfg = batch.cfg
    budget = cfg.layer_budget(batch.call.layer_id)
    if cfg.ranking == "static":
        keep = (static_positions(cfg, batch.call.layer_id, batch.logits.device) < budget) & (batch.num_valid > 0)
        return Selection(keep, torch.zeros_like(keep))
    if cfg.ranking == "coverage":
        keep = coverage_add(batch.valid_scores, batch.batch_aggregate, budget, batch.num_valid > 0)
        return Selection(keep, torch.zeros_like(keep))
    if cfg.ranking == "coactivation":
        redundancy = layer_redundancy(cfg, batch.call.layer_id, batch.logits.device)
        keep = coactivation_add(batch.batch_aggregate, redundancy, budget, batch.num_valid > 0)
        return Selection(keep, torch.zeros_like(keep))
    if cfg.scope == "request":
        agg_per_request = per_request_sums(batch.valid_scores, batch.call.tokens_per_request)
        votes = per_request_sums(batch.valid.to(torch.int64)[:, None], batch.call.tokens_per_request)[:, 0] > 0
        keep = (_top(agg_per_request, budget) & votes[:, None]).any(dim=0)
        return Selection(keep, torch.zeros_like(keep))
    keep = _top(batch.batch_aggregate, budget) & (batch.num_valid > 0)
    return Selection(keep, torch.zeros_like(keep))
