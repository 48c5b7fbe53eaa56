"""Reference: xshare_sglang.policies.greedy.coverage_add (moe-spec ``ranking="coverage"``).

The coverage ranking's set: greedy picks of the expert that covers the most of the rows' uncovered
score mass (the picks' machinery is :mod:`..coverage`).
"""

import triton
import triton.language as tl

from ..coverage import COVER_BITS, COVER_ONE, coverage_first, coverage_loss, coverage_pair_picks, coverage_top
from ..numerics import SCORE_BITS
from ..order import places, take_by_order


@triton.jit
def coverage_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The coverage ranking's keep mask [E] (``CONFIG``: :class:`~xshare_sglang.kernels.bundles.
    CoverageConfig`): the pair sums' picks (``PAIRS``), the row lists' (``LISTS``) or the register
    tile's, from the workspace ``coverage`` phase 1 filled."""
    row_scores_ptr = coverage.row_scores_ptr
    cover_rows_ptr = coverage.cover_rows_ptr
    cover_count_ptr = coverage.cover_count_ptr
    cover_capacity = coverage.cover_capacity
    cover_agg_ptr = coverage.cover_agg_ptr
    cover_pairs_ptr = coverage.cover_pairs_ptr
    num_tokens = call.num_tokens
    num_experts = call.num_experts
    count = policy.count
    BLOCK_E: tl.constexpr = CONFIG.BLOCK_E
    COVER_T: tl.constexpr = CONFIG.TILE_ROWS
    # greedy: each step keeps the expert with the most uncovered per-token mass
    # sum_t (q[t, j] * max(ONE - covered_t, 0)) >> 24; ties to the larger agg, then the lower id
    tl.debug_barrier()
    # The picks run while some candidate gains: gains never grow, and once every one is zero
    # the reference picks the rest by aggregate, then index, which take_by_order does at once
    # (with T tokens at most T x top_k experts gain, so small batches stop early).
    chosen = tl.zeros([BLOCK_E], tl.int32)
    picks = tl.minimum(count, num_experts)
    taken = tl.zeros([], tl.int32)
    if CONFIG.PAIRS:
        # before any pick every row is uncovered: a gain is COVER_ONE times the column sum;
        # keeping an expert takes its row of C (the pair sums) off every gain.  Each pick is
        # one maximum of gain << 20 | (1023 - tie) << 10 | e, with tie the expert's place in
        # the order (agg desc, index asc): gains stay below 2**42 (at most 1024 tokens of
        # 2**32 each), places and ids below 1024
        tie = places(agg, e_ok, e, e_ok, e, False)
        if CONFIG.WARP_PICKS:
            chosen = coverage_pair_picks(
                tie, picks, cover_agg_ptr, cover_pairs_ptr, num_experts, BLOCK_E, CONFIG.WARPS, CONFIG.SEARCH_STEPS
            )
        else:
            # block-wide picks above the warps' reach, the same keys
            low = ((1023 - tie.to(tl.int64)) << 10) | e
            gain = tl.load(cover_agg_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") << COVER_BITS
            best = tl.max(tl.where(e_ok, (gain << 20) | low, -1), axis=0)
            while (taken < picks) & ((best >> 20) > 0):
                first = (best & 1023).to(tl.int32)
                gain -= tl.load(
                    cover_pairs_ptr + first.to(tl.int64) * num_experts + e,
                    mask=e_ok,
                    other=0,
                    cache_modifier=".cg",
                )
                chosen = tl.where(e == first, 1, chosen)
                taken += 1
                best = tl.max(tl.where(e_ok & (chosen == 0), (gain << 20) | low, -1), axis=0)
            chosen = take_by_order(agg, chosen, e, e_ok, picks - taken)
    elif CONFIG.LISTS:
        # the gains are kept up to date: before any pick every row is uncovered and a gain is
        # COVER_ONE times the column sum; a pick changes only the rows on its list, so only
        # their terms are taken out at the old coverage and put back at the new one
        listed = tl.load(cover_count_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
        gain = tl.load(cover_agg_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") << COVER_BITS
        key, top = coverage_top(gain, chosen, e_ok)
        while (taken < picks) & (top > 0):
            first = coverage_first(key, top, agg, e)
            num_listed = tl.sum(tl.where(e == first, listed, 0), axis=0)
            for c in range(0, num_listed, COVER_T):
                slot = c + tl.arange(0, COVER_T)
                slot_ok = slot < num_listed
                rows = tl.load(
                    cover_rows_ptr + first * cover_capacity + slot, mask=slot_ok, other=0, cache_modifier=".cg"
                )
                q = tl.load(
                    row_scores_ptr + rows[:, None] * num_experts + e[None, :],
                    mask=slot_ok[:, None] & e_ok[None, :],
                    other=0,
                    cache_modifier=".cg",
                ).to(tl.int64)
                gain -= coverage_loss(q, chosen, e, first)
            chosen = tl.where(e == first, 1, chosen)
            taken += 1
            key, top = coverage_top(gain, chosen, e_ok)
    else:
        # every row in one register tile, read once; each step recomputes the gains from it
        t = tl.arange(0, COVER_T)
        q_rows = tl.load(
            row_scores_ptr + t[:, None] * num_experts + e[None, :],
            mask=(t < num_tokens)[:, None] & e_ok[None, :],
            other=0,
            cache_modifier=".cg",
        )
        c_rows = q_rows.to(tl.int64) >> (SCORE_BITS - COVER_BITS)
        key, top = coverage_top(tl.sum(c_rows, axis=0) << COVER_BITS, chosen, e_ok)
        while (taken < picks) & (top > 0):
            first = coverage_first(key, top, agg, e)
            chosen = tl.where(e == first, 1, chosen)
            taken += 1
            covered = tl.sum(tl.where(chosen[None, :] != 0, c_rows, 0), axis=1)
            left = tl.where(covered < COVER_ONE, COVER_ONE - covered, 0)
            key, top = coverage_top(tl.sum(c_rows * left[:, None], axis=0), chosen, e_ok)
    if not CONFIG.PAIRS:
        chosen = take_by_order(agg, chosen, e, e_ok, picks - taken)
    keep = e_ok & (chosen != 0) & (n_valid > 0)
    return keep
