"""Reference: xshare_sglang.policies.greedy.rank_rounds_add (policy ``xshare-ep``).

The warm-up set grown in rounds, each round the best candidate of every expert-parallel rank, until
``rank_budget`` experts per rank are kept.
"""

import triton
import triton.language as tl

from ..order import places


@triton.jit
def rank_rounds_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The warm-up set and the fewest rounds of candidates that reach ``rank_budget x ranks`` kept
    experts [E] (``tables.group_ptr``: each expert's rank; ``CONFIG``: :class:`~xshare_sglang.kernels.
    bundles.RankRoundsConfig`)."""
    start = warm != 0
    candidate = e_ok & (~start) & (agg > 0)
    group_e = tl.load(tables.group_ptr + e, mask=e_ok, other=-1)
    target = policy.rank_budget * (tl.max(tl.where(e_ok, group_e, -1), axis=0) + 1)
    # |start| and the candidates in one sum (disjoint sets, E < 2**16)
    both = tl.sum(start.to(tl.int32) + (candidate.to(tl.int32) << 16), axis=0)
    kept = (both & 0xFFFF).to(tl.int64)
    if kept + (both >> 16) > target:
        place = places(agg, candidate, e, e_ok, group_e, True)
        # fewest rounds R in [0, E] with |start| + #{candidates placed < R} >= target; monotone: bisect
        lo = tl.full([], 0, tl.int64)
        hi = tl.full([], 0, tl.int64) + call.num_experts
        for _ in range(0, CONFIG.SEARCH_STEPS):
            mid = (lo + hi) // 2
            added = tl.sum((candidate & (place < mid)).to(tl.int64), axis=0)
            enough = (kept + added >= target) | (mid >= call.num_experts)
            moving = lo < hi
            hi = tl.where(moving & enough, mid, hi)
            lo = tl.where(moving & (~enough), mid + 1, lo)
        keep = start | (candidate & (place < lo))
    else:
        # the target is not passed before every candidate is in: the rounds take them all
        keep = start | candidate
    return keep
