"""Triton kernel of the routing rewrite and the per-layer metrics (jit code only).

One program: rows are walked in chunks; leftover picks of pruned experts, padding rows and rows
whose vote weight is 0 become ``-1`` / weight 0 in place; the distinct routed experts still in use
are marked in a register vector; then one metrics row gets ``+= [activated, kept, retained mass, 1]``.  With
``FILL``, dropped slots get valid row-unique ids of weight 0 instead of ``-1`` (``filler_ids`` of the reference).
The reference is ``xshare_sglang.policies.rewrite.rewrite_routing``.
"""

import triton
import triton.language as tl

from ._select import num_valid_tokens, voting_rows


@triton.jit
def rewrite_routing_kernel(
    ids_ptr,
    weights_ptr,
    stride_t,
    stride_w,
    keep_ptr,
    p2l_ptr,
    n_valid_ptr,
    n_valid_arg,
    metrics_ptr,
    stats_ptr,
    token_weights_ptr,
    num_tokens,
    num_slots,
    num_experts,
    num_ids,
    HAS_NV_PTR: tl.constexpr,
    HAS_P2L: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    HAS_STATS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_IDS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    p = tl.arange(0, BLOCK_IDS)
    p_ok = p < num_ids
    if HAS_P2L:
        logical = tl.load(p2l_ptr + p, mask=p_ok, other=0)
    else:
        logical = p
    keep_p = (tl.load(keep_ptr + logical, mask=p_ok, other=0) != 0) & p_ok
    slot = tl.arange(0, BLOCK_K)
    slot_ok = slot < num_slots
    used = tl.zeros([BLOCK_IDS], tl.int32)
    for t0 in range(0, num_tokens, CHUNK_T):
        rows = t0 + tl.arange(0, CHUNK_T)
        rows_ok = rows < num_tokens
        ok = rows_ok[:, None] & slot_ok[None, :]
        id_ptrs = ids_ptr + rows.to(tl.int64)[:, None] * stride_t + slot[None, :]
        ids = tl.load(id_ptrs, mask=ok, other=-1)
        routed = (ids >= 0) & (ids < num_ids)
        # keep of each slot's expert: compare against the expert axis (num_ids is small)
        hit = (ids.to(tl.int32)[:, :, None] == p[None, None, :]) & keep_p[None, None, :]
        kept_slot = tl.max(hit.to(tl.int32), axis=2) != 0
        real = rows < n_valid
        if HAS_WEIGHTS:
            real = real & voting_rows(token_weights_ptr, rows, rows_ok)
        valid = real[:, None]
        drop = (routed & (~kept_slot)) | (~valid)
        ids = tl.where(drop, -1, ids)
        if FILL:
            # the j-th dropped slot of a row takes the row's j-th free id: kept ids first, then pruned
            present = tl.max(((ids.to(tl.int32)[:, :, None] == p[None, None, :]) & ok[:, :, None]).to(tl.int32), axis=1)
            free = (present == 0) & p_ok[None, :]
            kept_free = free & keep_p[None, :]
            pruned_free = free & (~keep_p[None, :])
            num_kept_free = tl.sum(kept_free.to(tl.int32), axis=1)
            rank = tl.where(
                keep_p[None, :],
                tl.cumsum(kept_free.to(tl.int32), axis=1),
                num_kept_free[:, None] + tl.cumsum(pruned_free.to(tl.int32), axis=1),
            )
            wanted = tl.cumsum((drop & ok).to(tl.int32), axis=1)
            match = (rank[:, None, :] == wanted[:, :, None]) & free[:, None, :]
            filler = tl.sum(tl.where(match, p[None, None, :], 0), axis=2)
            ids = tl.where(drop, filler, ids)
        tl.store(id_ptrs, ids, mask=ok)
        w_ptrs = weights_ptr + rows.to(tl.int64)[:, None] * stride_w + slot[None, :]
        weights = tl.load(w_ptrs, mask=ok, other=0.0)
        tl.store(w_ptrs, tl.where(drop, 0.0, weights), mask=ok)
        if HAS_METRICS:
            if FILL:
                live = (ids >= 0) & (ids < num_ids) & ok
            else:
                live = routed & (~drop) & ok
            marks = (ids.to(tl.int32)[:, :, None] == p[None, None, :]) & live[:, :, None]
            used = tl.maximum(used, tl.max(tl.max(marks.to(tl.int32), axis=1), axis=0))
    if HAS_METRICS:
        e = tl.arange(0, BLOCK_IDS)
        kept = tl.sum((tl.load(keep_ptr + e, mask=e < num_experts, other=0) != 0).to(tl.float64), axis=0)
        activated = tl.sum(used, axis=0).to(tl.float64)
        if HAS_STATS:
            kept_mass = tl.load(stats_ptr).to(tl.float64)
            total = tl.load(stats_ptr + 1).to(tl.float64)
            retained = tl.where(total > 0, kept_mass / tl.where(total > 0, total, 1.0), 1.0)
        else:
            retained = tl.full([], 1.0, tl.float64)
        tl.store(metrics_ptr, tl.load(metrics_ptr) + activated)
        tl.store(metrics_ptr + 1, tl.load(metrics_ptr + 1) + kept)
        tl.store(metrics_ptr + 2, tl.load(metrics_ptr + 2) + retained)
        tl.store(metrics_ptr + 3, tl.load(metrics_ptr + 3) + 1.0)
