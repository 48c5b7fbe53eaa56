"""LYNX: bins of each token's logits below its best, a batch order by bins, per-token picks.

A token's bin depth of an expert is ``min(beta, ceil(alpha * (max - l)))``; the batch orders experts by
``s = sum_t n ** bin`` (one int64 while ``n ** (beta + 1) < 2**61``, base-n digits compared through
memory above), and each voting token picks its top_k by (bin desc, s desc, logit desc, index asc) as
one int64 key. Bin counts are 4-bit fields of one int64 per expert (a tile has at most 15 rows).
"""

import triton
import triton.language as tl

from .keys import pack_key
from .numerics import floor_div
from .rows import load_rows


@triton.jit
def lynx_depths(x, alpha, beta):
    """LYNX bin depths ``-max(-beta, ceil((l - max) * alpha))`` in [0, beta], int32, float32 steps."""
    top = tl.max(x, axis=1)
    top = tl.where(top > float("-inf"), top, 0.0)
    scaled = tl.ceil((x - top[:, None]) * alpha)
    return -tl.maximum(scaled, 0.0 - beta).to(tl.int32)


@triton.jit
def lynx_bin_counts(x, row_ok, e, alpha, beta, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_BINS: tl.constexpr):
    """[BLOCK_E, BLOCK_BINS] int32: the voting rows of a [ROWS, BLOCK_E] tile per (expert, LYNX bin).

    Each entry adds ``16 ** depth`` to its expert's int64: with at most 15 rows a bin's count fits its
    4 bits without carrying into the next, and 15 bins (depth <= beta <= 14) fill 60 bits.  One sum down
    the rows, then each bin is four bits of it.  (``tl.histogram`` over ``e * BLOCK_BINS + depth``
    spilled hundreds of registers at E=256 on sm_90, and its ``mask`` argument miscounted padding rows
    on an H200 with Triton 3.6.)"""
    tl.static_assert(ROWS <= 15, "LYNX bin counts pack up to 15 rows per 4-bit field")
    depth = lynx_depths(x, alpha, beta).to(tl.int64)
    code = tl.where(row_ok[:, None] & (e[None, :] >= 0), tl.full([], 1, tl.int64) << (depth * 4), 0)
    packed = tl.sum(code, axis=0)
    bin_shift = (tl.arange(0, BLOCK_BINS) * 4).to(tl.int64)
    return ((packed[:, None] >> bin_shift[None, :]) & 15).to(tl.int32)


@triton.jit
def lynx_s_ranks(
    counts,
    base,
    digits_ptr,
    num_experts,
    beta,
    e,
    e_ok,
    BLOCK_E: tl.constexpr,
    BLOCK_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Exact rank of every expert by ``s[e] = sum_t n ** bin[t, e]``: equal s, equal rank; higher s,
    higher rank.  ``counts`` [BLOCK_E, BLOCK_BINS] int64: tokens per (expert, bin).

    ``s * n**beta = sum_b counts[e, b] * n**(beta - b)`` is at most ``n**(beta + 1)``.  While that
    stays below 2**61 (every call with beta <= 4 and n <= 5000 voting tokens) it is one int64 per
    expert: one weighted sum over the bins and one [E, E] comparison rank it.  Above, it is carried
    into base-n digits (through ``digits_ptr``) and compared digit by digit."""
    bin_id = tl.arange(0, BLOCK_BINS)
    # n ** (beta + 1) < 2**61, with a margin far wider than float32's rounding of log2
    if (beta + 1) * tl.log2(base.to(tl.float32)) < 61.0:
        weight = tl.where(bin_id <= beta, 1, 0).to(tl.int64)
        for i in range(0, beta):
            weight = tl.where(bin_id < beta - i, weight * base, weight)
        s = tl.sum(counts * weight[None, :], axis=1)
        # through memory once: compared across all pairs in the layout of the sum over bins, the
        # [E, E] comparison spilled thousands of registers at E=256 on sm_90; reloaded, it takes the
        # layout of a plain [E] vector and spills none
        tl.store(digits_ptr + e, tl.where(e_ok, s, -1))  # s >= 0: a padded expert is never larger
        tl.debug_barrier()
        s_e = tl.load(digits_ptr + e)
        larger = tl.sum((s_e[:, None] > s_e[None, :]).to(tl.int32), axis=0)
    else:
        num_digits = beta + 2
        carry = tl.zeros([BLOCK_E], tl.int64)
        for i in range(0, beta + 1):
            value = tl.sum(tl.where(bin_id[None, :] == beta - i, counts, 0), axis=1) + carry
            carry = floor_div(value, base)
            tl.store(digits_ptr + e * BLOCK_BINS + i, value - carry * base, mask=e_ok)
        tl.store(digits_ptr + e * BLOCK_BINS + beta + 1, carry, mask=e_ok)
        tl.debug_barrier()
        larger = tl.zeros([BLOCK_E], tl.int32)
        for j0 in range(0, BLOCK_E, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            j_ok = j < num_experts
            greater = tl.zeros([CHUNK, BLOCK_E], tl.int32)
            equal = tl.zeros([CHUNK, BLOCK_E], tl.int32) + 1
            for k in range(0, num_digits):
                i = num_digits - 1 - k
                d_j = tl.load(digits_ptr + j * BLOCK_BINS + i, mask=j_ok, other=0)
                d_e = tl.load(digits_ptr + e * BLOCK_BINS + i, mask=e_ok, other=0)
                greater = tl.where((equal != 0) & (d_j[:, None] > d_e[None, :]), 1, greater)
                equal = tl.where(d_j[:, None] == d_e[None, :], equal, 0)
            larger += tl.sum(tl.where(j_ok[:, None], greater, 0), axis=0)
    return num_experts - 1 - larger


@triton.jit
def lynx_picks(
    call,
    policy,
    first_row,
    end_row,
    n_valid,
    s_rank,
    e,
    e_ok,
    HAS_WEIGHTS: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    """Union of the LYNX picks of the voting rows in [first_row, end_row): each row's top_k by (bin
    desc, s desc, logit desc, index asc).  ``call`` and ``policy`` are the kernel's bundles (``policy``
    holds ``top_k``, ``alpha`` and ``beta``)."""
    alpha = policy.alpha
    beta = policy.beta
    picked_any = tl.zeros([BLOCK_E], tl.int32)
    for c in range(first_row, end_row, CHUNK_T):
        rows = c + tl.arange(0, CHUNK_T)
        x, row_ok, _ = load_rows(
            call.logits_ptr,
            call.stride_t,
            call.stride_e,
            rows,
            rows < end_row,
            n_valid,
            e,
            e_ok,
            call.weights_ptr,
            HAS_WEIGHTS,
        )
        depth = lynx_depths(x, alpha, beta)
        open_ = (x > float("-inf")) & row_ok[:, None] & e_ok[None, :]
        # one int64 key per entry, so each pick is one max: (bin desc, s desc) as an integer below
        # (beta + 1) * BLOCK_E <= 2**13 in bits 42 and up, (logit desc, index asc) as a packed key
        # (|key| < 2**41 at any width) offset to non-negative below them; -1 where not open
        coarse = (beta - depth).to(tl.int64) * BLOCK_E + s_rank[None, :].to(tl.int64)
        fine = pack_key(x, e[None, :], open_, KEY_SHIFT).to(tl.int64) + (1 << 41)
        key = tl.where(open_, (coarse << 42) | fine, -1)
        picked = tl.zeros(x.shape, tl.int32)
        for _ in range(0, policy.top_k):
            best = tl.max(key, axis=1)
            chosen = (key == best[:, None]) & (best[:, None] >= 0)
            picked = tl.where(chosen, 1, picked)
            key = tl.where(chosen, -1, key)
        picked_any = tl.maximum(picked_any, tl.max(picked, axis=0))
    return picked_any


@triton.jit
def lynx_order(
    lynx,
    call,
    policy,
    counts,
    n_valid,
    e,
    e_ok,
    ROWS: tl.constexpr,
    SCORES: tl.constexpr,
    READ: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """In the selection's last program: the experts' ranks by LYNX's batch order ``s`` from the call's
    bin counts [E, BINS]; in one program also every row's picks, whose union it returns [E] int32;
    above, it stores the ranks for ``lynx_pick_kernel``, which takes the picks and finishes the mask
    (returns zeros).  The constexpr bundles are the selection kernel's
    (:mod:`xshare_sglang.kernels.bundles`)."""
    BLOCK_BINS: tl.constexpr = READ.BLOCK_BINS
    s_rank = lynx_s_ranks(
        counts.to(tl.int64),
        tl.maximum(n_valid, 1),
        lynx.digits_ptr,
        call.num_experts,
        policy.beta,
        e,
        e_ok,
        BLOCK_E,
        BLOCK_BINS,
        READ.LYNX_CHUNK,
    )
    if SINGLE:
        return lynx_picks(
            call,
            policy,
            0,
            call.num_tokens,
            n_valid,
            s_rank,
            e,
            e_ok,
            ROWS.HAS_WEIGHTS,
            SCORES.KEY_SHIFT,
            BLOCK_E,
            READ.CHUNK_T,
        )
    else:
        tl.store(lynx.s_rank_ptr + e, s_rank, mask=e_ok)
        return tl.zeros([BLOCK_E], tl.int32)
