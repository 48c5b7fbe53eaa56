"""The experts' order and the greedy picks the set rules are built from.

An order over experts is one comparison of packed keys across all pairs in registers and one column
sum (:func:`places`); a prefix by mass is one sort and one running sum (:func:`prefix_keep`).
"""

import triton
import triton.language as tl

from .keys import ID_BITS, MIN_KEY, order_key


@triton.jit
def places(prim, flag, e, e_ok, group, USE_GROUP: tl.constexpr):
    """For every expert: how many flagged experts (of its group, with ``USE_GROUP``) come before it in
    the order (prim desc, index asc), int32.  All pairs at once in registers: one [E, E] comparison of
    packed keys and one sum down the columns (the compiler moves the vector across threads once).

    With groups (``0 <= group < 2**20``), the global places ``p`` come first; then ``group * 1024 + p``
    (places are below 1024: E <= 512) orders the experts by group and, inside a group, as ``prim``
    does.  A flagged expert j is before e in e's group exactly when its composite key less e's group
    start, as an unsigned number, is below ``p[e]``: lower groups wrap to large values, higher groups
    are at least 1024.  One int32 comparison per pair.  (A mask of group equality and-ed with the key
    comparison spilled over 500 registers to local memory at E=256 on sm_90.)"""
    key_e = order_key(prim, e, e_ok)
    key_j = order_key(prim, e, flag & e_ok)
    before = tl.sum((key_j[:, None] > key_e[None, :]).to(tl.int32), axis=0)
    if USE_GROUP:
        group_start = group.to(tl.int32) * 1024
        composite_j = tl.where(flag & e_ok, group_start + before, -1)  # -1: never counted (0xFFFFFFFF)
        offset = (composite_j[:, None] - group_start[None, :]).to(tl.uint32, bitcast=True)
        before = tl.sum((offset < before[None, :].to(tl.uint32)).to(tl.int32), axis=0)
    return before


@triton.jit
def places_scored_first(agg, e_ok):
    """:func:`places` in the order (agg desc, index asc) as far as a count of at least the number of
    experts with an aggregate needs them, int32: each of those at 0 (every one is kept), every other
    expert after them in index order (their count plus an exclusive prefix count).  Exact for any
    count >= #{agg > 0}: aggregates are >= 0, so the scored experts come first in the order, and the
    rest tie at 0, ordered by index."""
    scored = e_ok & (agg > 0)
    rest = (e_ok & (agg <= 0)).to(tl.int32)
    num_scored = tl.sum(scored.to(tl.int32), axis=0)
    return tl.where(scored, 0, num_scored + tl.cumsum(rest, axis=0) - rest)


@triton.jit
def prefix_keep(prim, flag, e, kept_mass, needed):
    """Flagged experts taken in the order (prim desc, index asc) while the mass before each, plus
    ``kept_mass``, is below ``needed`` (the ``prim`` are the masses).  One sort of the packed keys,
    one running sum over the sorted masses; the taken ones are a prefix, so a key comparison with the
    last taken key marks them."""
    key = order_key(prim, e, flag)
    ranked = tl.sort(key, descending=True)
    mass = tl.where(ranked > MIN_KEY, ranked >> ID_BITS, 0)
    before = tl.cumsum(mass, axis=0) - mass
    taken = tl.sum(((ranked > MIN_KEY) & (kept_mass + before < needed)).to(tl.int32), axis=0)
    last = tl.max(tl.where(e == taken - 1, ranked, MIN_KEY), axis=0)
    return flag & (taken > 0) & (key >= last)


@triton.jit
def greedy_iterative(base, agg, e, e_ok, count, active, ALLOW_ZERO: tl.constexpr, BLOCK_E: tl.constexpr):
    """G(S, agg, count) on one vector: ``count`` times, add the best outside expert with agg > 0
    (with ``ALLOW_ZERO``: agg >= 0, the plain top-``count``).  Adds nothing unless ``active``.

    A request's aggregate is below 2**31 (at most 64 rows of at most 2**24), so each pick is the
    maximum of one int64 key ``agg << 10 | (1023 - e)``: the largest aggregate at its first index."""
    chosen = base
    if ALLOW_ZERO:
        candidate = (base == 0) & e_ok & active
    else:
        candidate = (base == 0) & e_ok & (agg > 0) & active
    key = tl.where(candidate, (agg << 10) | (1023 - e), -1)
    for _ in range(0, count):
        # with no candidate left the maximum is -1, which names no expert
        best = tl.max(key, axis=0)
        hit = (e == 1023 - (best & 1023)) & (best >= 0)
        chosen = tl.where(hit, 1, chosen)
        key = tl.where(hit, -1, key)
    return chosen


@triton.jit
def take_by_order(prim, chosen, e, e_ok, rest):
    """``chosen`` plus the ``rest`` first experts outside it in the order (prim desc, index asc): the
    greedy rules' picks once every gain left is zero, all at once.  One sort of the packed keys (they
    are distinct) and the ``rest``-th key as the threshold."""
    flag = e_ok & (chosen == 0)
    key = order_key(prim, e, flag)
    ranked = tl.sort(key, descending=True)
    threshold = tl.max(tl.where(e == rest - 1, ranked, MIN_KEY), axis=0)
    return tl.where(flag & (key >= threshold) & (rest > 0), 1, chosen)
