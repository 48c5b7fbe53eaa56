"""Ranking expert groups in grouped routing (DeepSeek-V2/V3): one int64 key per group.

With a correction bias, groups of two or more candidates first, by the sum of their two best values;
without, by their best value; ties to the lower group. The two best values come from int32 maxima of
the keys' value halves (a tie at the top makes the second best the best again).
"""

import triton
import triton.language as tl

from .keys import ID_BITS, MIN_KEY, MIN_KEY32, key_value, ordered_bits, unordered_value


@triton.jit
def group_order_key(k1, k2, count, g, HAS_BIAS: tl.constexpr, KEY_SHIFT: tl.constexpr):
    """int64 key of a group's rank in grouped routing (higher first, ties to the lower group): with a
    bias, groups of two or more candidates first, by the sum of their two best values; without, by
    their best value.  ``k1``, ``k2``: the group's best and second-best packed keys; ``count``: its
    candidates; ``MIN_KEY`` for a group without candidates."""
    if HAS_BIAS:
        packed = biased_group_key((k1 >> ID_BITS).to(tl.int32), (k2 >> ID_BITS).to(tl.int32), count, g)
    else:
        primary = tl.minimum(count, 1)
        if KEY_SHIFT == 0:
            order = ordered_bits(key_value(k1) + 0.0).to(tl.int64)
        else:
            order = (k1 >> ID_BITS).to(tl.int64)  # the same order as the value's bits
        packed = (primary.to(tl.int64) << 42) | ((order + (1 << 31)) << ID_BITS) | (1023 - g)
        packed = tl.where(count > 0, packed, MIN_KEY)
    return packed


@triton.jit
def biased_group_key(high1, high2, count, g):
    """:func:`group_order_key` of biased routing from the ordered bits (int32) of the group's best
    and second-best values."""
    first = unordered_value(high1)
    score = tl.where(count >= 2, first + unordered_value(high2), first)
    primary = tl.minimum(count, 2)
    order = ordered_bits(score + 0.0).to(tl.int64)
    packed = (primary.to(tl.int64) << 42) | ((order + (1 << 31)) << ID_BITS) | (1023 - g)
    return tl.where(count > 0, packed, MIN_KEY)


@triton.jit
def biased_groups_key(high, count, g, AXIS: tl.constexpr):
    """:func:`biased_group_key` of every group, from the ordered bits (int32) of its candidates'
    values (``MIN_KEY32`` elsewhere) laid along ``AXIS``, the last: the best, the count of its ties and
    the best below it, as int32 maxima (a tie at the top makes the second best the best again)."""
    high1 = tl.max(high, axis=AXIS)
    ties = tl.sum((high == tl.expand_dims(high1, AXIS)).to(tl.int32), axis=AXIS)
    below = tl.max(tl.where(high < tl.expand_dims(high1, AXIS), high, MIN_KEY32), axis=AXIS)
    return biased_group_key(high1, tl.where(ties >= 2, high1, below), count, g)
