"""``route_within``: each token's experts and weights once the keep mask is fixed ("refine").

Two coverages (MoE-Spec section 3.3):

* ``substitution`` (default) - the model's own routing with the logits of pruned experts removed:
  each token takes its top-k kept experts by logit; softmax weights are computed over the kept
  experts (this is what masking the router logits inside SGLang produces), sigmoid weights are
  unchanged; renormalized over the chosen experts when the model renormalizes.
* ``truncation`` - each token keeps its natural top-k and its natural weights; picks outside the
  mask become ``-1`` with weight 0 and the rest are not renormalized (MoE-Spec eq. 7).

Slots a token cannot fill (fewer kept candidates than k), and every slot of a padded row, are
``-1`` with weight 0.  Slots are ordered by logit, highest first, ties to the lower index.
"""

from __future__ import annotations

import torch

from ..config import COVERAGES
from .api import check_routing_args
from .scores import descending_order, normalize_rows, sanitize_logits, scoring_weights, valid_token_mask


def route_logits(
    logits: torch.Tensor,
    keep: torch.Tensor,
    *,
    top_k: int,
    coverage: str,
    scoring: str,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of sanitized logits under one or several keep masks.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32, sanitized
    keep : Tensor, shape [E] or [C, 1, E], bool
        One mask, or C candidate masks (the oracle evaluates many at once).
    top_k, coverage, scoring, renormalize
        As in :func:`route_within`.

    Returns
    -------
    ids : Tensor, shape [T, k] or [C, T, k], int64, ``-1`` for dropped slots
    weights : Tensor, same shape, float32
    """
    candidates = logits > float("-inf")
    batch_shape = torch.broadcast_shapes(keep.shape, logits.shape)
    if coverage == "substitution":
        allowed = candidates & keep
        slots = descending_order(torch.where(allowed, logits, float("-inf")))[..., :top_k]
        filled = allowed.gather(-1, slots)
        weights = torch.where(filled, scoring_weights(logits, allowed, scoring).gather(-1, slots), 0.0)
        if renormalize:
            weights = normalize_rows(weights)
    else:
        slots = descending_order(logits)[..., :top_k]
        natural = candidates.gather(-1, slots)
        weights = torch.where(natural, scoring_weights(logits, candidates, scoring).gather(-1, slots), 0.0)
        if renormalize:
            weights = normalize_rows(weights)
        slots = slots.expand(*batch_shape[:-1], top_k)
        filled = natural & keep.expand(batch_shape).gather(-1, slots)
        weights = torch.where(filled, weights, 0.0)
    ids = torch.where(filled, slots, -1)
    return ids, weights


def route_within(
    logits: torch.Tensor,
    keep: torch.Tensor,
    *,
    top_k: int,
    coverage: str = "substitution",
    scoring: str = "softmax",
    renormalize: bool = True,
    num_valid_tokens: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route every token inside the kept experts.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32 / bfloat16 / float16
    keep : Tensor, shape [E], bool
    top_k : int
        The model's routed experts per token, ``1 <= top_k <= E``.
    coverage : {"substitution", "truncation"}
    scoring : {"softmax", "sigmoid"}
    renormalize : bool
        Whether the model renormalizes its top-k weights to sum to one.
    num_valid_tokens : int or one-element Tensor, optional
        Rows at or after it are padding and get only ``-1`` slots (an addition to DESIGN section 4's
        signature, for CUDA-graph padded batches).

    Returns
    -------
    ids : Tensor, shape [T, top_k], int32, ``-1`` = dropped slot
    weights : Tensor, shape [T, top_k], float32, 0 on dropped slots, never NaN
    """
    check_routing_args(logits, top_k, scoring)
    if coverage not in COVERAGES:
        raise ValueError(f"coverage={coverage!r} is invalid: choose one of {', '.join(COVERAGES)}")
    num_tokens, num_experts = logits.shape
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != (num_experts,):
        got = (keep.dtype, tuple(keep.shape)) if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"keep must be a bool tensor of shape ({num_experts},), got {got}")
    ids, weights = route_logits(
        sanitize_logits(logits),
        keep.to(logits.device),
        top_k=top_k,
        coverage=coverage,
        scoring=scoring,
        renormalize=renormalize,
    )
    valid = valid_token_mask(num_tokens, num_valid_tokens, logits.device)[:, None]
    return torch.where(valid, ids, -1).to(torch.int32), torch.where(valid, weights, 0.0)
