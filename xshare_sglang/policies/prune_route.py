"""``prune_route``: the keep mask and the pruned routing of one MoE layer call, as the server runs it.

The pure-torch reference (and CPU path) of :func:`xshare_sglang.kernels.prune_route`, which does the
same work in one or two Triton launches and replaces SGLang's own top-k for a pruned layer:

1. the policy chooses the experts the batch keeps (:func:`~xshare_sglang.policies.api.select`);
2. every real, voting row is routed inside them (:func:`route_logits`, the model's own router:
   softmax or sigmoid, correction bias, groups, renormalization, output scaling, coverage);
3. padding rows and rows of vote weight 0 route nowhere (every slot ``-1``, weight 0); for MoE
   backends that cannot take ``-1``, ``fill_dropped`` gives each empty slot a valid expert of
   weight 0 instead (see :func:`~xshare_sglang.policies.rewrite.filler_ids`);
4. with ``metrics_row``, the call's metrics are added to it (:data:`METRIC_COLUMNS`); with a
   ``metrics_gate`` too, only when the gate (a device int32) is nonzero, so that a server can sample
   the metrics of some calls and skip their cost in the others.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import PrunerConfig
from .api import select
from .call import RoutingCall
from .rewrite import METRIC_COLUMNS, add_metrics, call_metrics, filler_ids
from .routing import route_logits
from .scores import sanitize_logits, sanitize_token_weights, valid_token_mask

__all__ = ["METRIC_COLUMNS", "PrunedRouting", "check_outputs", "prune_route", "route_checked"]


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
    call: RoutingCall,
    keep_out: torch.Tensor | None,
    ids_out: torch.Tensor | None,
    weights_out: torch.Tensor | None,
    metrics_row: torch.Tensor | None,
    metrics_gate: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` unless every given output buffer has the shape, dtype and device it needs
    (and a ``metrics_gate`` comes with the ``metrics_row`` it gates)."""
    num_tokens, num_experts = call.logits.shape
    if metrics_gate is not None and metrics_row is None:
        raise ValueError("metrics_gate gates the metrics_row: pass both, or neither")
    wanted = {
        "keep_out": (keep_out, (num_experts,), torch.bool),
        "ids_out": (ids_out, (num_tokens, call.top_k), torch.int32),
        "weights_out": (weights_out, (num_tokens, call.top_k), torch.float32),
        "metrics_row": (metrics_row, (len(METRIC_COLUMNS),), torch.int64),
        "metrics_gate": (metrics_gate, (1,), torch.int32),
    }
    for name, (tensor, shape, dtype) in wanted.items():
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} must be a {dtype} tensor of shape {shape}, got {got}")
        if tensor.device != call.device:
            raise ValueError(f"{name} is on {tensor.device}, the logits on {call.device}")
        if name in ("ids_out", "weights_out") and num_tokens and tensor.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its slots")


def prune_route(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    fill_dropped: bool = False,
    keep_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    weights_out: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    metrics_gate: torch.Tensor | None = None,
    workspace: object | None = None,
) -> PrunedRouting:
    """Keep mask and routing of one MoE layer call.

    Parameters
    ----------
    call : RoutingCall
        The logits and everything about the call: the model's router (``top_k``, scoring,
        renormalization, groups, output scale), the correction bias, D, the real-token count, the
        expert ranks, the layer and the vote weights (a row of weight 0 routes nowhere).
    cfg : PrunerConfig
        The policy; ``cfg.coverage`` says how tokens route inside the kept set.
    fill_dropped : bool
        Give empty slots a valid expert of weight 0 instead of ``-1``.
    keep_out, ids_out, weights_out : Tensor, optional
        Written in place and returned: [E] bool, [T, top_k] int32, [T, top_k] float32.
    metrics_row : Tensor, shape [4], int64, optional
        Receives ``+=`` the call's metrics (:func:`~xshare_sglang.policies.rewrite.call_metrics`).
    metrics_gate : Tensor, shape [1], int32, optional
        With ``metrics_row``: the call adds its metrics only while this device value is nonzero
        (read on the device, so a CUDA graph replays the call with whatever it holds then).  The
        kernels then skip the metrics' work too: the scores computed only for the retained mass, the
        activated-expert count.  None: every call adds them.
    workspace : optional
        Ignored (the kernels' scratch memory); accepted so both paths share one signature.

    Returns
    -------
    PrunedRouting
    """
    del workspace
    check_outputs(call, keep_out, ids_out, weights_out, metrics_row, metrics_gate)
    return route_checked(
        call,
        cfg,
        fill_dropped=fill_dropped,
        keep_out=keep_out,
        ids_out=ids_out,
        weights_out=weights_out,
        metrics_row=metrics_row,
        metrics_gate=metrics_gate,
    )


def route_checked(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    fill_dropped: bool,
    keep_out: torch.Tensor | None,
    ids_out: torch.Tensor | None,
    weights_out: torch.Tensor | None,
    metrics_row: torch.Tensor | None,
    metrics_gate: torch.Tensor | None = None,
) -> PrunedRouting:
    """:func:`prune_route` once its output buffers were checked (the kernels' fallback)."""
    keep, aggregate = select(call, cfg)
    num_tokens, num_experts = call.logits.shape
    ids, weights = route_logits(
        sanitize_logits(call.logits), keep, call.router, coverage=cfg.coverage, correction_bias=call.correction_bias
    )
    routed = valid_token_mask(num_tokens, call.num_valid_tokens, call.device)
    if call.token_weights is not None:
        routed = routed & (sanitize_token_weights(call.token_weights) > 0)
    ids = torch.where(routed[:, None], ids, -1).to(torch.int32)
    weights = torch.where(routed[:, None], weights, 0.0).to(torch.float32)
    if fill_dropped:
        empty = ids < 0
        ids = torch.where(empty, filler_ids(ids, keep, empty), ids)
    if metrics_row is not None:
        kept_total = torch.where(keep, aggregate, 0).sum()
        add_metrics(metrics_row, call_metrics(ids, num_experts, keep, kept_total, aggregate.sum()), metrics_gate)
    if keep_out is not None:
        keep = keep_out.copy_(keep)
    if ids_out is not None:
        ids = ids_out.copy_(ids)
    if weights_out is not None:
        weights = weights_out.copy_(weights)
    return PrunedRouting(ids, weights, keep)
