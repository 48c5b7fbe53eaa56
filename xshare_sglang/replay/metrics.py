"""What one layer call costs and keeps under a policy.

* activated experts: distinct experts the routed tokens use (what the MoE kernel must read);
* kept experts: size of the keep mask;
* retained gating mass: share of the tokens' natural top-k router weight that falls on kept experts;
* top-1 kept: share of tokens whose natural top-1 expert is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PrunerConfig
from ..policies import route_within, select_experts_mask


@dataclass(frozen=True)
class CallMetrics:
    activated: int
    kept: int
    retained_mass: float
    top1_kept: float


def evaluate_call(
    logits: torch.Tensor,
    natural_ids: torch.Tensor,
    natural_weights: torch.Tensor,
    cfg: PrunerConfig,
    *,
    top_k: int,
    tokens_per_request: int,
    expert_to_rank: torch.Tensor | None = None,
    layer_id: int | None = None,
    scoring: str = "softmax",
    token_weights: torch.Tensor | None = None,
) -> CallMetrics:
    """Run one policy on one layer call, exactly as the server would, and measure it.

    Parameters
    ----------
    logits : Tensor, shape [T, E]
    natural_ids : Tensor, shape [T, k], int64
        The unpruned top-k experts of each token (``-1`` = none).
    natural_weights : Tensor, shape [T, k]
        Their router weights.
    cfg, top_k, tokens_per_request, expert_to_rank, layer_id, scoring, token_weights
        As in :func:`~xshare_sglang.select_experts_mask`.  Rows with weight 0 (never accepted) are
        routed nowhere, as the server drops them, and leave the retained-mass and top-1 figures.
    """
    keep = select_experts_mask(
        logits,
        cfg,
        top_k=top_k,
        tokens_per_request=tokens_per_request,
        expert_to_rank=expert_to_rank,
        scoring=scoring,
        layer_id=layer_id,
        token_weights=token_weights,
    )
    ids, _ = route_within(logits, keep, top_k=top_k, coverage=cfg.coverage, scoring=scoring)
    if token_weights is not None:
        voting = token_weights > 0
        ids, natural_ids, natural_weights = ids[voting], natural_ids[voting], natural_weights[voting]
    used = torch.zeros_like(keep)
    used[ids[ids >= 0].long()] = True
    listed = natural_ids >= 0
    natural_kept = keep[natural_ids.clamp(min=0)] & listed
    total_mass = natural_weights[listed].sum()
    retained = natural_weights[natural_kept].sum() / total_mass if total_mass > 0 else torch.tensor(1.0)
    strongest = natural_weights.masked_fill(~listed, -1.0).argmax(dim=1, keepdim=True)
    top1_kept = natural_kept.gather(1, strongest)
    top1 = top1_kept.float().mean() if len(natural_ids) else torch.tensor(1.0)
    return CallMetrics(int(used.sum()), int(keep.sum()), float(retained), float(top1))
