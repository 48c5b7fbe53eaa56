"""The set-building steps the XShare family is made of (DESIGN section 4).

* :func:`warm_up`       W(k0): union of every valid token's top-``k0`` experts by logit.
* :func:`greedy_add`    G(S, agg, b): add the ``b`` best experts outside S with aggregate > 0.
* :func:`threshold_add` grow S by aggregate until it holds ``tau`` of the total aggregate.
* :func:`rank_rounds_add` GPU-balanced rounds: each rank in turn adds its best expert.

All are tensor programs over the expert axis with static shapes: no host syncs, no loops over
tokens, usable on CPU and inside CUDA graphs.
"""

from __future__ import annotations

import torch

from .scores import descending_order, positions_in_order, top_by_logit


def warm_up(logits: torch.Tensor, valid: torch.Tensor, k0: int) -> torch.Tensor:
    """W(k0) over the valid tokens.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32, sanitized
    valid : Tensor, shape [T], bool
    k0 : int

    Returns
    -------
    Tensor, shape [E], bool
    """
    return (top_by_logit(logits, k0) & valid[:, None]).any(dim=0)


def _candidate_positions(keep: torch.Tensor, agg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts outside ``keep`` with aggregate > 0, and each expert's place in the greedy order.

    Candidates come first in the order (highest aggregate first, ties to the lower index), so a
    candidate's position is its rank among candidates.
    """
    candidate = ~keep & (agg > 0)
    key = torch.where(candidate, agg, -1)
    return candidate, positions_in_order(descending_order(key))


def greedy_add(keep: torch.Tensor, agg: torch.Tensor, count: int) -> torch.Tensor:
    """G(S, agg, b): ``keep`` plus its ``count`` best outside experts with aggregate > 0.

    Works row-wise on a leading batch dimension too (``xshare-spec`` uses it per request).

    Parameters
    ----------
    keep : Tensor, shape [..., E], bool
    agg : Tensor, shape [..., E], int64
    count : int

    Returns
    -------
    Tensor, shape [..., E], bool
    """
    if count <= 0:
        return keep
    candidate, position = _candidate_positions(keep, agg)
    return keep | (candidate & (position < count))


TAU_FRACTION_BITS = 30


def tau_fixed_point(tau: float) -> int:
    """``tau`` on the ``2**-30`` grid, rounded to nearest."""
    return round(tau * (1 << TAU_FRACTION_BITS))


def threshold_target(total: torch.Tensor, tau_q: int) -> torch.Tensor:
    """``ceil(tau_q * total / 2**30)`` exactly in int64, for ``0 <= total < 2**56``.

    ``total`` is split at bit 23 so that no intermediate product exceeds 2**54.
    """
    high, low = total >> 23, total & ((1 << 23) - 1)
    a, b = high * tau_q, low * tau_q
    rest = (a & 127) * (1 << 23) + b
    return (a >> 7) + ((rest + (1 << TAU_FRACTION_BITS) - 1) >> TAU_FRACTION_BITS)


def threshold_add(keep: torch.Tensor, agg: torch.Tensor, tau: float) -> torch.Tensor:
    """Grow ``keep`` greedily until its aggregate reaches ``tau`` of the total.

    An outside expert with aggregate > 0 is added when the aggregate kept before it, in greedy
    order, is still below ``tau * total``.  The comparison is exact, in integers: ``tau`` is taken
    on a ``2**-30`` grid (:func:`tau_fixed_point`) and the bound is ``ceil(tau_q * total / 2**30)``
    (:func:`threshold_target`).

    Parameters
    ----------
    keep : Tensor, shape [E], bool
    agg : Tensor, shape [E], int64
    tau : float, in (0, 1]

    Returns
    -------
    Tensor, shape [E], bool
    """
    candidate, position = _candidate_positions(keep, agg)
    order = descending_order(torch.where(candidate, agg, -1))
    gain_in_order = torch.where(candidate, agg, 0).gather(-1, order)
    kept_before = torch.where(keep, agg, 0).sum() + torch.cumsum(gain_in_order, dim=-1) - gain_in_order
    target = threshold_target(agg.sum(), tau_fixed_point(tau))
    add_in_order = kept_before < target
    return keep | (candidate & add_in_order.gather(-1, position))


def rank_rounds_add(
    keep: torch.Tensor, agg: torch.Tensor, expert_to_rank: torch.Tensor, rank_budget: int
) -> torch.Tensor:
    """XShare Alg. 5: GPU-balanced greedy rounds on top of ``keep``.

    While fewer than ``rank_budget * G`` experts are kept (G = ``max(expert_to_rank) + 1``), run one
    full round over the ranks, each adding its highest-aggregate expert not yet kept with aggregate
    > 0.  A rank with none left is skipped; a round that adds nothing ends the loop.

    Round r adds exactly the candidates whose place among their own rank's candidates is r - 1, so
    the number of rounds is found from counts alone, without a data-dependent loop.

    Parameters
    ----------
    keep : Tensor, shape [E], bool
    agg : Tensor, shape [E], int64
    expert_to_rank : Tensor, shape [E], integer; rank ids ``0 .. G-1``
    rank_budget : int

    Returns
    -------
    Tensor, shape [E], bool
    """
    num_experts = agg.shape[-1]
    device = agg.device
    rank = expert_to_rank.to(device=device, dtype=torch.int64)
    candidate = ~keep & (agg > 0)
    # Order by (rank ascending, candidates first, aggregate descending, index ascending).
    by_score = descending_order(torch.where(candidate, agg, -1))
    by_rank = by_score[torch.sort(rank[by_score], stable=True).indices]
    sorted_rank = rank[by_rank]
    slots = torch.arange(num_experts, device=device)
    starts_group = torch.ones(num_experts, dtype=torch.bool, device=device)
    starts_group[1:] = sorted_rank[1:] != sorted_rank[:-1]
    group_start = torch.cummax(torch.where(starts_group, slots, 0), dim=0).values
    place_in_rank = torch.empty_like(slots).scatter_(0, by_rank, slots - group_start)
    # After r rounds the kept set has |keep| + #{candidates with place < r} experts.
    rounds = torch.arange(num_experts + 1, device=device)
    added_after = ((place_in_rank[None, :] < rounds[:, None]) & candidate[None, :]).sum(dim=1)
    target = rank_budget * (rank.max() + 1)
    done = (keep.sum() + added_after) >= target
    done[-1] = True  # E rounds exhaust every rank.
    num_rounds = torch.argmax(done.to(torch.int8))  # first round count that reaches the target
    return keep | (candidate & (place_in_rank < num_rounds))
