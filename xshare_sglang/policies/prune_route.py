"""``prune_route``: the keep mask and the pruned routing of one MoE layer call, as the server runs it.

The pure-torch reference (and CPU path) of :func:`xshare_sglang.kernels.prune_route`, which does the
same work in one or two Triton launches and replaces SGLang's own top-k for a pruned layer:

1. the policy chooses the experts the batch keeps (:func:`select_experts_mask`);
2. every real, voting row is routed inside them (:func:`route_logits`, the model's own router:
   softmax or sigmoid, correction bias, groups, renormalization, output scaling, coverage);
3. padding rows and rows of vote weight 0 route nowhere (every slot ``-1``, weight 0); for MoE
   backends that cannot take ``-1``, ``fill_dropped`` gives each empty slot a valid expert of
   weight 0 instead (see :func:`~xshare_sglang.policies.rewrite.filler_ids`);
4. with ``metrics_row``, the call's metrics are added to it (:data:`METRIC_COLUMNS`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import PrunerConfig
from .api import _select, validate_selection_args
from .rewrite import METRIC_COLUMNS, call_metrics, filler_ids
from .routing import RouterSpec, route_logits
from .scores import sanitize_logits, sanitize_token_weights, valid_token_mask

__all__ = ["METRIC_COLUMNS", "PrunedRouting", "check_outputs", "check_prune_route_args", "prune_route"]


class PrunedRouting(NamedTuple):
    """What one pruned layer call produces.

    Attributes
    ----------
    topk_ids : Tensor, shape [T, top_k], int32
        Routed expert of every slot; ``-1`` for an empty slot (or a weight-0 filler expert).
    topk_weights : Tensor, shape [T, top_k], float32
    keep : Tensor, shape [E], bool
    """

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    keep: torch.Tensor


def check_outputs(
    logits: torch.Tensor,
    top_k: int,
    keep_out: torch.Tensor | None,
    ids_out: torch.Tensor | None,
    weights_out: torch.Tensor | None,
    metrics_row: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` unless every given output buffer has the shape, dtype and device it needs."""
    num_tokens, num_experts = logits.shape
    wanted = {
        "keep_out": (keep_out, (num_experts,), torch.bool),
        "ids_out": (ids_out, (num_tokens, top_k), torch.int32),
        "weights_out": (weights_out, (num_tokens, top_k), torch.float32),
        "metrics_row": (metrics_row, (len(METRIC_COLUMNS),), torch.int64),
    }
    for name, (tensor, shape, dtype) in wanted.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a {dtype} tensor of shape {shape}, got {got}")
        if tensor.device != logits.device:
            raise ValueError(f"{name} is on {tensor.device}, the logits on {logits.device}")
        if name in ("ids_out", "weights_out") and num_tokens and tensor.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its slots")


def check_prune_route_args(
    logits: torch.Tensor,
    cfg: PrunerConfig,
    router: RouterSpec,
    *,
    correction_bias: torch.Tensor | None,
    tokens_per_request: int,
    expert_to_rank: torch.Tensor | None,
    token_weights: torch.Tensor | None,
    keep_out: torch.Tensor | None,
    ids_out: torch.Tensor | None,
    weights_out: torch.Tensor | None,
    metrics_row: torch.Tensor | None,
) -> None:
    """Every host-side check of a :func:`prune_route` call (shared with the kernels' wrapper); raise
    ``ValueError`` naming the argument.  Shapes, types and config values, never tensor contents."""
    if not isinstance(router, RouterSpec):
        raise ValueError(f"router must be a RouterSpec, got {type(router).__name__}")
    validate_selection_args(
        logits,
        cfg,
        top_k=router.top_k,
        tokens_per_request=tokens_per_request,
        expert_to_rank=expert_to_rank,
        scoring=router.scoring,
        token_weights=token_weights,
    )
    router.check(logits.shape[1], correction_bias)
    check_outputs(logits, router.top_k, keep_out, ids_out, weights_out, metrics_row)
    if correction_bias is not None and correction_bias.device != logits.device:
        raise ValueError(f"correction_bias is on {correction_bias.device}, the logits on {logits.device}")


def prune_route(
    logits: torch.Tensor,
    cfg: PrunerConfig,
    router: RouterSpec,
    *,
    correction_bias: torch.Tensor | None = None,
    tokens_per_request: int = 1,
    num_valid_tokens: int | torch.Tensor | None = None,
    expert_to_rank: torch.Tensor | None = None,
    layer_id: int | None = None,
    token_weights: torch.Tensor | None = None,
    fill_dropped: bool = False,
    keep_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    weights_out: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    workspace: object | None = None,
) -> PrunedRouting:
    """Keep mask and routing of one MoE layer call.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32 / bfloat16 / float16
        Router logits (rows at or after ``num_valid_tokens`` are padding).
    cfg : PrunerConfig
        The policy; ``cfg.coverage`` says how tokens route inside the kept set.
    router : RouterSpec
        The model's router (``top_k``, scoring, renormalization, groups, output scale).
    correction_bias : Tensor, shape [E], optional
        The router's correction bias (sigmoid scoring): chooses experts, does not weigh them.
    tokens_per_request, num_valid_tokens, expert_to_rank, layer_id, token_weights
        As in :func:`~xshare_sglang.select_experts_mask`; a row of vote weight 0 routes nowhere.
    fill_dropped : bool
        Give empty slots a valid expert of weight 0 instead of ``-1``.
    keep_out, ids_out, weights_out : Tensor, optional
        Written in place and returned: [E] bool, [T, top_k] int32, [T, top_k] float32.
    metrics_row : Tensor, shape [4], int64, optional
        Receives ``+=`` the call's metrics (:func:`~xshare_sglang.policies.rewrite.call_metrics`).
    workspace : optional
        Ignored (the kernels' scratch memory); accepted so both paths share one signature.

    Returns
    -------
    PrunedRouting
    """
    del workspace
    check_prune_route_args(
        logits,
        cfg,
        router,
        correction_bias=correction_bias,
        tokens_per_request=tokens_per_request,
        expert_to_rank=expert_to_rank,
        token_weights=token_weights,
        keep_out=keep_out,
        ids_out=ids_out,
        weights_out=weights_out,
        metrics_row=metrics_row,
    )
    keep, aggregate = _select(
        logits,
        cfg,
        router.top_k,
        tokens_per_request,
        num_valid_tokens,
        expert_to_rank,
        router.scoring,
        layer_id,
        token_weights,
        True,
    )
    num_tokens, num_experts = logits.shape
    ids, weights = route_logits(
        sanitize_logits(logits),
        keep,
        top_k=router.top_k,
        coverage=cfg.coverage,
        scoring=router.scoring,
        renormalize=router.renormalize,
        correction_bias=correction_bias,
        router=router,
    )
    routed = valid_token_mask(num_tokens, num_valid_tokens, logits.device)
    if token_weights is not None:
        routed = routed & (sanitize_token_weights(token_weights) > 0)
    ids = torch.where(routed[:, None], ids, -1).to(torch.int32)
    weights = torch.where(routed[:, None], weights, 0.0).to(torch.float32)
    if fill_dropped:
        empty = ids < 0
        ids = torch.where(empty, filler_ids(ids, keep, empty), ids)
    if metrics_row is not None:
        kept_total = torch.where(keep, aggregate, 0).sum()
        metrics_row.add_(call_metrics(ids, num_experts, keep, kept_total, aggregate.sum()))
    if keep_out is not None:
        keep = keep_out.copy_(keep)
    if ids_out is not None:
        ids = ids_out.copy_(ids)
    if weights_out is not None:
        weights = weights_out.copy_(weights)
    return PrunedRouting(ids, weights, keep)
