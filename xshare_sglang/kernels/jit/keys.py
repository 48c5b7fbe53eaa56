"""Packed integer keys: an order over experts as one integer comparison.

A key holds an order-preserving copy of a value above the inverted expert index (``value << 10 |
(1023 - e)``), so one maximum finds the highest value with ties to the lower index, the reference's
stable order. With bfloat16 or float16 logits the keys are int32 (:func:`pack_key`): a 16-bit
float's float32 bits below its mantissa are zero, so the shifted ordered bits of distinct values stay
distinct and ordered. Where a row lies in one warp, an int64 key's maximum is two int32 warp maxima
(``REDUX`` on sm_90): the value half, then the index half among the value's ties.
"""

import triton
import triton.language as tl

from .numerics import FP32_MAX

MIN_KEY = tl.constexpr(-(2**62))  # below every packed int64 key
MIN_KEY32 = tl.constexpr(-(2**31))  # below every packed int32 key
INF_ORDERED = tl.constexpr(0x7F800000)  # ordered bits of +inf: the rank of a sanitized +inf logit
ID_BITS = tl.constexpr(10)  # packed keys hold expert ids < 1024
ID_MASK = tl.constexpr(1023)


@triton.jit
def ordered_bits(v):
    """An int32 whose signed order is the float32 order of ``v`` (-0.0 must be canonicalized)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def unordered_value(ordered):
    """Inverse of :func:`ordered_bits`."""
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pack_key(v, e, ok, KEY_SHIFT: tl.constexpr):
    """Key of the order (value desc, index asc): ``v`` high, ``1023 - e`` low, the lowest key of its
    type where not ``ok``.

    ``KEY_SHIFT = 0``: int64, any float32 ``v``.  ``KEY_SHIFT = 16`` (bfloat16 logits) or ``13``
    (float16): int32, for ``v`` that hold a 16-bit float's value (the float32 bits below the 16-bit
    mantissa are zero), or ``FP32_MAX`` (a sanitized +inf), which ranks above every finite 16-bit value
    as in float32.  The shifted ordered bits of distinct 16-bit values are distinct and keep their
    order, so an int32 key ranks exactly as the int64 key would, with half the work per comparison.
    """
    if KEY_SHIFT == 0:
        key = (ordered_bits(v).to(tl.int64) << ID_BITS) | (e.to(tl.int64) ^ ID_MASK)
        return tl.where(ok, key, MIN_KEY)
    else:
        high = tl.where(v == FP32_MAX, INF_ORDERED >> KEY_SHIFT, ordered_bits(v) >> KEY_SHIFT)
        return tl.where(ok, (high << ID_BITS) | (e ^ ID_MASK), MIN_KEY32)


@triton.jit
def lowest_key(KEY_SHIFT: tl.constexpr):
    """The key below every packed key of this width (:func:`pack_key`)."""
    if KEY_SHIFT == 0:
        return MIN_KEY
    else:
        return MIN_KEY32


@triton.jit
def key_expert(key):
    """Expert id of a packed key."""
    return ((key & ID_MASK) ^ ID_MASK).to(tl.int32)


@triton.jit
def key_value(key):
    return unordered_value((key >> ID_BITS).to(tl.int32))


@triton.jit
def key_logit(key, KEY_SHIFT: tl.constexpr):
    """The float32 value packed into a key by :func:`pack_key`, exactly (a sanitized +inf gives
    ``FP32_MAX`` back).  At ``KEY_SHIFT`` > 0 the dropped low bits of the ordered bits are zero for
    a non-negative value and ones for a negative one, whose bits are then the shifted high part
    xor the shifted flip mask."""
    if KEY_SHIFT == 0:
        return key_value(key)
    else:
        high = key >> ID_BITS
        bits = tl.where(high >= 0, high, high ^ (0x7FFFFFFF >> KEY_SHIFT)) << KEY_SHIFT
        value = bits.to(tl.float32, bitcast=True)
        return tl.where(value == float("inf"), FP32_MAX, value)


@triton.jit
def order_key(prim, e, flag):
    """int64 key of the order (prim desc, index asc) for ``0 <= prim < 2**53``: ``prim`` high, the
    inverted expert index low, so one integer comparison decides; ``MIN_KEY`` where not ``flag``."""
    return tl.where(flag, (prim << ID_BITS) | (e ^ ID_MASK), MIN_KEY)


@triton.jit
def half_key_pick(high, low):
    """One pick per row of [rows, n] int64 keys held as halves: ``high`` their value bits (int32,
    ``MIN_KEY32`` where taken or not a candidate), ``low`` their inverted index (distinct in a row).
    Two int32 maxima (one ``REDUX`` each when a row is in one warp); returns the picked key
    (``MIN_KEY`` when none is left) and its index half, [rows] each."""
    best_high = tl.max(high, axis=1)
    best_low = tl.max(tl.where(high == best_high[:, None], low, -1), axis=1)
    best = tl.where(best_high > MIN_KEY32, (best_high.to(tl.int64) << ID_BITS) | best_low, MIN_KEY)
    return best, best_low


@triton.jit
def warp_halves(x, SUB: tl.constexpr, WARPS: tl.constexpr):
    """A [2 * SUB] vector as two [WARPS, SUB] tiles (experts [0, SUB) and [SUB, 2 * SUB)), each row a
    copy: the picks below hold one copy per warp."""
    low, high = tl.split(tl.permute(tl.reshape(x, [2, SUB]), (1, 0)))
    return tl.broadcast_to(low[None, :], [WARPS, SUB]), tl.broadcast_to(high[None, :], [WARPS, SUB])


@triton.jit
def warp_max(a, b):
    """Each row's maximum over two [rows, SUB] tiles, as [rows, 1]: a row sits in one warp, so no
    barrier (int32: one ``REDUX`` per tile on sm_90)."""
    return tl.maximum(tl.max(a, axis=1), tl.max(b, axis=1))[:, None]


@triton.jit
def warp_key_max(key_a, key_b):
    """Each row's maximum of two [rows, SUB] tiles of int64 keys in [0, 2**62), as [rows, 1]: two int32
    maxima, the bits from 31 up, then the low 31 bits among the keys holding that high part."""
    high_a = (key_a >> 31).to(tl.int32)
    high_b = (key_b >> 31).to(tl.int32)
    best_high = warp_max(high_a, high_b)
    low_a = tl.where(high_a == best_high, (key_a & 0x7FFFFFFF).to(tl.int32), -1)
    low_b = tl.where(high_b == best_high, (key_b & 0x7FFFFFFF).to(tl.int32), -1)
    return (best_high.to(tl.int64) << 31) | warp_max(low_a, low_b)
