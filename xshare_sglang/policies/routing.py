"""``route_within``: each token's experts and weights once the keep mask is fixed ("refine").

Two coverages (MoE-Spec section 3.3):

* ``substitution`` (default) - the model's own routing among the kept experts only: what SGLang's
  router produces when the logits (and correction bias) of pruned experts are masked;
* ``truncation`` - each token keeps its natural routing and natural weights; picks outside the mask
  become ``-1`` with weight 0 and the rest are not renormalized (MoE-Spec eq. 7).

The model's router, as SGLang's ``TopKConfig`` describes it (:class:`RouterSpec`):

* the choice key of an expert is its logit, or with a correction bias (DeepSeek-V3 style)
  ``sigmoid32(logit) + bias`` in float32;
* grouped routing (``num_expert_group`` G > 1) splits the experts into G contiguous groups, ranks
  the groups that hold a candidate by the best candidate key (with a bias: the sum of the two best;
  a group with one candidate ranks after every group with two, by that one key), keeps the best
  ``topk_group`` groups, and picks only inside them;
* each token takes its ``top_k`` candidates with the highest key (ties to the lower index); the
  weight of a pick is the softmax over the candidates (softmax models) or the sigmoid of its logit,
  renormalized over the picks when the model renormalizes, then times ``routed_scaling_factor``
  when the model applies it to the routing output.

Slots a token cannot fill (fewer candidates than k), and every slot of a padded row, are ``-1`` with
weight 0.  Slots are ordered by key, highest first, ties to the lower index.
"""

from __future__ import annotations

import torch

from ..config import COVERAGES
from .call import RouterSpec, check_routing_args
from .scores import (
    descending_order,
    normalize_rows,
    sanitize_logits,
    scoring_weights,
    sigmoid32,
    valid_token_mask,
)

_FP32_MAX = torch.finfo(torch.float32).max


def sanitize_bias(correction_bias: torch.Tensor) -> torch.Tensor:
    """Float32 bias with NaN -> 0 and +-inf -> +-max float32 (every key stays finite)."""
    return torch.nan_to_num(correction_bias.to(torch.float32), nan=0.0, posinf=_FP32_MAX, neginf=-_FP32_MAX)


def choice_keys(logits: torch.Tensor, correction_bias: torch.Tensor | None) -> torch.Tensor:
    """The key each token ranks experts by: the logit, or ``sigmoid32(logit) + bias`` (float32)."""
    if correction_bias is None:
        return logits
    return sigmoid32(logits) + sanitize_bias(correction_bias)


def _descending_lexicographic(primary: torch.Tensor, secondary: torch.Tensor) -> torch.Tensor:
    """Order by (primary desc, secondary desc, index asc) along the last dimension."""
    order = descending_order(secondary)
    return order.gather(-1, descending_order(primary.gather(-1, order)))


def group_allowed(key: torch.Tensor, candidates: torch.Tensor, router: RouterSpec, biased: bool) -> torch.Tensor:
    """Which experts lie in one of the token's ``topk_group`` best groups, [..., E] bool."""
    num_experts = key.shape[-1]
    groups = router.num_expert_group
    size = num_experts // groups
    grouped_key = torch.where(candidates, key, float("-inf")).view(*key.shape[:-1], groups, size)
    count = candidates.view(*key.shape[:-1], groups, size).sum(-1)
    best = descending_order(grouped_key)[..., :2]
    top = grouped_key.gather(-1, best)
    if biased and size >= 2:
        score = torch.where(count >= 2, top[..., 0] + top[..., 1], top[..., 0])
        primary = count.clamp(max=2)
    else:
        score = top[..., 0]
        primary = count.clamp(max=1)
    order = _descending_lexicographic(primary, score)[..., : router.topk_group]
    chosen = torch.zeros_like(primary, dtype=torch.bool).scatter_(-1, order, True) & (primary > 0)
    return chosen.repeat_interleave(size, dim=-1)


def route_logits(
    logits: torch.Tensor,
    keep: torch.Tensor,
    router: RouterSpec,
    *,
    coverage: str,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of sanitized logits under one or several keep masks.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32, sanitized
    keep : Tensor, shape [E] or [C, 1, E], bool
        One mask, or C candidate masks (the oracle evaluates many at once).
    router : RouterSpec
        The model's router (checked against E by the caller).
    coverage : {"substitution", "truncation"}
    correction_bias : Tensor, shape [E], optional

    Returns
    -------
    ids : Tensor, shape [T, k] or [C, T, k], int64, ``-1`` for dropped slots
    weights : Tensor, same shape, float32
    """
    finite = logits > float("-inf")
    batch_shape = torch.broadcast_shapes(keep.shape, logits.shape)
    candidates = (finite & keep) if coverage == "substitution" else finite.expand(batch_shape)
    key = choice_keys(logits, correction_bias).expand(batch_shape)
    allowed = candidates
    if router.grouped:
        allowed = candidates & group_allowed(key, candidates, router, correction_bias is not None)
    slots = descending_order(torch.where(allowed, key, float("-inf")))[..., : router.top_k]
    filled = allowed.gather(-1, slots)
    wide = logits.expand(batch_shape)
    weights = torch.where(filled, scoring_weights(wide, candidates, router.scoring).gather(-1, slots), 0.0)
    if router.renormalize:
        weights = normalize_rows(weights)
    if router.routed_scaling_factor is not None:
        weights = weights * float(router.routed_scaling_factor)
    if coverage == "truncation":
        filled = filled & keep.expand(batch_shape).gather(-1, slots)
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
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float | None = None,
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
        Rows at or after it are padding and get only ``-1`` slots (CUDA-graph padded batches).
    correction_bias : Tensor, shape [E], optional
        Added to ``sigmoid32(logit)`` to choose experts, not to weigh them (needs sigmoid scoring).
    num_expert_group, topk_group : int
        Grouped routing (1, 1: none).
    routed_scaling_factor : float, optional
        Multiplies every routed weight.

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
    router = RouterSpec(top_k, scoring, renormalize, num_expert_group, topk_group, routed_scaling_factor)
    router.check(num_experts, correction_bias)
    ids, weights = route_logits(
        sanitize_logits(logits),
        keep.to(logits.device),
        router,
        coverage=coverage,
        correction_bias=None if correction_bias is None else correction_bias.to(logits.device),
    )
    valid = valid_token_mask(num_tokens, num_valid_tokens, logits.device)[:, None]
    return torch.where(valid, ids, -1).to(torch.int32), torch.where(valid, weights, 0.0)


def model_routing_is_kept(
    logits: torch.Tensor,
    keep: torch.Tensor,
    router: RouterSpec,
    model_ids: torch.Tensor,
    model_weights: torch.Tensor,
) -> torch.Tensor:
    """Rows whose unpruned routing is also their pruned routing, exactly, [T] bool.

    Substitution coverage routes a token among its kept experts as the model's router would route
    the masked logits.  When every expert the token's unpruned routing picks is kept, that routing is
    already the answer: masking lower-ranked experts changes neither which experts rank first nor
    (with renormalized softmax, or sigmoid scoring) their weights.  A pick that is not kept still
    qualifies when it ties (equal logit) with a kept expert the model did not pick: the selection
    breaks ties by the lower index, SGLang's top-k by its own order, and both are a top-k of the row
    (the caller adds such picks to the mask).  The weights of a softmax router that does not
    renormalize are shares of all the token's experts, so there the row qualifies only when the mask
    keeps every expert with a finite logit.  Grouped routers never qualify (masking an expert can
    move its group's rank), nor do rows whose unpruned routing is not finite.

    Parameters
    ----------
    logits : Tensor, shape [T, E]
        The call's router logits, unsanitized.
    keep : Tensor, shape [E], bool
    router : RouterSpec
    model_ids : Tensor, shape [T, k], integer
        The model's own routing of the unmasked logits (``-1`` for an empty slot).
    model_weights : Tensor, shape [T, k], float

    Returns
    -------
    Tensor, shape [T], bool
    """
    num_tokens, num_experts = logits.shape
    if router.grouped or router.routed_scaling_factor is not None:
        return torch.zeros(num_tokens, dtype=torch.bool, device=logits.device)
    picked = model_ids.to(torch.int64)
    filled = (picked >= 0) & (picked < num_experts)
    slot_expert = picked.clamp(0, num_experts - 1)
    kept = keep[slot_expert]
    # a pick outside the mask that ties with a kept expert the model left out
    model_picked = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, slot_expert, filled)
    spare = keep & ~model_picked  # [T, E]
    tied = (logits.gather(-1, slot_expert)[..., None] == logits[:, None, :]) & spare[:, None, :]
    inside = torch.where(filled, kept | tied.any(-1), picked < 0).all(-1)
    inside &= torch.isfinite(model_weights).all(-1) & ~torch.isnan(logits).any(-1)
    if router.scoring == "softmax" and not router.renormalize:
        inside &= (keep | (logits == float("-inf"))).all(-1)
    return inside


def adopt_model_routing(
    ids: torch.Tensor,
    weights: torch.Tensor,
    model_ids: torch.Tensor,
    model_weights: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pruned routing with ``rows`` replaced by the model's own, bit for bit.

    Only rows the pruned routing sends somewhere are replaced (padding rows, and rows of vote weight
    0, stay empty).

    Parameters
    ----------
    ids, weights : Tensor, shape [T, k]
        The pruned routing (int32, float32).
    model_ids, model_weights : Tensor, shape [T, k]
        The model's unpruned routing of the same logits.
    rows : Tensor, shape [T], bool
        :func:`model_routing_is_kept`.

    Returns
    -------
    ids, weights : Tensor, shape [T, k], int32 and float32
    taken : Tensor, shape [T], bool
        The rows replaced.
    """
    take = (rows & (ids[:, 0] >= 0))[:, None]
    return (
        torch.where(take, model_ids.to(ids.dtype), ids),
        torch.where(take, model_weights.to(weights.dtype), weights),
        take[:, 0],
    )
