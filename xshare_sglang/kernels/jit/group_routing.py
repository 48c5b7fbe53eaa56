"""Routing one row of DeepSeek-V3's router (biased sigmoid, 8 groups of 32) on a warp per expert group.

Each lane holds one expert (one sigmoid); a group's two best values and its own top-k are warp maxima;
the group ranking is one [G, G] comparison across the warps; the row's top-k is taken among the groups'
picks in every warp on its own copy. No loop holds a barrier or a shuffle. Exact: the k best of the
row are among the k best of each chosen group.
"""

import triton
import triton.language as tl

from .groups import biased_groups_key
from .keys import ID_BITS, ID_MASK, MIN_KEY, MIN_KEY32, half_key_pick, key_expert, pack_key, warp_halves, warp_max
from .numerics import sigmoid32
from .rows import load_bias, sanitize_logits


@triton.jit
def route_row_by_group_warps(call, routing, rows, rows_in_block, n_valid, keep, ROUTER: tl.constexpr):
    """:func:`route_block` of one row in biased grouped routing (DeepSeek-V3: 8 groups of 32), with
    each of the program's ``BLOCK_G`` warps holding one group (``GROUP_SIZE`` = 32, a lane per expert).

    One warp per row held 8 experts per lane on E=256: eight software sigmoids and every pick a
    maximum over 8 registers.  Here each lane takes one sigmoid; a group's two best values and its
    own top-k are warp maxima (``REDUX``, no barrier); the group ranking and the row's top-k are
    each one comparison across the warps: the k best keys of the row are among the k best of each
    chosen group, and a key's slot is the number of those candidates above it.

    Exact as :func:`route_block`: the same keys and group ranking; keys are distinct within a row
    (the inverted index is their low bits), so the candidates' counts of keys above them are their
    places in the order of picks.  Returns the experts routed to, [BLOCK_E] int32."""
    top_k = routing.top_k
    BLOCK_E: tl.constexpr = ROUTER.BLOCK_E
    BLOCK_G: tl.constexpr = ROUTER.BLOCK_G
    BLOCK_K: tl.constexpr = ROUTER.BLOCK_K
    GROUP_SIZE: tl.constexpr = ROUTER.GROUP_SIZE
    g = tl.arange(0, BLOCK_G)
    e2 = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [G, S]: a group per warp
    row = tl.max(rows, axis=0)
    row_ok = (tl.max(rows_in_block.to(tl.int32), axis=0) != 0) & (row < n_valid)
    if ROUTER.HAS_WEIGHTS:
        w = tl.load(call.weights_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        row_ok = row_ok & (w == w) & (w > 0)  # as load_rows: a row of vote weight 0 is not routed
    x = tl.load(
        call.logits_ptr + row.to(tl.int64) * call.stride_t + e2 * call.stride_e, mask=row_ok, other=float("-inf")
    )
    x = sanitize_logits(x)
    candidates = (x > float("-inf")) & (tl.reshape(keep, [BLOCK_G, GROUP_SIZE]) != 0)
    bias = load_bias(routing.bias_ptr, e2, e2 >= 0)
    score_bits = sigmoid32(x).to(tl.int32, bitcast=True)  # a sigmoid's bits order as its value
    key = pack_key(score_bits.to(tl.float32, bitcast=True) + bias, e2, candidates, 0)
    # the int64 keys as (value bits, inverted index) halves: each maximum is two int32 warp maxima
    high = tl.where(candidates, (key >> ID_BITS).to(tl.int32), MIN_KEY32)
    low = (key & ID_MASK).to(tl.int32)
    # rank the groups (group_order_key): each group's two best values and its candidates, in its warp
    group_key = biased_groups_key(high, tl.sum(candidates.to(tl.int32), axis=1), g, 1)
    above = tl.sum((group_key[None, :] > group_key[:, None]).to(tl.int32), axis=1)
    chosen = (above < routing.topk_group)[:, None]
    high = tl.where(chosen, high, MIN_KEY32)
    # each group's top-k in its warp: the key and the sigmoid's bits of every pick
    slot = tl.arange(0, BLOCK_K)
    group_keys = tl.zeros([BLOCK_G, BLOCK_K], tl.int64) + MIN_KEY
    group_bits = tl.zeros([BLOCK_G, BLOCK_K], tl.int32)
    for i in range(0, top_k):
        best, best_low = half_key_pick(high, low)
        bits = tl.max(tl.where(low == best_low[:, None], score_bits, 0), axis=1)
        group_keys = tl.where(slot[None, :] == i, best[:, None], group_keys)
        group_bits = tl.where(slot[None, :] == i, bits[:, None], group_bits)
        high = tl.where(low == best_low[:, None], MIN_KEY32, high)
    # the row's top-k among the groups' picks, in every warp on its own copy of them: two [G, SUB]
    # halves, a row per warp (SUB = G * K / 2 <= 32 lanes, see group_warp_routing)
    SUB: tl.constexpr = BLOCK_G * BLOCK_K // 2
    keys_a, keys_b = warp_halves(tl.reshape(group_keys, [2 * SUB]), SUB, BLOCK_G)
    bits_a, bits_b = warp_halves(tl.reshape(group_bits, [2 * SUB]), SUB, BLOCK_G)
    high_a = tl.where(keys_a > MIN_KEY, (keys_a >> ID_BITS).to(tl.int32), MIN_KEY32)
    high_b = tl.where(keys_b > MIN_KEY, (keys_b >> ID_BITS).to(tl.int32), MIN_KEY32)
    low_a = (keys_a & ID_MASK).to(tl.int32)
    low_b = (keys_b & ID_MASK).to(tl.int32)
    # the picks in the halves' layout (slot i in column i): no conversion inside the loop
    col = tl.arange(0, SUB)[None, :] + tl.zeros([BLOCK_G, 1], tl.int32)
    pick_key = tl.zeros([BLOCK_G, SUB], tl.int64) + MIN_KEY
    pick_bits = tl.zeros([BLOCK_G, SUB], tl.int32)
    for i in range(0, top_k):
        best_high = warp_max(high_a, high_b)
        best_low = warp_max(tl.where(high_a == best_high, low_a, -1), tl.where(high_b == best_high, low_b, -1))
        at_a = (low_a == best_low) & (high_a > MIN_KEY32)
        at_b = (low_b == best_low) & (high_b > MIN_KEY32)
        bits = warp_max(tl.where(at_a, bits_a, 0), tl.where(at_b, bits_b, 0))
        best = tl.where(best_high > MIN_KEY32, (best_high.to(tl.int64) << ID_BITS) | best_low, MIN_KEY)
        pick_key = tl.where(col == i, best, pick_key)
        pick_bits = tl.where(col == i, bits, pick_bits)
        high_a = tl.where(at_a, MIN_KEY32, high_a)
        high_b = tl.where(at_b, MIN_KEY32, high_b)
    # every warp holds the same picks and stores them (the same values to the same addresses)
    slot = col
    slot_ok = slot < top_k
    got = (pick_key > MIN_KEY) & slot_ok
    ids = tl.where(got, key_expert(pick_key), -1)
    wts = tl.where(got, pick_bits.to(tl.float32, bitcast=True), 0.0)
    if ROUTER.RENORMALIZE:
        denominator = tl.sum(wts, axis=1)[:, None]
        wts = tl.where(denominator > 0, wts / tl.where(denominator > 0, denominator, 1.0), 0.0)
    if ROUTER.HAS_SCALE:
        wts = wts * routing.scale
    wts = tl.where(got, wts, 0.0)
    out_ok = (tl.max(rows_in_block.to(tl.int32), axis=0) != 0) & slot_ok
    tl.store(routing.ids_ptr + row.to(tl.int64) * routing.ids_stride + slot, ids, mask=out_ok)
    tl.store(routing.out_w_ptr + row.to(tl.int64) * routing.out_w_stride + slot, wts, mask=out_ok)
    # the picks are the candidates at or above the last one (every candidate when fewer than top_k)
    last = tl.min(tl.where(slot_ok, pick_key, 2**62), axis=1)[:, None]
    routed = (key > MIN_KEY) & chosen & (key >= last)
    return tl.reshape(routed.to(tl.int32), [BLOCK_E])
