"""Numerics the kernels share with :mod:`xshare_sglang.policies.scores`, bit for bit.

``exp32`` and ``sigmoid32`` are the reference's float32 steps; scores are fixed point
(``floor(p * 2**24)``, a row's shares of ``2**30`` units divided exactly with one float64 reciprocal per
row, :func:`share_of_row`); every division that feeds a mask or a metric is correctly rounded
(``div_rn``) or integer. Kernels launch with ``enable_fp_fusion=False`` so no multiply and add fuse
into one rounding.
"""

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)
SCORE_BITS = tl.constexpr(24)
SCORE_ONE = tl.constexpr(16777216.0)  # 2**24
UNIT_ONE = tl.constexpr(1073741824.0)  # 2**30

# exp32 constants: identical to policies.scores
EXP_LOW = tl.constexpr(-87.0)
EXP_HIGH = tl.constexpr(88.0)
LOG2E = tl.constexpr(1.4426950216293335)
LN2_HIGH = tl.constexpr(0.693359375)
LN2_LOW = tl.constexpr(-0.00021219444170128554)
P0 = tl.constexpr(0.00019875691214110702)
P1 = tl.constexpr(0.001398199936375022)
P2 = tl.constexpr(0.008333452045917511)
P3 = tl.constexpr(0.04166579619050026)
P4 = tl.constexpr(0.1666666567325592)
P5 = tl.constexpr(0.5)


@triton.jit
def exp32(x):
    """policies.scores.exp32, step for step."""
    xc = tl.minimum(tl.maximum(x, EXP_LOW), EXP_HIGH)
    n = tl.floor(xc * LOG2E + 0.5)
    r = (xc - n * LN2_HIGH) - n * LN2_LOW
    poly = r * P0 + P1
    poly = poly * r + P2
    poly = poly * r + P3
    poly = poly * r + P4
    poly = poly * r + P5
    y = (poly * (r * r) + r) + 1.0
    ni = n.to(tl.int32)
    half = ni >> 1
    first = ((half + 127) << 23).to(tl.float32, bitcast=True)
    second = ((ni - half + 127) << 23).to(tl.float32, bitcast=True)
    y = (y * first) * second
    return tl.where(x < EXP_LOW, 0.0, tl.where(x > EXP_HIGH, float("inf"), y))


@triton.jit
def sigmoid32(x):
    """policies.scores.sigmoid32: correctly rounded float32 division."""
    denominator = 1.0 + exp32(-x)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), denominator)


@triton.jit
def floor_div(num, den):
    """Exact ``num // den`` for int64 ``0 <= num < 2**55`` and ``0 < den < 2**53`` (broadcast), without
    an int64 division: a float64 quotient is within 2**-28 of the true one (both operands exact in
    float64, two roundings), so its floor is off by at most one, and the remainder corrects it."""
    q = tl.floor(num.to(tl.float64) * (1.0 / den.to(tl.float64))).to(tl.int64)
    rem = num - q * den
    return q + (rem >= den).to(tl.int64) - (rem < 0).to(tl.int64)


@triton.jit
def share_of_row(units):
    """``(units << 24) // sum(units)`` per row of a [rows, E] int64 tile (0 for a row summing to 0);
    units <= 2**30, so the quotient is at most 2**24.  One reciprocal per row, none per element."""
    total = tl.sum(units, axis=1)
    q = floor_div(units << SCORE_BITS, tl.maximum(total, 1)[:, None])
    return tl.where(total[:, None] > 0, q, 0)


@triton.jit
def fixed_scores(x, member, wq, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    """policies.scores.token_scores (times the fixed-point row weights) for a [rows, E] tile, int64."""
    if SIGMOID:
        s = sigmoid32(x)
        if RENORMALIZE:
            units = tl.where(member, tl.floor(s * UNIT_ONE).to(tl.int64), 0)
            q = share_of_row(units)
        else:
            q = tl.where(member, tl.floor(s * SCORE_ONE).to(tl.int64), 0)
    else:
        masked = tl.where(member, x, float("-inf"))
        top = tl.max(masked, axis=1)
        top = tl.where(top > float("-inf"), top, 0.0)
        units = tl.where(member, tl.floor(exp32(masked - top[:, None]) * UNIT_ONE).to(tl.int64), 0)
        q = share_of_row(units)
    if HAS_WEIGHTS:
        q = (q * wq[:, None]) >> SCORE_BITS
    return q


@triton.jit
def threshold_target(total, tau_q):
    """policies.greedy.threshold_target: ceil(tau_q * total / 2**30), exact in int64."""
    high = total >> 23
    low = total & ((1 << 23) - 1)
    a = high * tau_q
    b = low * tau_q
    rest = (a & 127) * (1 << 23) + b
    return (a >> 7) + ((rest + (1 << 30) - 1) >> 30)


@triton.jit
def retained_share(kept_total, total):
    """policies.rewrite.selection_metrics' retained mass: ``floor(float32(kept_total) /
    float32(total) * 2**24)``, a full ``2**24`` when the total is 0 (int64 scalars in and out)."""
    # correctly rounded, as the reference divides (a plain / compiles to an approximate division)
    ratio = tl.math.div_rn(kept_total.to(tl.float32), tl.where(total > 0, total, 1).to(tl.float32))
    return tl.where(total > 0, tl.floor(ratio * SCORE_ONE).to(tl.int64), 1 << 24)
