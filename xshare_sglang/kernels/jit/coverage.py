"""The coverage ranking (moe-spec ``ranking="coverage"``): greedy on the batch's uncovered score mass.

Each pick keeps the expert whose scores cover the most of the rows' remaining mass, on a 2**-16 grid
(``c = q >> 8``), ties to the larger aggregate, then the lower index. One program keeps its rows in
registers and recomputes the gains per pick. Above, top-k scores add the batch's pair sums ``C[i, j]
= sum_t c[t, i] c[t, j]`` with atomics: a gain is ``ONE * column sum - sum over kept i of C[i, j]``,
one row of ``C`` per pick whatever T, and every warp picks on its own copy of the gains up to 128
experts. Dense scores keep per-expert row lists. The picks stop once no gain is left; the rest is
taken in the order (agg desc, index asc) in one sort.
"""

import triton
import triton.language as tl

from .keys import warp_halves, warp_key_max
from .numerics import SCORE_BITS

# the coverage greedy's grid (policies.greedy.COVERAGE_FRACTION_BITS): scores >> 8, 2**16 = 1
COVER_BITS = tl.constexpr(16)
COVER_ONE = tl.constexpr(1 << 16)


@triton.jit
def coverage_top(gain, chosen, e_ok):
    """The coverage greedy's candidates' gains (``-1`` off them) and their maximum."""
    key = tl.where(e_ok & (chosen == 0), gain, -1)
    return key, tl.max(key, axis=0)


@triton.jit
def coverage_first(key, top, agg, e):
    """The coverage greedy's next expert: the gain ``top`` (the largest in ``key``), ties to the larger
    aggregate, then the lower index.  One reduction: the tie-break is one int64 key
    ``agg << 10 | (1023 - e)`` (coverage aggregates stay below 2**53: fewer than 2**29 rows of at most
    2**24 each; ids below 1024)."""
    order = (agg << 10) | (1023 - e).to(tl.int64)
    return 1023 - (tl.max(tl.where(key == top, order, -1), axis=0) & 1023).to(tl.int32)


@triton.jit
def coverage_loss(q, chosen, e, pick):
    """What keeping ``pick`` takes from every expert's coverage gain, summed over the rows of ``q``.

    ``q`` [rows, E] int64 holds the rows' fixed-point scores (zero rows add nothing), read on the
    greedy's grid ``c = q >> 8``.  A row is covered to ``m = sum of c over chosen``; the pick raises
    it to ``m + c[:, pick]``; each expert's term ``c * max(ONE - m, 0)`` drops by ``c`` times the
    difference of the two clamps.  Exact: the same integer terms the full recount sums.
    """
    c = q >> (SCORE_BITS - COVER_BITS)
    covered = tl.sum(tl.where(chosen[None, :] != 0, c, 0), axis=1)
    picked = tl.sum(tl.where(e[None, :] == pick, c, 0), axis=1)
    left = tl.where(covered < COVER_ONE, COVER_ONE - covered, 0)
    after = covered + picked
    left_after = tl.where(after < COVER_ONE, COVER_ONE - after, 0)
    return tl.sum(c * (left - left_after)[:, None], axis=0)


@triton.jit
def coverage_pair_picks(
    tie,
    picks,
    cover_agg_ptr,
    cover_pairs_ptr,
    num_experts,
    BLOCK_E: tl.constexpr,
    WARPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """The coverage greedy's picks from the pair sums, then the rest of ``picks`` in the order (agg
    desc, index asc) ([BLOCK_E] int32, 1 per kept expert), with no barrier per pick: as
    :func:`coact_picks`, two [WARPS, SUB] tiles of copies of the gains (int64 rows: up to 64 experts
    a row, so up to 128 experts), each pick two int32 warp maxima and one load of the picked row of
    pair sums in each warp.

    Before any pick every row is uncovered: a gain is COVER_ONE times the column sum; keeping an
    expert takes its row of C (the pair sums) off every gain.  Each pick is the maximum of
    ``gain << 20 | (1023 - tie) << 10 | e``, with ``tie`` the expert's place in the order (agg desc,
    index asc): gains stay below 2**42 (at most 1024 tokens of 2**32 each), places and ids below
    1024, so the key is below 2**62.  A pick is made while the best gain is positive (gains never
    grow); at most ``min(picks, experts with a positive column sum)`` steps.  The rest are the free
    experts of the smallest places: the smallest bound with ``rest`` free experts below it (places
    are distinct), by bisection."""
    SUB: tl.constexpr = BLOCK_E // 2
    e_a = tl.arange(0, SUB)[None, :] + tl.zeros([WARPS, 1], tl.int32)
    e_b = e_a + SUB
    ok_a = e_a < num_experts
    ok_b = e_b < num_experts
    gain_a = tl.load(cover_agg_ptr + e_a, mask=ok_a, other=0, cache_modifier=".cg") << COVER_BITS
    gain_b = tl.load(cover_agg_ptr + e_b, mask=ok_b, other=0, cache_modifier=".cg") << COVER_BITS
    tie_a, tie_b = warp_halves(tie, SUB, WARPS)
    low_a = (((1023 - tie_a) << 10) | e_a).to(tl.int64)
    low_b = (((1023 - tie_b) << 10) | e_b).to(tl.int64)
    chosen_a = tl.zeros([WARPS, SUB], tl.int32)
    chosen_b = tl.zeros([WARPS, SUB], tl.int32)
    gaining = tl.sum((gain_a > 0).to(tl.int32), axis=1) + tl.sum((gain_b > 0).to(tl.int32), axis=1)
    steps = tl.minimum(tl.max(gaining, axis=0), picks)
    for _ in range(0, steps):
        best = warp_key_max(
            tl.where(ok_a & (chosen_a == 0), (gain_a << 20) | low_a, 0),
            tl.where(ok_b & (chosen_b == 0), (gain_b << 20) | low_b, 0),
        )
        live = best >= (1 << 20)  # a positive gain
        first = tl.where(live, best & 1023, -1).to(tl.int32)
        chosen_a = tl.where(e_a == first, 1, chosen_a)
        chosen_b = tl.where(e_b == first, 1, chosen_b)
        row = cover_pairs_ptr + first.to(tl.int64) * num_experts
        gain_a -= tl.load(row + e_a, mask=ok_a & live, other=0, cache_modifier=".cg")
        gain_b -= tl.load(row + e_b, mask=ok_b & live, other=0, cache_modifier=".cg")
    free_a = ok_a & (chosen_a == 0)
    free_b = ok_b & (chosen_b == 0)
    rest = picks - tl.sum(chosen_a, axis=1)[:, None] - tl.sum(chosen_b, axis=1)[:, None]
    lo = tl.zeros([WARPS, 1], tl.int32)
    hi = tl.zeros([WARPS, 1], tl.int32) + BLOCK_E
    for _ in tl.static_range(0, SEARCH_STEPS):
        mid = (lo + hi) // 2
        below = tl.sum((free_a & (tie_a < mid)).to(tl.int32), axis=1) + tl.sum(
            (free_b & (tie_b < mid)).to(tl.int32), axis=1
        )
        enough = below[:, None] >= rest
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    chosen_a = tl.where(free_a & (tie_a < hi), 1, chosen_a)
    chosen_b = tl.where(free_b & (tie_b < hi), 1, chosen_b)
    # the copies are equal: one of them, the halves joined
    return tl.reshape(tl.permute(tl.join(tl.max(chosen_a, axis=0), tl.max(chosen_b, axis=0)), (1, 0)), [BLOCK_E])


@triton.jit
def add_coverage_rows(coverage, call, policy, q, rank, row_ok, rows, in_block, e, e_ok, READ: tl.constexpr):
    """A tile's part of the coverage greedy's inputs, from its fixed-point scores ``q`` [rows, E]: with
    ``READ.COVER_PAIRS`` (top-k scores above one program) its pair sums added into ``C``; otherwise every
    row's scores stored (0 on rows that do not vote), and with ``READ.COVER_LISTS`` each voting row joins
    the list of every expert it scores, so a pick revisits only the rows whose coverage it changes."""
    if READ.COVER_PAIRS:
        # each voting row adds c[t, i] * c[t, j] to C[i, j] for every pair of its scored experts, one
        # of its picks at a time
        cq = tl.where(row_ok[:, None], q, 0) >> (SCORE_BITS - COVER_BITS)
        # a score and its expert in one int32 (c <= 2**16, ids below 1024): one reduction per pick
        packed = (cq.to(tl.int32) << 10) | e[None, :]
        for b in range(0, policy.top_k):
            picked_b = tl.sum(tl.where(rank == b, packed, 0), axis=1)
            id_b = picked_b & 1023
            cq_b = (picked_b >> 10).to(tl.int64)
            # (the diagonal is never read: a kept expert's own gain no longer counts)
            tl.atomic_add(
                coverage.cover_pairs_ptr + id_b.to(tl.int64)[:, None] * call.num_experts + e[None, :],
                cq * cq_b[:, None],
                mask=(in_block & (cq_b != 0))[:, None] & (cq != 0) & (e[None, :] != id_b[:, None]),
                sem="relaxed",
            )
    else:
        tl.store(
            coverage.row_scores_ptr + rows[:, None] * call.num_experts + e[None, :],
            tl.where(row_ok[:, None], q, 0).to(tl.int32),
            mask=in_block[:, None] & e_ok[None, :],
        )
        if READ.COVER_LISTS:
            listed = (in_block & row_ok)[:, None] & e_ok[None, :] & (q != 0)
            slot = tl.atomic_add(
                coverage.cover_count_ptr + (e[None, :] + 0 * rows[:, None]), 1, mask=listed, sem="relaxed"
            )
            tl.store(
                coverage.cover_rows_ptr + e[None, :] * coverage.cover_capacity + slot,
                rows[:, None] + 0 * e[None, :],
                mask=listed,
            )
