"""``select_experts_mask``: the keep mask of any policy, with the common controls applied.

This is the pure-torch reference of DESIGN section 4: the specification in code, the CPU path, and
the fallback on GPU.  It never synchronises with the host: budgets and switches are Python values
from the config, and the real-token count may stay on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import POLICIES, PrunerConfig
from ._batch import LayerBatch, Selection
from .lynx import select_lynx
from .moe_spec import select_moe_spec
from .scores import (
    SCORINGS,
    descending_order,
    positions_in_order,
    sanitize_logits,
    sanitize_token_weights,
    valid_token_mask,
)
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


def check_routing_args(logits: torch.Tensor, top_k: int, scoring: str) -> None:
    """Validate the arguments shared by selection and routing; raise ``ValueError`` naming them."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 2-D tensor [num_tokens, num_experts], got {shape}")
    if not (logits.is_floating_point()):
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ValueError("logits must have at least one expert column")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} is invalid: must be an integer in [1, {num_experts}]")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r} is invalid: choose one of {', '.join(SCORINGS)}")


def validate_selection_args(
    logits: torch.Tensor,
    cfg: PrunerConfig,
    *,
    top_k: int,
    tokens_per_request: int,
    expert_to_rank: torch.Tensor | None,
    scoring: str,
    token_weights: torch.Tensor | None = None,
) -> None:
    """The argument checks of :func:`select_experts_mask` (shared with the kernels' wrapper).

    Host-side only: shapes, types and config values, never tensor contents.
    """
    if not isinstance(cfg, PrunerConfig):
        raise ValueError(f"cfg must be a PrunerConfig, got {type(cfg).__name__}")
    check_routing_args(logits, top_k, scoring)
    if cfg.policy == "none":
        return
    num_experts = logits.shape[1]
    cfg.validate_for_model(top_k=top_k, num_experts=num_experts if cfg.static_ranking is not None else None)
    if isinstance(tokens_per_request, bool) or not isinstance(tokens_per_request, int) or tokens_per_request < 1:
        raise ValueError(f"tokens_per_request={tokens_per_request!r} is invalid: must be an integer >= 1")
    if token_weights is not None:
        if not isinstance(token_weights, torch.Tensor) or token_weights.shape != (logits.shape[0],):
            shape = (
                tuple(token_weights.shape) if isinstance(token_weights, torch.Tensor) else type(token_weights).__name__
            )
            raise ValueError(f"token_weights must be a tensor of shape ({logits.shape[0]},), got {shape}")
        if not token_weights.is_floating_point():
            raise ValueError(f"token_weights must be floating point, got {token_weights.dtype}")
        if token_weights.device != logits.device:
            raise ValueError(f"token_weights is on {token_weights.device}, the logits on {logits.device}")
    if cfg.policy == "xshare-ep":
        if expert_to_rank is None:
            raise ValueError("policy 'xshare-ep' needs expert_to_rank: the rank holding each expert")
        if expert_to_rank.shape != (num_experts,):
            raise ValueError(f"expert_to_rank must have shape ({num_experts},), got {tuple(expert_to_rank.shape)}")


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
        Layer index, needed by ``moe-spec`` with ``ranking="static"`` when the file has several
        layers (an addition to DESIGN section 4's signature; other policies ignore it).
    token_weights : Tensor, shape [T], float, optional
        Vote weight of each row, in [0, 1] (values above 1 count as 1; NaN and values <= 0 as 0).
        A real row with weight 0 does not vote: no warm-up, no score, no LYNX pick.  Other rows'
        scores are multiplied by their weight before they are summed (speculative verify: depth
        decay).  The batch size n (token range, empty batch, LYNX base) still counts every real
        row.  An addition to DESIGN section 4's signature.

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
    keep, _ = _select(
        logits,
        cfg,
        top_k,
        tokens_per_request,
        num_valid_tokens,
        expert_to_rank,
        scoring,
        layer_id,
        token_weights,
        False,
    )
    return keep


def select_with_aggregate(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_experts_mask` plus the batch aggregate it ranked by.

    Returns
    -------
    keep : Tensor, shape [E], bool
    aggregate : Tensor, shape [E], int64
        Fixed-point aggregate of the policy's score over the real tokens (all zero for ``none``);
        ``aggregate[keep].sum() / aggregate.sum()`` is the share of the batch's score mass kept.
    """
    keep, aggregate = _select(
        logits, cfg, top_k, tokens_per_request, num_valid_tokens, expert_to_rank, scoring, layer_id, token_weights, True
    )
    return keep, aggregate


def _select(
    logits: torch.Tensor,
    cfg: PrunerConfig,
    top_k: int,
    tokens_per_request: int,
    num_valid_tokens: int | torch.Tensor | None,
    expert_to_rank: torch.Tensor | None,
    scoring: str,
    layer_id: int | None,
    token_weights: torch.Tensor | None,
    want_aggregate: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    validate_selection_args(
        logits,
        cfg,
        top_k=top_k,
        tokens_per_request=tokens_per_request,
        expert_to_rank=expert_to_rank,
        scoring=scoring,
        token_weights=token_weights,
    )
    num_tokens, num_experts = logits.shape
    if cfg.policy == "none":
        every = torch.ones(num_experts, dtype=torch.bool, device=logits.device)
        return every, torch.zeros(num_experts, dtype=torch.int64, device=logits.device)
    real = valid_token_mask(num_tokens, num_valid_tokens, logits.device)
    weights = None if token_weights is None else sanitize_token_weights(token_weights)
    batch = LayerBatch(
        logits=sanitize_logits(logits),
        valid=real if weights is None else real & (weights > 0),
        real=real,
        token_weights=weights,
        cfg=cfg,
        top_k=top_k,
        tokens_per_request=tokens_per_request,
        scoring=scoring,
        expert_to_rank=expert_to_rank,
        layer_id=layer_id,
    )
    selection = POLICY_FUNCTIONS[cfg.policy](batch)
    keep = selection.keep
    if cfg.max_experts is not None and cfg.policy != "moe-spec":
        keep = cap_experts(selection, batch.batch_aggregate, cfg.max_experts)
    if cfg.min_tokens is not None or cfg.max_tokens is not None:
        in_range = torch.ones((), dtype=torch.bool, device=logits.device)
        if cfg.min_tokens is not None:
            in_range = in_range & (batch.num_valid >= cfg.min_tokens)
        if cfg.max_tokens is not None:
            in_range = in_range & (batch.num_valid <= cfg.max_tokens)
        keep = torch.where(in_range, keep, True)
    return keep, (batch.batch_aggregate if want_aggregate else None)
