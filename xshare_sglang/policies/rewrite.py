"""After SGLang routed inside the mask: drop leftover picks and padded rows, and count what was used.

Masking logits and bias makes SGLang's router choose kept experts first, but a token with fewer
than k kept candidates (or grouped routing that reaches a group without kept experts) still fills
its slots with pruned experts at weight ~0.  Those picks, and every slot of a CUDA-graph padding row,
become ``-1`` with weight 0: the fused MoE kernel then never reads those experts' weights.  So do the rows
of draft nodes that can never be accepted (vote weight 0).

Some MoE backends cannot take a ``-1`` slot (SGLang's CPU expert loop indexes with it).  For those,
``fill_dropped=True`` gives every dropped slot a valid expert with weight 0 instead, chosen so that the
batch reads as few extra experts as possible: the row's dropped slots take, in order, the kept experts
the row does not use yet (ascending id), then pruned experts (ascending id).  No id repeats within a
row, so a backend that counts tokens per expert sees each slot once.  A slot of weight 0 adds exactly
nothing to the token's output, so routing is the same as with ``-1``; only the cost differs.

This is the reference (and CPU path) of ``xshare_sglang.kernels.rewrite_routing``.
"""

from __future__ import annotations

import torch

from .scores import sanitize_token_weights, valid_token_mask

#: Columns of a metrics row: sums over layer calls, and the number of calls.
METRIC_COLUMNS = ("activated_experts", "kept_experts", "retained_score_mass", "calls")


def filler_ids(topk_ids: torch.Tensor, keep_ids: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Valid expert ids for the dropped slots of each row, none already in the row.

    Parameters
    ----------
    topk_ids : Tensor [T, K], integer
        Ids after the drop (``-1`` at dropped slots).
    keep_ids : Tensor [P], bool
        Whether each id is a kept expert.
    drop : Tensor [T, K], bool
        The dropped slots.

    Returns
    -------
    Tensor [T, K], same dtype as ``topk_ids``
        At dropped slots, the row's j-th free id in the order (kept ascending, then pruned ascending),
        j counting the row's dropped slots from the left; elsewhere 0.
    """
    num_ids = keep_ids.numel()
    ids = topk_ids.long()
    present = torch.zeros(ids.shape[0], num_ids + 1, dtype=torch.bool, device=ids.device)
    present.scatter_(1, torch.where((ids >= 0) & (ids < num_ids), ids, num_ids), True)
    free = ~present[:, :num_ids]
    kept_free = free & keep_ids
    rank = torch.where(
        keep_ids,
        kept_free.cumsum(1),
        kept_free.sum(1, keepdim=True) + (free & ~keep_ids).cumsum(1),
    )
    wanted = drop.long().cumsum(1)
    match = (rank[:, None, :] == wanted[:, :, None]) & free[:, None, :]
    expert = torch.arange(num_ids, device=ids.device)
    return ((match.long() * expert).sum(-1) * drop).to(topk_ids.dtype)


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
    fill_dropped: bool = False,
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
        the distinct routed experts the rewritten ids still send a token to (with ``fill_dropped``,
        the fillers too: the backend reads them).
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
    if fill_dropped:
        topk_ids.copy_(torch.where(drop, filler_ids(topk_ids, keep_ids, drop), topk_ids))
        ids = topk_ids.long()
    if metrics_row is None:
        return
    live = routed & ~drop if not fill_dropped else (ids >= 0) & (ids < num_ids)
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
