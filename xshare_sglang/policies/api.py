"""``select_experts_mask``: the keep mask of any policy, with the common controls applied.

This is the pure-torch reference of every policy: the specification in code, the CPU path, and
the fallback on GPU.  It never synchronises with the host: budgets and switches are Python values
from the config, and the real-token count may stay on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import POLICIES, PrunerConfig
from ._batch import LayerBatch, Selection
from .call import RoutingCall
from .lynx import select_lynx
from .moe_spec import select_moe_spec
from .scores import descending_order, positions_in_order, sanitize_logits, sanitize_token_weights, valid_token_mask
from .xshare import (
    select_oea,
    select_xshare,
    select_xshare_ep,
    select_xshare_spec,
    select_xshare_threshold,
)

_WARM_FIRST = 1 << 62  # above any aggregate of fewer than 2**38 tokens

POLICY_FUNCTIONS: dict[str, Callable[[LayerBatch], Selection]] = {
    "oea": select_oea,
    "xshare": select_xshare,
    "xshare-threshold": select_xshare_threshold,
    "xshare-spec": select_xshare_spec,
    "xshare-ep": select_xshare_ep,
    "moe-spec": select_moe_spec,
    "lynx": select_lynx,
}
assert set(POLICY_FUNCTIONS) == set(POLICIES) - {"none"}


def cap_experts(selection: Selection, agg: torch.Tensor, max_experts: int) -> torch.Tensor:
    """Keep at most ``max_experts`` of the selection: warm-up experts first, then by aggregate.

    Parameters
    ----------
    selection : Selection
    agg : Tensor, shape [E], int64
    max_experts : int

    Returns
    -------
    Tensor, shape [E], bool
    """
    key = torch.where(selection.keep, selection.warm.to(torch.int64) * _WARM_FIRST + agg, -1)
    return selection.keep & (positions_in_order(descending_order(key)) < max_experts)


def select_experts_mask(
    logits: torch.Tensor,
    cfg: PrunerConfig,
    *,
    top_k: int,
    tokens_per_request: int = 1,
    num_valid_tokens: int | torch.Tensor | None = None,
    expert_to_rank: torch.Tensor | None = None,
    scoring: str = "softmax",
    layer_id: int | None = None,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts one MoE layer call keeps.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32 / bfloat16 / float16
        Router logits of the layer call (rows at or after ``num_valid_tokens`` are padding).
    cfg : PrunerConfig
    top_k : int
        The model's routed experts per token.
    tokens_per_request : int
        D, for ``xshare-spec``: request r owns rows ``[r*D, (r+1)*D)``.
    num_valid_tokens : int or one-element Tensor, optional
        Real tokens (the first rows).  ``None``: all T.  A device tensor is read on the device.
    expert_to_rank : Tensor, shape [E], integer, optional
        Rank that holds each expert (ids ``0..G-1``); required by ``xshare-ep``.
    scoring : {"softmax", "sigmoid"}
        The model's scoring function.
    layer_id : int, optional
        Layer index, needed by ``moe-spec`` with a calibration file of several layers (other
        policies ignore it).
    token_weights : Tensor, shape [T], float, optional
        Vote weight of each row, in [0, 1] (values above 1 count as 1; NaN and values <= 0 as 0).
        A real row with weight 0 does not vote: no warm-up, no score, no LYNX pick.  Other rows'
        scores are multiplied by their weight before they are summed (speculative verify: depth
        decay).  The batch size n (token range, empty batch, LYNX base) still counts every real
        row.

    Returns
    -------
    Tensor, shape [E], bool, on ``logits.device``.
        ``none``: all True.  Any other policy with no valid token: all False.  Outside
        ``[min_tokens, max_tokens]`` real tokens: all True (the layer call is not pruned).

    Raises
    ------
    ValueError
        Bad shapes or arguments, ``k0 > top_k``, a missing ``expert_to_rank`` for ``xshare-ep``, or a
        static ranking that does not match E.
    """
    call = RoutingCall.of(
        logits,
        top_k=top_k,
        scoring=scoring,
        tokens_per_request=tokens_per_request,
        num_valid_tokens=num_valid_tokens,
        expert_to_rank=expert_to_rank,
        layer_id=layer_id,
        token_weights=token_weights,
    )
    return select(call, cfg)[0]


def select(call: RoutingCall, cfg: PrunerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The keep mask of one layer call and the batch aggregate the policy ranked by.

    Parameters
    ----------
    call : RoutingCall
    cfg : PrunerConfig

    Returns
    -------
    keep : Tensor, shape [E], bool
    aggregate : Tensor, shape [E], int64
        Fixed-point aggregate of the policy's score over the real tokens (all zero for ``none``);
        ``aggregate[keep].sum() / aggregate.sum()`` is the share of the batch's score mass kept.
    """
    call.check_config(cfg)
    num_tokens, num_experts = call.logits.shape
    device = call.device
    if cfg.policy == "none":
        every = torch.ones(num_experts, dtype=torch.bool, device=device)
        return every, torch.zeros(num_experts, dtype=torch.int64, device=device)
    real = valid_token_mask(num_tokens, call.num_valid_tokens, device)
    weights = None if call.token_weights is None else sanitize_token_weights(call.token_weights)
    batch = LayerBatch(
        call=call,
        cfg=cfg,
        logits=sanitize_logits(call.logits),
        valid=real if weights is None else real & (weights > 0),
        real=real,
        token_weights=weights,
    )
    selection = POLICY_FUNCTIONS[cfg.policy](batch)
    keep = selection.keep
    if cfg.max_experts is not None and cfg.policy != "moe-spec":
        keep = cap_experts(selection, batch.batch_aggregate, cfg.max_experts)
    if cfg.min_tokens is not None or cfg.max_tokens is not None:
        in_range = torch.ones((), dtype=torch.bool, device=device)
        if cfg.min_tokens is not None:
            in_range = in_range & (batch.num_valid >= cfg.min_tokens)
        if cfg.max_tokens is not None:
            in_range = in_range & (batch.num_valid <= cfg.max_tokens)
        keep = torch.where(in_range, keep, True)
    return keep, batch.batch_aggregate
