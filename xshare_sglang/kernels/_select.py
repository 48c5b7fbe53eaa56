"""Triton kernels of the keep-mask selection (jit code only; launched from ``selection.py``).

Two launches per selection, both with static grids and no host synchronisation:

1. ``token_pass_kernel`` - one program per block of whole requests.  It reads the router logits,
   finds every token's top experts, computes float64 scores on the 2**-24 fixed-point grid of
   ``policies.scores`` and writes per-program partials: the aggregate score of every expert, the
   warm-up set, and (``xshare-spec``) the union of the per-request greedy sets.
2. ``finalize_kernel`` - one program.  It reduces the partials and applies the policy's set rule:
   greedy, threshold, rank rounds, top-B, then the ``max_experts`` cap and the token range; on
   request it also writes the kept and the total aggregate score (for the retained-mass metric).

The semantics are those of ``xshare_sglang.policies`` (DESIGN section 4), which the tests compare
against.  Ranks over experts are exact pairwise counts, so ties go to the lower index.
"""

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)
SCORE_ONE = tl.constexpr(16777216.0)  # 2**24, the fixed-point scale of scores
WARM_FIRST = tl.constexpr(4503599627370496.0)  # 2**52: puts warm-up experts ahead in the cap

MODE_WARM = tl.constexpr(0)  # oea
MODE_GREEDY_WARM = tl.constexpr(1)  # xshare
MODE_GREEDY_BASE = tl.constexpr(2)  # xshare-spec (base = union of per-request sets)
MODE_THRESHOLD = tl.constexpr(3)  # xshare-threshold
MODE_RANK_ROUNDS = tl.constexpr(4)  # xshare-ep
MODE_TOP_AGG = tl.constexpr(5)  # moe-spec, router ranking
MODE_TOP_VALUES = tl.constexpr(6)  # moe-spec, static ranking
MODE_GIVEN = tl.constexpr(7)  # lynx (base = union of picks)


@triton.jit
def num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR: tl.constexpr):
    """Real-token count, clamped to [0, num_tokens]; read from the device when given as a tensor."""
    if HAS_NV_PTR:
        n = tl.load(n_valid_ptr).to(tl.int64)
    else:
        n = tl.full([], n_valid_arg, tl.int64)
    return tl.minimum(tl.maximum(n, 0), num_tokens)


@triton.jit
def row_weights(weights_ptr, rows, rows_ok):
    """Vote weights of ``rows`` as float64 in [0, 1] (NaN -> 0; rows outside ``rows_ok`` -> 0)."""
    w = tl.load(weights_ptr + rows, mask=rows_ok, other=0.0).to(tl.float64)
    w = tl.where(w != w, 0.0, w)
    return tl.minimum(tl.maximum(w, 0.0), 1.0)


@triton.jit
def voting_rows(weights_ptr, rows, rows_ok):
    """Which of ``rows`` vote: weight > 0."""
    return row_weights(weights_ptr, rows, rows_ok) > 0


@triton.jit
def load_logits(
    logits_ptr,
    stride_t,
    stride_e,
    first_row,
    start,
    num_rows,
    n_valid,
    e,
    e_ok,
    weights_ptr,
    HAS_WEIGHTS: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    """Rows ``first_row + start + [0, CHUNK_T)`` of a block of ``num_rows`` rows, as a float32 tile.

    NaN -> -inf, +inf -> max float32; rows outside the block, at/after ``n_valid`` (padding) or, with
    token weights, of weight 0 (not voting) read as -inf.  Returns the tile [CHUNK_T, BLOCK_E], which
    of its rows vote [CHUNK_T], and their weights [CHUNK_T] float64 (1 without token weights).
    """
    offs = start + tl.arange(0, CHUNK_T)
    rows = first_row + offs
    row_ok = (offs < num_rows) & (rows < n_valid)
    if HAS_WEIGHTS:
        w = row_weights(weights_ptr, rows, row_ok)
        row_ok = row_ok & (w > 0)
    else:
        w = tl.full([CHUNK_T], 1.0, tl.float64)
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + e[None, :] * stride_e
    x = tl.load(ptrs, mask=row_ok[:, None] & e_ok[None, :], other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    return tl.where(x == float("inf"), FP32_MAX, x), row_ok, w


@triton.jit
def row_ranks(x, e, n_iter, BLOCK_E: tl.constexpr):
    """Place of each expert in its row's order (logit desc, index asc) for the first ``n_iter``
    places; ``n_iter`` for experts not placed and for ``-inf`` entries."""
    work = x
    rank = tl.zeros(x.shape, tl.int32) + n_iter
    for i in range(0, n_iter):
        best = tl.max(work, axis=1)
        hit = (work == best[:, None]) & (best[:, None] > float("-inf"))
        first = tl.min(tl.where(hit, e[None, :], BLOCK_E), axis=1)
        chosen = e[None, :] == first[:, None]
        rank = tl.where(chosen, i, rank)
        work = tl.where(chosen, float("-inf"), work)
    return rank


@triton.jit
def quantized_scores(x, member, w, SIGMOID: tl.constexpr, NORMALIZE_SIGMOID: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    """floor(score * w * 2**24) as int64 for a [rows, experts] tile; score computed in float64 over
    ``member`` (softmax normalizes over it; sigmoid is 1 / (1 + exp(-l)), renormalized on request),
    times the row weights ``w`` [rows] when given."""
    wide = x.to(tl.float64)
    if SIGMOID:
        value = tl.where(member, 1.0 / (1.0 + tl.exp(-wide)), 0.0)
        if NORMALIZE_SIGMOID:
            total = tl.sum(value, axis=1)[:, None]
            value = tl.where(total > 0, value / tl.where(total > 0, total, 1.0), 0.0)
    else:
        masked = tl.where(member, wide, float("-inf"))
        top = tl.max(masked, axis=1)[:, None]
        top = tl.where(top > float("-inf"), top, 0.0)
        value = tl.where(member, tl.exp(masked - top), 0.0)
        total = tl.sum(value, axis=1)[:, None]
        value = tl.where(total > 0, value / tl.where(total > 0, total, 1.0), 0.0)
    if HAS_WEIGHTS:
        value = value * w[:, None]
    return (value * SCORE_ONE).to(tl.int64)


@triton.jit
def greedy_iterative(base, agg, e, e_ok, count, active, ALLOW_ZERO: tl.constexpr, BLOCK_E: tl.constexpr):
    """G(S, agg, count) on one vector: ``count`` times, add the best outside expert with agg > 0
    (with ``ALLOW_ZERO``: agg >= 0, the plain top-``count``).  Adds nothing unless ``active``."""
    chosen = base
    if ALLOW_ZERO:
        candidate = (base == 0) & e_ok & active
    else:
        candidate = (base == 0) & e_ok & (agg > 0) & active
    for _ in range(0, count):
        best = tl.max(tl.where(candidate, agg, -1), axis=0)
        first = tl.min(tl.where(candidate & (agg == best), e, BLOCK_E), axis=0)
        hit = e == first
        chosen = tl.where(hit, 1, chosen)
        candidate = candidate & (e != first)
    return chosen


@triton.jit
def token_pass_kernel(
    logits_ptr,
    stride_t,
    stride_e,
    num_tokens,
    num_experts,
    n_valid_ptr,
    n_valid_arg,
    agg_part_ptr,
    warm_part_ptr,
    base_part_ptr,
    rows_per_request,
    requests_per_program,
    k0,
    top_k,
    request_budget,
    weights_ptr,
    HAS_NV_PTR: tl.constexpr,
    NEED_SCORES: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    SIGMOID: tl.constexpr,
    PER_REQUEST: tl.constexpr,
    REQUEST_TOP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    if NEED_SCORES and SCORE_TOPK:
        n_iter = top_k
    else:
        n_iter = k0
    agg_acc = tl.zeros([BLOCK_E], tl.int64)
    warm_acc = tl.zeros([BLOCK_E], tl.int32)
    base_acc = tl.zeros([BLOCK_E], tl.int32)
    for r in range(0, requests_per_program):
        first_row = (pid * requests_per_program + r) * rows_per_request
        agg_r = tl.zeros([BLOCK_E], tl.int64)
        warm_r = tl.zeros([BLOCK_E], tl.int32)
        votes_r = tl.zeros([], tl.int32)
        for c in range(0, rows_per_request, CHUNK_T):
            x, row_ok, w = load_logits(
                logits_ptr,
                stride_t,
                stride_e,
                first_row,
                c,
                rows_per_request,
                n_valid,
                e,
                e_ok,
                weights_ptr,
                HAS_WEIGHTS,
                CHUNK_T,
            )
            votes_r += tl.sum(row_ok.to(tl.int32), axis=0)
            rank = row_ranks(x, e, n_iter, BLOCK_E)
            warm_rows = (rank < k0) & row_ok[:, None]
            warm_r = tl.maximum(warm_r, tl.max(warm_rows.to(tl.int32), axis=0))
            if NEED_SCORES:
                if SCORE_TOPK:
                    member = rank < top_k
                else:
                    member = x > float("-inf")
                q = quantized_scores(x, member, w, SIGMOID, SCORE_TOPK, HAS_WEIGHTS)
                agg_r += tl.sum(tl.where(row_ok[:, None], q, 0), axis=0)
        agg_acc += agg_r
        warm_acc = tl.maximum(warm_acc, warm_r)
        if PER_REQUEST:
            chosen = greedy_iterative(warm_r, agg_r, e, e_ok, request_budget, votes_r > 0, REQUEST_TOP, BLOCK_E)
            base_acc = tl.maximum(base_acc, chosen)
    out = pid * num_experts + e
    tl.store(agg_part_ptr + out, agg_acc, mask=e_ok)
    tl.store(warm_part_ptr + out, warm_acc.to(tl.int8), mask=e_ok)
    if PER_REQUEST:
        tl.store(base_part_ptr + out, base_acc.to(tl.int8), mask=e_ok)


@triton.jit
def pairwise_beaten(
    prim_ptr,
    flag_ptr,
    group_ptr,
    mass_ptr,
    prim_e,
    group_e,
    e,
    num_experts,
    USE_GROUP: tl.constexpr,
    WANT_MASS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """For every expert e: how many flagged experts j (of e's group, if asked) come before it in the
    order (prim desc, index asc), and the sum of their ``mass``.  Reads prim/flag/mass from memory."""
    count = tl.zeros([BLOCK_E], tl.int32)
    mass = tl.zeros([BLOCK_E], tl.int64)
    for j0 in range(0, BLOCK_E, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        j_ok = j < num_experts
        prim_j = tl.load(prim_ptr + j, mask=j_ok, other=0.0)
        flag_j = tl.load(flag_ptr + j, mask=j_ok, other=0) != 0
        before = (prim_j[:, None] > prim_e[None, :]) | (
            (prim_j[:, None] == prim_e[None, :]) & (j[:, None] < e[None, :])
        )
        before = before & flag_j[:, None]
        if USE_GROUP:
            group_j = tl.load(group_ptr + j, mask=j_ok, other=-1).to(tl.int64)
            before = before & (group_j[:, None] == group_e[None, :])
        count += tl.sum(before.to(tl.int32), axis=0)
        if WANT_MASS:
            mass_j = tl.load(mass_ptr + j, mask=j_ok, other=0)
            mass += tl.sum(tl.where(before, mass_j[:, None], 0), axis=0)
    return count, mass


@triton.jit
def finalize_kernel(
    agg_part_ptr,
    warm_part_ptr,
    base_part_ptr,
    num_parts,
    values_ptr,
    group_ptr,
    n_valid_ptr,
    n_valid_arg,
    num_tokens,
    prim_ptr,
    flag_ptr,
    mass_ptr,
    out_ptr,
    stats_ptr,
    num_experts,
    count,
    tau,
    rank_budget,
    cap,
    min_tokens,
    max_tokens,
    HAS_NV_PTR: tl.constexpr,
    MODE: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_STATS: tl.constexpr,
    NEED_AGG: tl.constexpr,
    NEED_BASE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)

    agg = tl.zeros([BLOCK_E], tl.int64)
    warm = tl.zeros([BLOCK_E], tl.int32)
    base = tl.zeros([BLOCK_E], tl.int32)
    for p in range(0, num_parts):
        offs = p * num_experts + e
        warm = tl.maximum(warm, tl.load(warm_part_ptr + offs, mask=e_ok, other=0).to(tl.int32))
        if NEED_AGG:
            agg += tl.load(agg_part_ptr + offs, mask=e_ok, other=0)
        if NEED_BASE:
            base = tl.maximum(base, tl.load(base_part_ptr + offs, mask=e_ok, other=0).to(tl.int32))
    warm_b = warm != 0

    if MODE == MODE_WARM:
        keep = warm_b
    elif MODE == MODE_GIVEN:
        keep = base != 0
    elif (MODE == MODE_TOP_AGG) or (MODE == MODE_TOP_VALUES):
        if MODE == MODE_TOP_AGG:
            values = agg.to(tl.float64)
        else:
            values = tl.load(values_ptr + e, mask=e_ok, other=0.0).to(tl.float64)
        tl.store(prim_ptr + e, values, mask=e_ok)
        tl.store(flag_ptr + e, e_ok.to(tl.int8), mask=e_ok)
        tl.debug_barrier()
        place, _ = pairwise_beaten(
            prim_ptr, flag_ptr, group_ptr, mass_ptr, values, e, e, num_experts, False, False, BLOCK_E, CHUNK
        )
        keep = e_ok & (place < count) & (n_valid > 0)
    else:
        if MODE == MODE_GREEDY_BASE:
            start = base != 0
        else:
            start = warm_b
        candidate = e_ok & (~start) & (agg > 0)
        prim = agg.to(tl.float64)
        tl.store(prim_ptr + e, prim, mask=e_ok)
        tl.store(flag_ptr + e, candidate.to(tl.int8), mask=e_ok)
        tl.store(mass_ptr + e, agg, mask=e_ok)
        tl.debug_barrier()
        if MODE == MODE_RANK_ROUNDS:
            group_e = tl.load(group_ptr + e, mask=e_ok, other=-1).to(tl.int64)
            place, _ = pairwise_beaten(
                prim_ptr, flag_ptr, group_ptr, mass_ptr, prim, group_e, e, num_experts, True, False, BLOCK_E, CHUNK
            )
            target = rank_budget * (tl.max(tl.where(e_ok, group_e, -1), axis=0) + 1)
            kept = tl.sum(start.to(tl.int64), axis=0)
            # Fewest rounds R in [0, E] with |start| + #{candidates placed < R} >= target (R = E always
            # qualifies: every rank is exhausted by then).  The count is monotone in R: bisect.
            lo = tl.full([], 0, tl.int64)
            hi = tl.full([], 0, tl.int64) + num_experts
            for _ in range(0, SEARCH_STEPS):
                mid = (lo + hi) // 2
                added = tl.sum((candidate & (place < mid)).to(tl.int64), axis=0)
                enough = (kept + added >= target) | (mid >= num_experts)
                moving = lo < hi
                hi = tl.where(moving & enough, mid, hi)
                lo = tl.where(moving & (~enough), mid + 1, lo)
            keep = start | (candidate & (place < lo))
        elif MODE == MODE_THRESHOLD:
            place, before = pairwise_beaten(
                prim_ptr, flag_ptr, group_ptr, mass_ptr, prim, e, e, num_experts, False, True, BLOCK_E, CHUNK
            )
            kept_mass = tl.sum(tl.where(start, agg, 0), axis=0)
            total = tl.sum(agg, axis=0).to(tl.float64)
            keep = start | (candidate & ((kept_mass + before).to(tl.float64) < tau * total))
        else:
            place, _ = pairwise_beaten(
                prim_ptr, flag_ptr, group_ptr, mass_ptr, prim, e, e, num_experts, False, False, BLOCK_E, CHUNK
            )
            keep = start | (candidate & (place < count))

    if HAS_CAP:
        tl.debug_barrier()
        prim = warm_b.to(tl.float64) * WARM_FIRST + agg.to(tl.float64)
        tl.store(prim_ptr + e, prim, mask=e_ok)
        tl.store(flag_ptr + e, keep.to(tl.int8), mask=e_ok)
        tl.debug_barrier()
        place, _ = pairwise_beaten(
            prim_ptr, flag_ptr, group_ptr, mass_ptr, prim, e, e, num_experts, False, False, BLOCK_E, CHUNK
        )
        keep = keep & (place < cap)
    if HAS_RANGE:
        in_range = (n_valid >= min_tokens) & (n_valid <= max_tokens)
        keep = tl.where(in_range, keep, e_ok)
    tl.store(out_ptr + e, keep, mask=e_ok)
    if HAS_STATS:
        tl.store(stats_ptr, tl.sum(tl.where(keep, agg, 0), axis=0))
        tl.store(stats_ptr + 1, tl.sum(agg, axis=0))
