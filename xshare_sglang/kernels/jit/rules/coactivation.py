"""Reference: xshare_sglang.policies.greedy.coactivation_add (moe-spec ``ranking="coactivation"``).

The co-activation ranking's set: greedy picks of the largest aggregate discounted by calibrated
redundancy with the kept set (the warp picks are :mod:`..coact`).
"""

import triton
import triton.language as tl

from ..coact import REDUNDANCY_ONE, coact_picks
from ..order import take_by_order


@triton.jit
def coactivation_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The co-activation ranking's keep mask [E] (``CONFIG``: :class:`~xshare_sglang.kernels.bundles.
    CoactivationConfig`): picks in every warp (``WARP_PICKS``), block-wide maxima of one int64 key
    (``KEYS``, up to 4095 tokens), or a (value, index) argmax per pick."""
    count = policy.count
    num_experts = call.num_experts
    redundancy_ptr = tables.redundancy_ptr
    BLOCK_E: tl.constexpr = CONFIG.BLOCK_E
    # greedy: each step keeps the largest agg * (1 - redundancy with the kept set), first id on ties
    # while some candidate gains: gains never grow, and once every one is zero the reference
    # takes the rest in index order (at most T x top_k experts have an aggregate)
    chosen = tl.zeros([BLOCK_E], tl.int32)
    discount = tl.zeros([BLOCK_E], tl.int64)
    taken = tl.zeros([], tl.int32)
    if CONFIG.KEYS and CONFIG.WARP_PICKS:
        chosen = coact_picks(agg, count, redundancy_ptr, num_experts, BLOCK_E, CONFIG.WARPS)
    elif CONFIG.KEYS:
        # block-wide picks above the warps' reach: up to 4095 tokens gain << 10 | (1023 - e)
        # is one int64 key below 2**62 whose maximum is the largest gain at its first index
        best = tl.max(tl.where(e_ok, ((agg * REDUNDANCY_ONE) << 10) | (1023 - e), -1), axis=0)
        while (taken < count) & ((best >> 10) > 0):
            first = 1023 - (best & 1023)
            chosen = tl.where(e == first, 1, chosen)
            taken += 1
            row = tl.load(redundancy_ptr + first * num_experts + e, mask=e_ok, other=0)
            discount = tl.maximum(discount, row.to(tl.int64))
            gain = agg * (REDUNDANCY_ONE - discount)
            best = tl.max(tl.where(e_ok & (chosen == 0), (gain << 10) | (1023 - e), -1), axis=0)
        chosen = take_by_order(tl.zeros([BLOCK_E], tl.int64), chosen, e, e_ok, count - taken)
    else:
        # the largest gain and its first index, one reduction
        gain = tl.where(e_ok, agg * REDUNDANCY_ONE, -1)
        top, first = tl.max(gain, axis=0, return_indices=True, return_indices_tie_break_left=True)
        while (taken < count) & (top > 0):
            chosen = tl.where(e == first, 1, chosen)
            taken += 1
            row = tl.load(redundancy_ptr + first * num_experts + e, mask=e_ok, other=0)
            discount = tl.maximum(discount, row.to(tl.int64))
            gain = tl.where(e_ok & (chosen == 0), agg * (REDUNDANCY_ONE - discount), -1)
            top, first = tl.max(gain, axis=0, return_indices=True, return_indices_tie_break_left=True)
        chosen = take_by_order(tl.zeros([BLOCK_E], tl.int64), chosen, e, e_ok, count - taken)
    keep = e_ok & (chosen != 0) & (n_valid > 0)
    return keep
