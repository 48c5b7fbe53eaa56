"""``lynx``: logit binning, batch-wide scoring and remapping (LYNX section 3 and App. A).

For each voting token t and expert e (n = number of real tokens, voting or not)::

    b[t, e] = max(-beta, ceil(alpha * (l[t, e] - max_e l[t, e])))      in {-beta, ..., 0}
    s[e]    = sum_t n ** b[t, e]

Each valid token then picks its ``top_k`` candidate experts ordered by (bin desc, s desc, own logit
desc, index asc); the keep mask is the union of the picks.  A token whose top-1 is alone in bin 0
keeps it; near-ties within a bin go to experts the rest of the batch favours.

Exactness: bins are computed in float32 (``(l - max) * alpha``, two rounded steps, then ``ceil``).  ``s`` is compared
exactly, without floating point: ``s[e] * n**beta`` is an integer whose base-n digits follow from the
per-bin counts of tokens, so experts are ranked by their digit strings.
"""

from __future__ import annotations

import torch

from ._batch import LayerBatch, Selection
from .scores import descending_order, float32_value, positions_in_order


def lynx_bins(logits: torch.Tensor, alpha: float, beta: int) -> torch.Tensor:
    """LYNX bins of every (token, expert) pair.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32, sanitized
    alpha : float
    beta : int

    Returns
    -------
    Tensor, shape [T, E], int64, values in ``[-beta, 0]``.  ``-inf`` logits (and rows with no
    finite logit) fall in bin ``-beta``.
    """
    narrow = logits.to(torch.float32)
    top = narrow.amax(dim=-1, keepdim=True)
    gap = narrow - torch.where(top > float("-inf"), top, 0.0)
    bins = torch.ceil(gap * float32_value(alpha))
    bins = torch.where(torch.isnan(bins), float(-beta), bins)
    return bins.clamp(min=-beta).to(torch.int64)


def batch_score_rank(
    bins: torch.Tensor, valid: torch.Tensor, beta: int, num_real: torch.Tensor | None = None
) -> torch.Tensor:
    """Rank experts by ``s[e] = sum over valid t of n ** bins[t, e]``, exactly.

    Parameters
    ----------
    bins : Tensor, shape [T, E], int64 in ``[-beta, 0]``
    valid : Tensor, shape [T], bool
        Tokens that vote.
    beta : int
    num_real : 0-d Tensor, optional
        The base n: the batch's real tokens (voting or not); default: the voting tokens.

    Returns
    -------
    Tensor, shape [E], int64.  Higher value = higher ``s``; equal ``s`` gives equal values.
    """
    num_experts = bins.shape[1]
    device = bins.device
    width = beta + 1
    # counts[e, j] = number of valid tokens with bins[t, e] == -j.
    slot = torch.arange(num_experts, device=device) * width - bins
    counts = torch.zeros(num_experts * width, dtype=torch.int64, device=device)
    counts.scatter_add_(0, slot.reshape(-1), valid[:, None].expand_as(bins).reshape(-1).to(torch.int64))
    counts = counts.view(num_experts, width)
    # s * n**beta = sum_j counts[:, j] * n**(beta - j): carry it into base-n digits, lowest first.
    base = (valid.sum() if num_real is None else num_real).clamp(min=1)
    digits = []
    carry = torch.zeros(num_experts, dtype=torch.int64, device=device)
    for j in range(beta, -1, -1):
        value = counts[:, j] + carry
        digits.append(value % base)
        carry = value // base
    digits.append(carry)
    # Lexicographic order, most significant digit decisive: stable sorts from the least significant.
    order = torch.arange(num_experts, device=device)
    for digit in digits:
        order = order[descending_order(digit[order])]
    ordered = torch.stack([d[order] for d in digits], dim=1)
    new_value = torch.zeros(num_experts, dtype=torch.int64, device=device)
    new_value[1:] = (ordered[1:] != ordered[:-1]).any(dim=1).to(torch.int64)
    rank_from_top = torch.cumsum(new_value, dim=0)
    return torch.empty_like(order).scatter_(0, order, (num_experts - 1) - rank_from_top)


def select_lynx(batch: LayerBatch) -> Selection:
    """``lynx`` keep mask: the union of every valid token's remapped top-k."""
    cfg = batch.cfg
    logits = batch.logits
    num_experts = batch.num_experts
    bins = lynx_bins(logits, cfg.alpha, cfg.beta)
    s_rank = batch_score_rank(bins, batch.valid, cfg.beta, batch.num_valid)
    logit_place = positions_in_order(descending_order(logits))
    key = ((bins + cfg.beta) * num_experts + s_rank[None, :]) * num_experts + (num_experts - 1 - logit_place)
    key = torch.where(logits > float("-inf"), key, -1)
    k = min(batch.call.top_k, num_experts)
    picked = descending_order(key)[:, :k]
    pick_mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, picked, True) & (key >= 0)
    keep = (pick_mask & batch.valid[:, None]).any(dim=0)
    return Selection(keep, torch.zeros_like(keep))
