"""Routing a tile of rows inside the keep mask: each row's top-k among its candidates, SGLang's layout.

A row's candidates are its finite logits inside the mask (all finite logits under truncation, whose
picks outside the mask are then dropped). The picks are ``top_k`` row maxima of packed keys, a warp
per row (one warp-wide maximum per pick; an int64 key as two int32 maxima); the picks' logits come
back from their keys, a biased pick's sigmoid is taken with the pick. Grouped routers keep each row's
``topk_group`` best groups first. DeepSeek-V3's rows route on a warp per expert group
(:mod:`.group_routing`). The weights are the model's (softmax over the candidates, or sigmoids,
renormalized over the picks when the model does, times its scale) with the hardware ``exp`` and a
plain division, within the stated tolerance of the reference.
"""

import triton
import triton.language as tl

from .group_routing import route_row_by_group_warps
from .groups import biased_groups_key, group_order_key
from .keys import ID_BITS, ID_MASK, MIN_KEY, MIN_KEY32, half_key_pick, key_expert, key_logit, lowest_key, pack_key
from .metrics import add_metric
from .numerics import sigmoid32
from .rows import load_bias, load_rows


@triton.jit
def keep_chosen_groups(
    key,
    candidates,
    e,
    group_size,
    num_groups,
    topk_group,
    HAS_BIAS: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """``key`` [rows, E] with the experts outside each row's ``topk_group`` best groups set to the lowest
    key.  The groups that hold a candidate are ranked by :func:`~.groups.group_order_key`; with
    ``GROUP_SIZE`` (groups splitting a power-of-two E evenly) every group at once on a [rows, G, size]
    view, otherwise one group at a time.  The chosen groups are those with fewer than ``topk_group``
    keys above their own, one [G, G] comparison."""
    lowest = lowest_key(KEY_SHIFT)
    x = key
    # rank the groups that hold a candidate; keep the best topk_group of them
    g_col = tl.arange(0, BLOCK_G)
    if GROUP_SIZE > 0:
        # E = BLOCK_G * GROUP_SIZE: every group at once, as the last axis of a [rows, G, size] view
        key3 = tl.reshape(key, [x.shape[0], BLOCK_G, GROUP_SIZE])
        cand3 = tl.reshape(candidates, [x.shape[0], BLOCK_G, GROUP_SIZE])
        count = tl.sum(cand3.to(tl.int32), axis=2)
        if HAS_BIAS:
            # the two best values of each group from the int64 keys' value halves, as int32
            # maxima: the second best is the best again when two candidates share that value
            high3 = tl.where(cand3, (key3 >> ID_BITS).to(tl.int32), MIN_KEY32)
            group_key = biased_groups_key(high3, count, g_col[None, :], 2)
        else:
            k1 = tl.max(tl.where(cand3, key3, lowest), axis=2)
            group_key = group_order_key(k1, k1, count, g_col[None, :], HAS_BIAS, KEY_SHIFT)
    else:
        group_of = e // group_size
        group_key = tl.zeros([x.shape[0], BLOCK_G], tl.int64) + MIN_KEY
        for g in range(0, num_groups):
            in_group = (group_of == g)[None, :] & candidates
            k1 = tl.max(tl.where(in_group, key, lowest), axis=1)
            count = tl.sum(in_group.to(tl.int32), axis=1)
            if HAS_BIAS:
                k2 = tl.max(tl.where(in_group & (key != k1[:, None]), key, MIN_KEY), axis=1)
            else:
                k2 = k1
            packed = group_order_key(k1, k2, count, g, HAS_BIAS, KEY_SHIFT)
            group_key = tl.where(g_col[None, :] == g, packed[:, None], group_key)
    # the best topk_group groups: those with fewer than topk_group keys above their own (one
    # [G, G] comparison, not topk_group maxima in a row).  Keys of groups with candidates are
    # distinct; a group without any (MIN_KEY) may count as chosen, and adds no candidate
    above = tl.sum((group_key[:, None, :] > group_key[:, :, None]).to(tl.int32), axis=2)
    chosen_groups = (above < topk_group).to(tl.int32)
    if GROUP_SIZE > 0:
        in_chosen = tl.reshape(
            tl.broadcast_to(chosen_groups[:, :, None], [x.shape[0], BLOCK_G, GROUP_SIZE]),
            [x.shape[0], BLOCK_E],
        )
    else:
        in_chosen = tl.zeros(x.shape, tl.int32)
        for g in range(0, BLOCK_G):
            flag = tl.sum(tl.where(g_col[None, :] == g, chosen_groups, 0), axis=1)
            in_chosen = tl.where((group_of == g)[None, :] & (flag[:, None] != 0), 1, in_chosen)
    key = tl.where(in_chosen != 0, key, lowest)
    return key


@triton.jit
def pick_weights(
    x,
    candidates,
    pick_key,
    pick_score_bits,
    pick_e,
    got,
    logits_ptr,
    stride_t,
    stride_e,
    rows,
    rows_in_block,
    HAS_BIAS: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    ROW_WARPS: tl.constexpr,
):
    """The raw weights of a tile's picks [rows, BLOCK_K] and each row's denominator where it is not
    their sum (``RENORMALIZE``): softmax terms over the candidates, or sigmoids."""
    # raw weights of the picks: softmax terms over the candidates, or sigmoids.  Keys of biased scores
    # (a bias implies sigmoid scoring) do not hold the logit: on a warp per row the picks' sigmoids
    # were taken with the picks; a row over several warps reloads the picked logits (one round trip
    # for all picks, where a maximum per pick would cost a block barrier each).  Other keys give
    # the picked logit back.  The weight of a raw +inf is that of its sanitized FP32_MAX (1.0)
    if HAS_BIAS and KEY_SHIFT == 0 and ROW_WARPS:
        wts = pick_score_bits.to(tl.float32, bitcast=True)
        denominator = tl.zeros([x.shape[0]], tl.float32) + 1.0
    elif SIGMOID:
        if HAS_BIAS:
            x_pick = tl.load(
                logits_ptr + rows.to(tl.int64)[:, None] * stride_t + pick_e * stride_e,
                mask=got & rows_in_block[:, None],
                other=float("-inf"),
            ).to(tl.float32)
        else:
            x_pick = key_logit(pick_key, KEY_SHIFT)
        wts = 1.0 / (1.0 + tl.exp(-x_pick))
        denominator = tl.zeros([x.shape[0]], tl.float32) + 1.0
    else:
        top = tl.max(tl.where(candidates, x, float("-inf")), axis=1)
        top = tl.where(top > float("-inf"), top, 0.0)
        wts = tl.exp(key_logit(pick_key, KEY_SHIFT) - top[:, None])
        if RENORMALIZE:
            denominator = tl.zeros([x.shape[0]], tl.float32) + 1.0  # the caller divides by the picks' sum
        else:
            denominator = tl.sum(tl.where(candidates, tl.exp(x - top[:, None]), 0.0), axis=1)
    return wts, denominator


@triton.jit
def fill_dropped_slots(ids, picked, keep, e, e_ok, slot, slot_ok):
    """Give each dropped slot of a tile a free expert (weight 0), for backends that cannot take -1:
    the j-th dropped slot of a row takes the row's j-th free expert, kept ones first, then pruned.
    Returns the ids and the experts routed to, both [rows, ...]."""
    # the j-th dropped slot of a row takes the row's j-th free expert: kept ones first, then pruned
    drop = (ids < 0) & slot_ok[None, :]
    free = (picked == 0) & e_ok[None, :]
    kept_free = free & keep[None, :]
    pruned_free = free & (~keep[None, :])
    num_kept_free = tl.sum(kept_free.to(tl.int32), axis=1)
    place = tl.where(
        keep[None, :],
        tl.cumsum(kept_free.to(tl.int32), axis=1),
        num_kept_free[:, None] + tl.cumsum(pruned_free.to(tl.int32), axis=1),
    )
    # running count of dropped slots, as a sum over slots i <= j rather than tl.cumsum: Triton 3.6
    # cannot lower a scan over this narrow [rows, BLOCK_K] tile (an assertion in ScanOpToLLVM)
    slot_le = slot[:, None] <= slot[None, :]
    wanted = tl.sum(tl.where(slot_le[None, :, :] & drop[:, :, None], 1, 0), axis=1)
    match = (place[:, None, :] == wanted[:, :, None]) & free[:, None, :] & drop[:, :, None]
    filler = tl.sum(tl.where(match, e[None, None, :], 0), axis=2)
    ids = tl.where(drop, filler, ids)
    picked = tl.maximum(picked, tl.max(match.to(tl.int32), axis=1))
    return ids, picked


@triton.jit
def route_block(call, routing, rows, rows_in_block, n_valid, keep, e, e_ok, ROUTER: tl.constexpr):
    """Route a block of rows inside ``keep`` and store ids/weights; returns the experts routed to.

    ``ROW_WARPS``: one warp holds each row of the block (as many warps as rows), where a maximum of
    int32 values is one warp-wide instruction; int64 keys then take each pick as two int32 maxima
    (the value half, then the index half among its ties) rather than one int64 shuffle tree.
    ``GROUP_WARPS``: one row of biased grouped routing, a warp per group
    (:func:`route_row_by_group_warps`)."""
    logits_ptr = call.logits_ptr
    stride_t = call.stride_t
    stride_e = call.stride_e
    bias_ptr = routing.bias_ptr
    top_k = routing.top_k
    HAS_BIAS: tl.constexpr = ROUTER.HAS_BIAS
    KEY_SHIFT: tl.constexpr = ROUTER.KEY_SHIFT
    ROW_WARPS: tl.constexpr = ROUTER.ROW_WARPS
    BLOCK_K: tl.constexpr = ROUTER.BLOCK_K
    if ROUTER.GROUP_WARPS:
        return route_row_by_group_warps(call, routing, rows, rows_in_block, n_valid, keep, ROUTER)
    x, _, _ = load_rows(
        logits_ptr, stride_t, stride_e, rows, rows_in_block, n_valid, e, e_ok, call.weights_ptr, ROUTER.HAS_WEIGHTS
    )
    finite = (x > float("-inf")) & e_ok[None, :]
    if ROUTER.TRUNCATION:
        candidates = finite
    else:
        candidates = finite & keep[None, :]
    if HAS_BIAS:
        bias = load_bias(bias_ptr, e, e_ok)
        score = sigmoid32(x)
        value = score + bias[None, :]
        # a sigmoid is >= 0, so its bits as an int32 order as its value: on a warp per row each pick's
        # weight is read off the row with the pick (one more REDUX, off the picks' dependency chain)
        # instead of reloading the picked logits from memory after the picks
        score_bits = score.to(tl.int32, bitcast=True)
    else:
        value = x
    key = pack_key(value, e[None, :], candidates, KEY_SHIFT)
    lowest = lowest_key(KEY_SHIFT)
    if ROUTER.GROUPED:
        key = keep_chosen_groups(
            key,
            candidates,
            e,
            routing.group_size,
            routing.num_groups,
            routing.topk_group,
            HAS_BIAS,
            KEY_SHIFT,
            ROUTER.BLOCK_E,
            ROUTER.BLOCK_G,
            ROUTER.GROUP_SIZE,
        )
    # the top_k rounds take only the row maxima: one reduction per pick.  Each pick's expert, weight
    # and kept flag are read off after the rounds with one gather per row (not one sum per pick)
    slot = tl.arange(0, BLOCK_K)
    pick_key = tl.zeros([x.shape[0], BLOCK_K], key.dtype) + lowest
    pick_score_bits = tl.zeros([x.shape[0], BLOCK_K], tl.int32)
    best = tl.zeros([x.shape[0]], key.dtype) + lowest
    if KEY_SHIFT == 0 and ROW_WARPS:
        # (value bits, inverted index) halves of the int64 keys; candidates' value bits are above
        # MIN_KEY32 (ordered bits of finite values), and the index half is distinct within a row
        high = tl.where(key > lowest, (key >> ID_BITS).to(tl.int32), MIN_KEY32)
        low = (key & ID_MASK).to(tl.int32)
        for i in range(0, top_k):
            best, best_low = half_key_pick(high, low)  # lowest is MIN_KEY (int64 keys)
            pick_key = tl.where(slot[None, :] == i, best[:, None], pick_key)
            if HAS_BIAS:
                bits = tl.max(tl.where(low == best_low[:, None], score_bits, 0), axis=1)
                pick_score_bits = tl.where(slot[None, :] == i, bits[:, None], pick_score_bits)
            high = tl.where(low == best_low[:, None], MIN_KEY32, high)
    else:
        work = key
        for i in range(0, top_k):
            best = tl.max(work, axis=1)
            pick_key = tl.where(slot[None, :] == i, best[:, None], pick_key)
            work = tl.where(work == best[:, None], lowest, work)
    got = pick_key > lowest
    pick_e = tl.where(got, key_expert(pick_key), 0)
    # keys are distinct within a row, so the picks are the candidates at or above the last pick's key
    # (every candidate when the row had fewer than top_k)
    picked = ((key > lowest) & (key >= best[:, None])).to(tl.int32)
    if ROUTER.TRUNCATION:
        kept_pick = got & (tl.gather(tl.broadcast_to(keep[None, :], x.shape).to(tl.int32), pick_e, 1) != 0)
        picked = tl.where(keep[None, :], picked, 0)
    else:
        kept_pick = got
    ids = tl.where(kept_pick, pick_e, -1)
    wts, denominator = pick_weights(
        x,
        candidates,
        pick_key,
        pick_score_bits,
        pick_e,
        got,
        logits_ptr,
        stride_t,
        stride_e,
        rows,
        rows_in_block,
        HAS_BIAS,
        ROUTER.SIGMOID,
        ROUTER.RENORMALIZE,
        KEY_SHIFT,
        ROW_WARPS,
    )
    wts = tl.where(got, wts, 0.0)
    if ROUTER.RENORMALIZE:
        denominator = tl.sum(wts, axis=1)
    # routing weights: a plain (approximate) division, within the stated tolerance of the reference
    wts = tl.where(denominator[:, None] > 0, wts / tl.where(denominator > 0, denominator, 1.0)[:, None], 0.0)
    if ROUTER.HAS_SCALE:
        wts = wts * routing.scale
    wts = tl.where(ids >= 0, wts, 0.0)
    slot_ok = slot < top_k
    if ROUTER.FILL:
        ids, picked = fill_dropped_slots(ids, picked, keep, e, e_ok, slot, slot_ok)
    out_ok = rows_in_block[:, None] & slot_ok[None, :]
    row64 = rows.to(tl.int64)[:, None]
    tl.store(routing.ids_ptr + row64 * routing.ids_stride + slot[None, :], ids, mask=out_ok)
    tl.store(routing.out_w_ptr + row64 * routing.out_w_stride + slot[None, :], wts, mask=out_ok)
    return tl.max(tl.where(rows_in_block[:, None], picked, 0), axis=0)


@triton.jit
def route_rows(
    call,
    routing,
    keep,
    n_valid,
    e,
    e_ok,
    metrics_ptr,
    collect,
    HAS_METRICS: tl.constexpr,
    ROUTE_T: tl.constexpr,
    ROUTER: tl.constexpr,
):
    """Route every row of the call in tiles of ``ROUTE_T`` (a one-program call: the selection's own
    program) and add the activated experts to the metrics."""
    BLOCK_E: tl.constexpr = ROUTER.BLOCK_E
    num_tokens = call.num_tokens
    used = tl.zeros([BLOCK_E], tl.int32)
    for c in range(0, num_tokens, ROUTE_T):
        rows = c + tl.arange(0, ROUTE_T)
        block_used = route_block(call, routing, rows, rows < num_tokens, n_valid, keep, e, e_ok, ROUTER)
        used = tl.maximum(used, block_used)
    if HAS_METRICS:
        if collect:
            add_metric(metrics_ptr, tl.sum(used, axis=0))
