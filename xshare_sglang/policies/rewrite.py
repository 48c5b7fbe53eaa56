"""After SGLang routed inside the mask: drop leftover picks and padded rows, and count what was used.

Masking logits and bias makes SGLang's router choose kept experts first, but a token with fewer
than k kept candidates (or grouped routing that reaches a group without kept experts) still fills
its slots with pruned experts at weight ~0.  Those picks, and every slot of a CUDA-graph padding row,
become ``-1`` with weight 0: the fused MoE kernel then never reads those experts' weights.  So do the rows
of draft nodes that can never be accepted (vote weight 0).

This is the reference (and CPU path) of ``xshare_sglang.kernels.rewrite_routing``.
"""

from __future__ import annotations

import torch

from .scores import sanitize_token_weights, valid_token_mask

#: Columns of a metrics row: sums over layer calls, and the number of calls.
METRIC_COLUMNS = ("activated_experts", "kept_experts", "retained_score_mass", "calls")


def rewrite_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    keep: torch.Tensor,
    *,
    num_valid_tokens: int | torch.Tensor | None = None,
    physical_to_logical: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> None:
    """Rewrite routing in place and optionally accumulate one layer call's metrics.

    Parameters
    ----------
    topk_ids : Tensor, shape [T, K], integer
        Expert per slot (physical ids when ``physical_to_logical`` is given).  Ids outside
        ``[0, P)`` (``-1``, fused shared-expert columns) are not routed experts and are left alone,
        except on padding rows.
    topk_weights : Tensor, shape [T, K], float
    keep : Tensor, shape [E], bool
        Kept logical experts.
    num_valid_tokens : int or one-element Tensor, optional
        Rows at or after it are padding: every slot becomes ``-1``, weight 0.
    physical_to_logical : Tensor, shape [P], integer, optional
        Logical expert of each physical expert (EPLB / redundant experts); identity when None.
    metrics_row : Tensor, shape [4], float64, optional
        Receives ``+= [activated experts, kept experts, retained score mass, 1]``; activated counts
        the distinct routed experts left in real rows after the rewrite.
    stats : Tensor, shape [2], int64, optional
        ``(kept aggregate, total aggregate)`` from the selection; retained mass is their ratio
        (1 when the total is 0).
    token_weights : Tensor, shape [T], float, optional
        The selection's vote weights: a row whose weight is NaN or <= 0 (a draft node that can
        never be accepted) is dropped like a padding row.
    """
    keep_ids = keep if physical_to_logical is None else keep[physical_to_logical.long()]
    num_ids = keep_ids.numel()
    ids = topk_ids.long()
    routed = (ids >= 0) & (ids < num_ids)
    kept_slot = keep_ids[ids.clamp(0, num_ids - 1)]
    valid = valid_token_mask(topk_ids.shape[0], num_valid_tokens, topk_ids.device)
    if token_weights is not None:
        valid = valid & (sanitize_token_weights(token_weights) > 0)
    valid = valid[:, None]
    drop = (routed & ~kept_slot) | ~valid
    topk_ids.masked_fill_(drop, -1)
    topk_weights.masked_fill_(drop, 0)
    if metrics_row is None:
        return
    live = routed & ~drop
    used = torch.zeros(num_ids + 1, dtype=torch.int32, device=topk_ids.device)
    used.scatter_(0, torch.where(live, ids, num_ids).reshape(-1), 1)
    if stats is None:
        retained = torch.ones((), dtype=torch.float64, device=topk_ids.device)
    else:
        total = stats[1].to(torch.float64)
        retained = torch.where(total > 0, stats[0].to(torch.float64) / torch.where(total > 0, total, 1.0), 1.0)
    update = torch.stack(
        [
            used[:num_ids].sum().to(torch.float64),
            keep.sum().to(torch.float64),
            retained,
            torch.ones((), dtype=torch.float64, device=topk_ids.device),
        ]
    )
    metrics_row.add_(update)
