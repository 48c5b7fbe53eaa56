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
from ..policies import route_within
from ..policies.api import select
from ..policies.call import RoutingCall


@dataclass(frozen=True)
class CallMetrics:
    activated: int
    kept: int
    retained_mass: float
    top1_kept: float


def evaluate_call(
    call: RoutingCall, natural_ids: torch.Tensor, natural_weights: torch.Tensor, cfg: PrunerConfig
) -> CallMetrics:
    """Run one policy on one layer call, exactly as the server would, and measure it.

    Parameters
    ----------
    call : RoutingCall
        The layer call (logits [T, E], top-k, scoring, D, ranks, layer, vote weights).  Rows with
        vote weight 0 (never accepted) are routed nowhere, as the server drops them, and leave the
        retained-mass and top-1 figures.
    natural_ids : Tensor, shape [T, k], int64
        The unpruned top-k experts of each token (``-1`` = none).
    natural_weights : Tensor, shape [T, k]
        Their router weights.
    cfg : PrunerConfig
    """
    keep, _ = select(call, cfg)
    ids, _ = route_within(call.logits, keep, top_k=call.top_k, coverage=cfg.coverage, scoring=call.scoring)
    token_weights = call.token_weights
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
