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

The serving plugin runs these torch functions on every device (the masked path is the one for
routers the fused kernels do not reproduce).
"""

from __future__ import annotations

import torch

from .scores import SCORE_ONE, sanitize_token_weights, valid_token_mask

#: Columns of a metrics row (int64): sums over layer calls, and the number of calls.  The retained
#: score mass is summed in units of 2**-24 (one call adds at most 2**24).
METRIC_COLUMNS = ("activated_experts", "kept_experts", "retained_score_mass", "calls")
RETAINED_ONE = SCORE_ONE


def activated_experts(topk_ids: torch.Tensor, num_ids: int) -> torch.Tensor:
    """The distinct ids in ``[0, num_ids)`` of ``topk_ids`` (any shape): the experts the routing sends
    a token to, weight-0 fillers included (the backend reads them).  An int64 scalar tensor."""
    ids = topk_ids.long()
    live = (ids >= 0) & (ids < num_ids)
    used = torch.zeros(num_ids + 1, dtype=torch.int64, device=ids.device)
    used.scatter_(0, torch.where(live, ids, num_ids).reshape(-1), 1)
    return used[:num_ids].sum()


def request_experts(topk_ids: torch.Tensor, tokens_per_request: int, num_ids: int) -> torch.Tensor:
    """Distinct experts per request of a speculative verify call: request i's rows
    ``[i*D, (i+1)*D)`` of ``topk_ids`` [T, k] together route to ``n_i`` distinct ids in
    ``[0, num_ids)``; returns int64 ``[sum of n_i, requests with n_i > 0]`` (padded requests and rows
    beyond the last whole request route nowhere and are not counted)."""
    ids = topk_ids.long()
    num_requests = ids.shape[0] // tokens_per_request
    ids = ids[: num_requests * tokens_per_request].reshape(num_requests, tokens_per_request * ids.shape[1])
    live = (ids >= 0) & (ids < num_ids)
    used = torch.zeros(num_requests, num_ids + 1, dtype=torch.int64, device=ids.device)
    used.scatter_(1, torch.where(live, ids, num_ids), 1)
    distinct = used[:, :num_ids].sum(dim=1)
    return torch.stack([distinct.sum(), (distinct > 0).sum()])


def selection_metrics(keep: torch.Tensor, kept_total: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``[0, kept experts, retained score mass * 2**24, 1]`` of one call, int64 [4]: the columns the
    selection alone determines (the activated experts are the routing's).

    The retained mass is the kept share of the batch's aggregate score,
    ``floor(float32(kept_total) / float32(total) * 2**24)``, and a full 2**24 when the total is 0.
    """
    ratio = kept_total.to(torch.float32) / torch.where(total > 0, total, 1).to(torch.float32)
    retained = torch.where(total > 0, torch.floor(ratio * float(SCORE_ONE)).to(torch.int64), SCORE_ONE)
    zero = torch.zeros((), dtype=torch.int64, device=keep.device)
    return torch.stack([zero, keep.sum().to(torch.int64), retained, zero + 1])


def call_metrics(
    topk_ids: torch.Tensor, num_ids: int, keep: torch.Tensor, kept_total: torch.Tensor, total: torch.Tensor
) -> torch.Tensor:
    """``[activated experts, kept experts, retained score mass * 2**24, 1]`` of one call, int64 [4]:
    :func:`activated_experts` of the routed ids, then :func:`selection_metrics`."""
    metrics = selection_metrics(keep, kept_total, total)
    metrics[0] = activated_experts(topk_ids, num_ids)
    return metrics


def add_metrics(metrics_row: torch.Tensor, metrics: torch.Tensor, metrics_gate: torch.Tensor | None = None) -> None:
    """``metrics_row += metrics``, or, with a gate, only where the gate is nonzero (on the device: no
    host sync, so a CUDA graph can replay it with the gate refilled).

    Parameters
    ----------
    metrics_row : Tensor, shape [4] (or any shape ``metrics`` broadcasts to), int64
    metrics : Tensor, int64
        One call's metrics, :func:`call_metrics` or :func:`selection_metrics`.
    metrics_gate : Tensor, shape [1], int32, optional
        Nonzero: the call adds its metrics; 0: it adds nothing.  None: always.
    """
    if metrics_gate is not None:
        metrics = metrics * (metrics_gate != 0).to(metrics.dtype)
    metrics_row.add_(metrics)


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
    metrics_row : Tensor, shape [4], int64, optional
        Receives ``+=`` :func:`call_metrics` of the rewritten ids (activated counts the distinct
        routed experts they still send a token to; with ``fill_dropped``, the fillers too).
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
    if metrics_row is None:
        return
    zero = torch.zeros((), dtype=torch.int64, device=topk_ids.device)
    kept_total, total = (zero, zero) if stats is None else (stats[0], stats[1])
    metrics_row.add_(call_metrics(topk_ids, num_ids, keep, kept_total, total))
