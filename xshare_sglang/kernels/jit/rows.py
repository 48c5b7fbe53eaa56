"""Reading a tile of router logits: the real-token count, sanitized logits and each row's ranks.

Rows at or after the real-token count (CUDA-graph padding) and rows of vote weight 0 read as -inf; NaN
logits are -inf, +inf the largest float32, -0 is +0.
"""

import triton
import triton.language as tl

from .keys import lowest_key
from .numerics import FP32_MAX, SCORE_ONE


@triton.jit
def num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR: tl.constexpr):
    """Real-token count, clamped to [0, num_tokens]; read from the device when given as a tensor."""
    if HAS_NV_PTR:
        n = tl.load(n_valid_ptr).to(tl.int64)
    else:
        n = tl.full([], n_valid_arg, tl.int64)
    return tl.minimum(tl.maximum(n, 0), num_tokens)


@triton.jit
def sanitize_logits(x):
    """Logits as float32 the kernels compare: NaN -> -inf, +inf -> the largest float32, -0 -> +0."""
    x = x.to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    return tl.where(x == float("inf"), FP32_MAX, x) + 0.0


@triton.jit
def load_bias(bias_ptr, e, e_ok):
    """The correction bias of experts ``e`` (0 outside ``e_ok``), float32: NaN -> 0, infinities -> the
    float32 extremes."""
    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    bias = tl.where(bias != bias, 0.0, bias)
    return tl.minimum(tl.maximum(bias, -3.4028234663852886e38), FP32_MAX)


@triton.jit
def load_rows(
    logits_ptr,
    stride_t,
    stride_e,
    rows,
    rows_in_block,
    n_valid,
    e,
    e_ok,
    weights_ptr,
    HAS_WEIGHTS: tl.constexpr,
):
    """A [rows, BLOCK_E] float32 tile of sanitized logits (NaN -> -inf, +inf -> max, -0 -> +0).

    Rows outside the block, at/after ``n_valid`` (padding) or of vote weight 0 read as -inf.
    Returns the tile, which rows vote, and their fixed-point weights ``floor(w * 2**24)`` (int64).
    """
    row_ok = rows_in_block & (rows < n_valid)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        w = tl.where(w != w, 0.0, w)
        w = tl.minimum(tl.maximum(w, 0.0), 1.0)
        row_ok = row_ok & (w > 0)
        wq = tl.floor(w * SCORE_ONE).to(tl.int64)
    else:
        wq = tl.zeros(rows.shape, tl.int64) + (1 << 24)
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + e[None, :] * stride_e
    x = sanitize_logits(tl.load(ptrs, mask=row_ok[:, None] & e_ok[None, :], other=float("-inf")))
    return x, row_ok, wq


@triton.jit
def row_ranks(key, n_iter, KEY_SHIFT: tl.constexpr):
    """Place of each expert in its row's key order for the first ``n_iter`` places (``n_iter`` for
    the rest and for unset keys), int32."""
    lowest = lowest_key(KEY_SHIFT)
    rank = tl.zeros(key.shape, tl.int32) + n_iter
    work = key
    for i in range(0, n_iter):
        best = tl.max(work, axis=1)
        chosen = (work == best[:, None]) & (best[:, None] > lowest)
        rank = tl.where(chosen, i, rank)
        work = tl.where(chosen, lowest, work)
    return rank
