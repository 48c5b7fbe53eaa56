"""The set-building steps the XShare family is made of.

* :func:`warm_up`       W(k0): union of every valid token's top-``k0`` experts by logit.
* :func:`greedy_add`    G(S, agg, b): add the ``b`` best experts outside S with aggregate > 0.
* :func:`threshold_add` grow S by aggregate until it holds ``tau`` of the total aggregate.
* :func:`rank_rounds_add` GPU-balanced rounds: each rank in turn adds its best expert.
* :func:`coverage_add`  ``moe-spec`` ranking="coverage": add the expert with the most uncovered mass.
* :func:`coactivation_add` ``moe-spec`` ranking="coactivation": aggregate discounted by redundancy.

All are tensor programs over the expert axis with static shapes: no host syncs, no loops over
tokens, usable on CPU and inside CUDA graphs.
"""

from __future__ import annotations

import torch

from ..calibration_file import REDUNDANCY_BITS
from .scores import SCORE_FRACTION_BITS, descending_order, positions_in_order, top_by_logit

# the coverage greedy's grid: scores in units of 2**-16 (see coverage_add)
COVERAGE_FRACTION_BITS = 16
COVERAGE_ONE = 1 << COVERAGE_FRACTION_BITS


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
    # E rounds exhaust every rank (an elementwise or, not a write of a Python value: no host copy)
    done = ((keep.sum() + added_after) >= target) | (rounds == num_experts)
    num_rounds = torch.argmax(done.to(torch.int8))  # first round count that reaches the target
    return keep | (candidate & (place_in_rank < num_rounds))


def coactivation_add(agg: torch.Tensor, redundancy: torch.Tensor, count: int, active: torch.Tensor) -> torch.Tensor:
    """Co-activation-aware greedy: ``count`` times, keep the expert that adds the most discounted score.

    A candidate's gain is its aggregate times ``1 - r``, where ``r`` is its largest redundancy with an
    expert already kept (redundancy from calibration co-activation counts, on a ``2**-16`` grid, so the
    gain is an exact int64 product).  The first pick is the top aggregate; ties go to the lower index.
    Experts whose gain is 0 fill the remaining budget in index order, as in ``moe-spec``.

    Parameters
    ----------
    agg : Tensor, shape [E], int64
        Fixed-point aggregate (below ``2**46``).
    redundancy : Tensor, shape [E, E], int32
        ``redundancy[i, j]`` in ``[0, 2**16]``, from
        :meth:`~xshare_sglang.calibration_file.StaticRanking.layer_redundancy`.
    count : int
        Experts to keep (at most E are).
    active : Tensor, shape [], bool
        False keeps nothing (no real token).

    Returns
    -------
    Tensor, shape [E], bool
    """
    num_experts = agg.shape[-1]
    keep = torch.zeros(num_experts, dtype=torch.bool, device=agg.device)
    discount = torch.zeros(num_experts, dtype=torch.int64, device=agg.device)
    index = torch.arange(num_experts, device=agg.device)
    table = redundancy.to(device=agg.device, dtype=torch.int64)
    for _ in range(min(count, num_experts)):
        gain = torch.where(keep, -1, agg * ((1 << REDUNDANCY_BITS) - discount))
        pick = torch.argmax(gain)  # the first maximum: ties to the lower index
        keep = keep | (index == pick)
        discount = torch.maximum(discount, table.index_select(0, pick.reshape(1))[0])
    return keep & active


def coverage_add(scores: torch.Tensor, agg: torch.Tensor, count: int, active: torch.Tensor) -> torch.Tensor:
    """Coverage greedy: ``count`` times, keep the expert that adds the most *uncovered* routing mass.

    The greedy reads the scores on a coarser grid, ``c = q >> 8`` (units of ``2**-16``,
    :data:`COVERAGE_ONE` is 1.0).  With ``S`` the experts kept so far, token ``t`` is covered to
    ``m_t = sum_{i in S} c[t, i]`` and candidate ``j`` gains ``sum_t c[t, j] * max(COVERAGE_ONE - m_t, 0)``:
    a token whose routing mass the kept experts already hold adds little, one they miss adds its full
    score.  So the batch's own co-activation decides: an expert picked by the same tokens as one
    already kept ranks lower than the aggregate alone would put it.  Ties go to the larger aggregate,
    then the lower index; with every token covered, the rest of the budget goes by aggregate.

    Every term is below ``2**32``, so the int64 sums are exact for fewer than ``2**31`` tokens.  Where
    a token's scores sum to at most 1 (``score="topk"``, and ``"probs"`` under softmax) the clamp never
    binds, and the gain is ``COVERAGE_ONE * sum_t c[t, j] - sum_{i in S} C[i, j]`` with
    ``C[i, j] = sum_t c[t, i] * c[t, j]``: the kernels keep the gains that way, one row of ``C`` per
    pick, whatever the number of tokens.

    Parameters
    ----------
    scores : Tensor, shape [T, E], int64
        Fixed-point per-token scores (``2**24`` = 1), zero on rows that do not vote.
    agg : Tensor, shape [E], int64
        Their column sums (the tie-break).
    count : int
    active : Tensor, shape [], bool

    Returns
    -------
    Tensor, shape [E], bool
    """
    num_experts = agg.shape[-1]
    keep = torch.zeros(num_experts, dtype=torch.bool, device=agg.device)
    index = torch.arange(num_experts, device=agg.device)
    coarse = scores >> (SCORE_FRACTION_BITS - COVERAGE_FRACTION_BITS)
    for _ in range(min(count, num_experts)):
        covered = torch.where(keep[None, :], coarse, 0).sum(dim=1)
        gain = (coarse * (COVERAGE_ONE - covered).clamp(min=0)[:, None]).sum(dim=0)
        key = torch.where(keep, -1, gain)
        tied = key == key.max()
        best_agg = torch.where(tied, agg, -1).max()
        pick = torch.argmax((tied & (agg == best_agg)).to(torch.int8))  # the first such expert
        keep = keep | (index == pick)
    return keep & active
