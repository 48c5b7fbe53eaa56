"""Triton kernels of the ``lynx`` policy (jit code only; launched from ``selection.py``).

Three launches before the common ``finalize_kernel``:

1. ``lynx_count_kernel`` - per block of tokens: bins ``max(-beta, ceil(alpha (l - max l)))`` in
   float64, and per-program counts of tokens per (expert, bin).  (When a ``max_experts`` cap needs
   score aggregates, the wrapper also runs ``token_pass_kernel``.)
2. ``lynx_rank_kernel`` - one program: total counts, the base-n digits of ``s[e] * n**beta``, and each
   expert's exact rank by ``s`` (a digit-by-digit comparison, no floating point).
3. ``lynx_pick_kernel`` - per block of tokens: each token picks ``top_k`` experts by (bin desc,
   s desc, logit desc, index asc); per-program unions of the picks feed ``finalize_kernel``.
"""

import triton
import triton.language as tl

from ._select import load_logits, num_valid_tokens


@triton.jit
def lynx_bins(x, alpha, beta):
    """Bins of a [rows, experts] float32 tile, int32 in [-beta, 0]; -inf entries fall in -beta."""
    wide = x.to(tl.float64)
    top = tl.max(wide, axis=1)[:, None]
    top = tl.where(top > float("-inf"), top, 0.0)  # a row with no finite logit: every bin is -beta
    scaled = tl.ceil(alpha * (wide - top))
    return tl.maximum(scaled, -beta).to(tl.int32)


@triton.jit
def lynx_count_kernel(
    logits_ptr,
    stride_t,
    stride_e,
    num_tokens,
    num_experts,
    n_valid_ptr,
    n_valid_arg,
    counts_part_ptr,
    rows_per_program,
    alpha,
    beta,
    weights_ptr,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_BINS: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    bin_id = tl.arange(0, BLOCK_BINS)
    counts = tl.zeros([BLOCK_E, BLOCK_BINS], tl.int32)
    first_row = pid * rows_per_program
    for c in range(0, rows_per_program, CHUNK_T):
        x, row_ok, _ = load_logits(
            logits_ptr,
            stride_t,
            stride_e,
            first_row,
            c,
            rows_per_program,
            n_valid,
            e,
            e_ok,
            weights_ptr,
            HAS_WEIGHTS,
            CHUNK_T,
        )
        depth = -lynx_bins(x, alpha, beta)  # 0 .. beta
        for j in tl.static_range(BLOCK_BINS):
            in_bin = tl.sum(((depth == j) & row_ok[:, None]).to(tl.int32), axis=0)
            counts = tl.where(bin_id[None, :] == j, counts + in_bin[:, None], counts)
    counts_ptrs = counts_part_ptr + (pid * num_experts + e)[:, None] * BLOCK_BINS + bin_id[None, :]
    tl.store(counts_ptrs, counts, mask=e_ok[:, None])


@triton.jit
def lynx_rank_kernel(
    counts_part_ptr,
    num_parts,
    n_valid_ptr,
    n_valid_arg,
    num_tokens,
    digits_ptr,
    s_rank_ptr,
    num_experts,
    beta,
    HAS_NV_PTR: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    bin_id = tl.arange(0, BLOCK_BINS)
    base = tl.maximum(num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR), 1)
    counts = tl.zeros([BLOCK_E, BLOCK_BINS], tl.int64)
    for p in range(0, num_parts):
        ptrs = counts_part_ptr + (p * num_experts + e)[:, None] * BLOCK_BINS + bin_id[None, :]
        counts += tl.load(ptrs, mask=e_ok[:, None], other=0).to(tl.int64)
    # s * n**beta = sum_j counts[:, j] * n**(beta - j); carry into base-n digits, least significant
    # (bin -beta) first.  Digit i of expert e goes to digits[e, i], i = 0 .. beta + 1.
    num_digits = beta + 2
    carry = tl.zeros([BLOCK_E], tl.int64)
    for i in range(0, beta + 1):
        value = tl.sum(tl.where(bin_id[None, :] == beta - i, counts, 0), axis=1) + carry
        tl.store(digits_ptr + e * BLOCK_BINS + i, value % base, mask=e_ok)
        carry = value // base
    tl.store(digits_ptr + e * BLOCK_BINS + beta + 1, carry, mask=e_ok)
    tl.debug_barrier()
    # rank: how many experts have a strictly larger s (most significant digit decides first)
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
    tl.store(s_rank_ptr + e, num_experts - 1 - larger, mask=e_ok)


@triton.jit
def lynx_pick_kernel(
    logits_ptr,
    stride_t,
    stride_e,
    num_tokens,
    num_experts,
    n_valid_ptr,
    n_valid_arg,
    s_rank_ptr,
    base_part_ptr,
    rows_per_program,
    top_k,
    alpha,
    beta,
    weights_ptr,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    s_rank = tl.load(s_rank_ptr + e, mask=e_ok, other=-1)
    picked_any = tl.zeros([BLOCK_E], tl.int32)
    first_row = pid * rows_per_program
    for c in range(0, rows_per_program, CHUNK_T):
        x, row_ok, _ = load_logits(
            logits_ptr,
            stride_t,
            stride_e,
            first_row,
            c,
            rows_per_program,
            n_valid,
            e,
            e_ok,
            weights_ptr,
            HAS_WEIGHTS,
            CHUNK_T,
        )
        bins = lynx_bins(x, alpha, beta)
        open_ = (x > float("-inf")) & row_ok[:, None]
        picked = tl.zeros(x.shape, tl.int32)
        for _ in range(0, top_k):
            best_bin = tl.max(tl.where(open_, bins, -2147483647), axis=1)
            tie = open_ & (bins == best_bin[:, None])
            best_s = tl.max(tl.where(tie, s_rank[None, :], -1), axis=1)
            tie = tie & (s_rank[None, :] == best_s[:, None])
            best_logit = tl.max(tl.where(tie, x, float("-inf")), axis=1)
            tie = tie & (x == best_logit[:, None])
            first = tl.min(tl.where(tie, e[None, :], BLOCK_E), axis=1)
            chosen = e[None, :] == first[:, None]
            picked = tl.where(chosen, 1, picked)
            open_ = open_ & (~chosen)
        picked_any = tl.maximum(picked_any, tl.max(picked, axis=0))
    tl.store(base_part_ptr + pid * num_experts + e, picked_any.to(tl.int8), mask=e_ok)
