"""The co-activation ranking (moe-spec ``ranking="coactivation"``): greedy on calibrated redundancy.

Each pick keeps the expert of the largest ``agg * (1 - redundancy with the kept set)``, first index on
ties. Up to 4095 tokens a gain and its index are one int64 key; up to 128 experts every warp picks on
its own copy of the gains (warp-wide maxima, no barrier per pick), above with block-wide maxima. The
picks stop once no gain is left; the rest of the budget is taken in index order.
"""

import triton
import triton.language as tl

from .keys import warp_halves, warp_key_max

REDUNDANCY_ONE = tl.constexpr(1 << 16)  # 1.0 on the redundancy grid (config.REDUNDANCY_BITS)


@triton.jit
def coact_picks(agg, count, redundancy_ptr, num_experts, BLOCK_E: tl.constexpr, WARPS: tl.constexpr):
    """The co-activation greedy's picks up to 4095 tokens, then the rest of ``count`` in index order
    ([BLOCK_E] int32, 1 per kept expert), with no barrier per pick.

    Every warp holds all the gains, as two [WARPS, SUB] tiles of copies (a row per warp), takes each
    pick on its own and loads the picked redundancy row itself: a pick is two int32 warp maxima
    (:func:`warp_key_max`) and one load, never a block reduction.  The tiles are 2-D with the experts
    on the contiguous axis, so the row load lays each row in one warp whatever the compiler's order
    among other axes (int32 rows: up to 128 experts a row, so up to 256 experts).

    Exact as the greedy: a gain is below 2**52 (agg <= T * 2**24 < 2**36 for T <= 4095, the factor
    <= 2**16), so ``gain << 10 | (1023 - e)`` is a key below 2**62 whose maximum is the largest gain at its first
    index.  A pick is made only while the best gain is positive (gains never grow, so once none is,
    none will be); at most ``min(count, experts with an aggregate)`` steps, as only those can gain.
    The rest are the free experts of the lowest indices, by a running count in each warp."""
    SUB: tl.constexpr = BLOCK_E // 2
    e_a = tl.arange(0, SUB)[None, :] + tl.zeros([WARPS, 1], tl.int32)
    e_b = e_a + SUB
    ok_a = e_a < num_experts
    ok_b = e_b < num_experts
    agg_a, agg_b = warp_halves(agg, SUB, WARPS)
    chosen_a = tl.zeros([WARPS, SUB], tl.int32)
    chosen_b = tl.zeros([WARPS, SUB], tl.int32)
    discount_a = tl.zeros([WARPS, SUB], tl.int32)
    discount_b = tl.zeros([WARPS, SUB], tl.int32)
    steps = tl.minimum(tl.sum((agg > 0).to(tl.int32), axis=0), count)
    for _ in range(0, steps):
        gain_a = agg_a * (REDUNDANCY_ONE - discount_a)  # int64: agg is
        gain_b = agg_b * (REDUNDANCY_ONE - discount_b)
        best = warp_key_max(
            tl.where(ok_a & (chosen_a == 0), (gain_a << 10) | (1023 - e_a), 0),
            tl.where(ok_b & (chosen_b == 0), (gain_b << 10) | (1023 - e_b), 0),
        )
        live = best >= 1024  # a positive gain
        first = tl.where(live, 1023 - (best & 1023), -1).to(tl.int32)
        chosen_a = tl.where(e_a == first, 1, chosen_a)
        chosen_b = tl.where(e_b == first, 1, chosen_b)
        row = redundancy_ptr + first * num_experts
        discount_a = tl.maximum(discount_a, tl.load(row + e_a, mask=ok_a & live, other=0))
        discount_b = tl.maximum(discount_b, tl.load(row + e_b, mask=ok_b & live, other=0))
    # the rest of the budget in index order: the free experts whose place among the free ones is
    # below what is left
    free_a = (ok_a & (chosen_a == 0)).to(tl.int32)
    free_b = (ok_b & (chosen_b == 0)).to(tl.int32)
    rest = count - tl.sum(chosen_a, axis=1)[:, None] - tl.sum(chosen_b, axis=1)[:, None]
    place_a = tl.cumsum(free_a, axis=1)
    place_b = tl.cumsum(free_b, axis=1) + tl.sum(free_a, axis=1)[:, None]
    chosen_a = tl.where((free_a != 0) & (place_a <= rest), 1, chosen_a)
    chosen_b = tl.where((free_b != 0) & (place_b <= rest), 1, chosen_b)
    # the copies are equal: one of them, the halves joined
    return tl.reshape(tl.permute(tl.join(tl.max(chosen_a, axis=0), tl.max(chosen_b, axis=0)), (1, 0)), [BLOCK_E])
