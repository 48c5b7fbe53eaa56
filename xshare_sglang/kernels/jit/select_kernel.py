"""``select_kernel``: the keep mask of one layer call, and in a one-program call its routing too.

A grid of P programs over the tokens, in five phases:

1. **load** (:func:`read_rows`): each program reads its rows once (requests never straddle programs)
   and builds its share: aggregate scores, warm-up and per-request sets, LYNX bin counts, the coverage
   ranking's column sums and pair sums or row lists;
2. **share** (:func:`add_share`): above one program, each adds its share into the workspace's
   accumulators with integer atomics, then takes a ticket (acquire-release);
3. **rule**: the program holding the last ticket loads the accumulators (:func:`load_shares`) and
   applies the set rule (:func:`apply_rule`), the cap and the token range (:func:`~.rules.finish_keep`),
   which stores the mask and the call's metrics. LYNX above one program stores its batch order here
   and leaves the picks and the mask to ``lynx_pick_kernel``;
4. **route** (:func:`route_rows`): with P = 1 the same program routes every row, one launch in all;
5. **clear** (:func:`clear_shares`): the last program puts what the programs accumulated back to 0.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .coact import coact_rule
from .coverage import COVER_BITS, add_coverage_rows, coverage_rule
from .keys import pack_key
from .lynx import lynx_bin_counts, lynx_order
from .metrics import metrics_on
from .numerics import SCORE_BITS, fixed_scores
from .routing import route_rows
from .rows import load_rows, num_valid_tokens, row_ranks
from .rules import (
    MODE_ALL,
    MODE_COACT,
    MODE_COVERAGE,
    MODE_GIVEN,
    MODE_GREEDY_BASE,
    MODE_STATIC,
    MODE_TOP_AGG,
    MODE_WARM,
    finish_keep,
    greedy_iterative,
    grown_keep,
    top_count_keep,
)


@triton.jit
def read_rows(
    call,
    split,
    policy,
    coverage,
    pid,
    n_valid,
    scoring,
    e,
    e_ok,
    RULE: tl.constexpr,
    SHAPE: tl.constexpr,
):
    """Phase 1: this program's share of the call, from its rows: aggregate scores [E] int64, the
    coverage ranking's column sums [E] int64, warm-up and per-request marks [E] int32, LYNX bin counts
    [E, BINS] int32.  Every rule but ``none`` and static moe-spec reads the rows; those two only for the
    aggregates (the metrics), and only in calls that add them (``scoring``).  ``RULE`` = (MODE,
    NEED_SCORES, SCORE_TOPK, SIGMOID, PER_REQUEST, REQUEST_TOP, LYNX, SINGLE, COVER_PAIRS, COVER_LISTS);
    ``SHAPE`` = (HAS_WEIGHTS, KEY_SHIFT, BLOCK_E, BLOCK_BINS, CHUNK_T)."""
    MODE: tl.constexpr = RULE[0]
    NEED_SCORES: tl.constexpr = RULE[1]
    SCORE_TOPK: tl.constexpr = RULE[2]
    SIGMOID: tl.constexpr = RULE[3]
    PER_REQUEST: tl.constexpr = RULE[4]
    REQUEST_TOP: tl.constexpr = RULE[5]
    LYNX: tl.constexpr = RULE[6]
    SINGLE: tl.constexpr = RULE[7]
    COVER_PAIRS: tl.constexpr = RULE[8]
    COVER_LISTS: tl.constexpr = RULE[9]
    HAS_WEIGHTS: tl.constexpr = SHAPE[0]
    KEY_SHIFT: tl.constexpr = SHAPE[1]
    BLOCK_E: tl.constexpr = SHAPE[2]
    BLOCK_BINS: tl.constexpr = SHAPE[3]
    CHUNK_T: tl.constexpr = SHAPE[4]
    logits_ptr, stride_t, stride_e, num_tokens, num_experts, _, _, weights_ptr = call
    rows_per_program, rows_per_request = split
    k0, top_k, request_budget, _, _, _, _, _, _, alpha, beta = policy
    agg = tl.zeros([BLOCK_E], tl.int64)
    cover_agg = tl.zeros([BLOCK_E], tl.int64)  # the coverage greedy's column sums, on its grid
    warm = tl.zeros([BLOCK_E], tl.int32)
    base = tl.zeros([BLOCK_E], tl.int32)
    counts = tl.zeros([BLOCK_E, BLOCK_BINS], tl.int32)
    first_row = pid * rows_per_program
    num_rows = tl.minimum(rows_per_program, tl.maximum(num_tokens - first_row, 0))
    if (MODE != MODE_ALL and MODE != MODE_STATIC) or NEED_SCORES:
        if NEED_SCORES and SCORE_TOPK:
            n_iter = tl.where(scoring, tl.maximum(top_k, k0), k0)
        else:
            n_iter = k0
        if MODE == MODE_ALL or MODE == MODE_STATIC:
            rows_read = tl.where(scoring, num_rows, 0)  # the rows hold nothing else for these rules
        else:
            rows_read = num_rows
        for r0 in range(0, rows_read, rows_per_request):
            agg_r = tl.zeros([BLOCK_E], tl.int64)
            warm_r = tl.zeros([BLOCK_E], tl.int32)
            votes_r = tl.zeros([], tl.int32)
            for c in range(0, rows_per_request, CHUNK_T):
                offs = r0 + c + tl.arange(0, CHUNK_T)
                in_block = (offs < num_rows) & (offs < r0 + rows_per_request)
                rows = first_row + offs
                x, row_ok, wq = load_rows(
                    logits_ptr, stride_t, stride_e, rows, in_block, n_valid, e, e_ok, weights_ptr, HAS_WEIGHTS
                )
                votes_r += tl.sum(row_ok.to(tl.int32), axis=0)
                if LYNX:
                    counts += lynx_bin_counts(x, row_ok, e, alpha, beta, CHUNK_T, BLOCK_E, BLOCK_BINS)
                candidate = (x > float("-inf")) & e_ok[None, :]
                key = pack_key(x, e[None, :], candidate, KEY_SHIFT)
                rank = row_ranks(key, n_iter, KEY_SHIFT)
                warm_rows = (rank < k0) & row_ok[:, None]
                warm_r = tl.maximum(warm_r, tl.max(warm_rows.to(tl.int32), axis=0))
                if NEED_SCORES:
                    if scoring:
                        if SCORE_TOPK:
                            member = rank < top_k
                        else:
                            member = candidate
                        q = fixed_scores(x, member, wq, SIGMOID, SCORE_TOPK, HAS_WEIGHTS)
                        agg_r += tl.sum(tl.where(row_ok[:, None], q, 0), axis=0)
                        if MODE == MODE_COVERAGE and not SINGLE:
                            cover_agg += tl.sum(tl.where(row_ok[:, None], q, 0) >> (SCORE_BITS - COVER_BITS), axis=0)
                        if MODE == MODE_COVERAGE:
                            add_coverage_rows(
                                coverage,
                                q,
                                rank,
                                row_ok,
                                rows,
                                in_block,
                                e,
                                e_ok,
                                num_experts,
                                top_k,
                                COVER_PAIRS,
                                COVER_LISTS,
                            )
            agg += agg_r
            warm = tl.maximum(warm, warm_r)
            if PER_REQUEST:
                chosen = greedy_iterative(warm_r, agg_r, e, e_ok, request_budget, votes_r > 0, REQUEST_TOP, BLOCK_E)
                base = tl.maximum(base, chosen)
    return agg, cover_agg, warm, base, counts


@triton.jit
def add_share(
    shares,
    cover_agg_ptr,
    agg,
    cover_agg,
    warm,
    base,
    counts,
    e,
    e_ok,
    SHARE: tl.constexpr,
):
    """Phase 2: this program's share, added into the call's accumulators (0 when the call starts: the
    last program of the call before cleared them); integer sums and maxima do not depend on the order
    the programs arrive in.  ``SHARE`` = (MODE, NEED_SCORES, PER_REQUEST, LYNX, BLOCK_BINS)."""
    MODE: tl.constexpr = SHARE[0]
    NEED_SCORES: tl.constexpr = SHARE[1]
    PER_REQUEST: tl.constexpr = SHARE[2]
    LYNX: tl.constexpr = SHARE[3]
    BLOCK_BINS: tl.constexpr = SHARE[4]
    agg_acc_ptr, warm_acc_ptr, base_acc_ptr, counts_acc_ptr = shares
    if MODE != MODE_ALL and MODE != MODE_STATIC:
        tl.atomic_max(warm_acc_ptr + e, warm, mask=e_ok & (warm != 0), sem="relaxed")
    if NEED_SCORES:
        tl.atomic_add(agg_acc_ptr + e, agg, mask=e_ok & (agg != 0), sem="relaxed")
    if MODE == MODE_COVERAGE:
        tl.atomic_add(cover_agg_ptr + e, cover_agg, mask=e_ok & (cover_agg != 0), sem="relaxed")
    if PER_REQUEST:
        tl.atomic_max(base_acc_ptr + e, base, mask=e_ok & (base != 0), sem="relaxed")
    if LYNX:
        bin_id = tl.arange(0, BLOCK_BINS)
        tl.atomic_add(
            counts_acc_ptr + e[:, None] * BLOCK_BINS + bin_id[None, :],
            counts,
            mask=e_ok[:, None] & (counts != 0),
            sem="relaxed",
        )


@triton.jit
def load_shares(
    shares,
    agg,
    warm,
    base,
    counts,
    e,
    e_ok,
    SHARE: tl.constexpr,
):
    """Phase 3, above one program: the call's totals, once every program's share is in the
    accumulators (its atomics precede its ticket).  ``SHARE`` as :func:`add_share`'s."""
    MODE: tl.constexpr = SHARE[0]
    NEED_SCORES: tl.constexpr = SHARE[1]
    PER_REQUEST: tl.constexpr = SHARE[2]
    LYNX: tl.constexpr = SHARE[3]
    BLOCK_BINS: tl.constexpr = SHARE[4]
    agg_acc_ptr, warm_acc_ptr, base_acc_ptr, counts_acc_ptr = shares
    if MODE != MODE_ALL and MODE != MODE_STATIC:
        warm = tl.load(warm_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
    if NEED_SCORES:
        agg = tl.load(agg_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
    if PER_REQUEST:
        base = tl.load(base_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
    if LYNX:
        bin_id = tl.arange(0, BLOCK_BINS)
        counts = tl.load(
            counts_acc_ptr + e[:, None] * BLOCK_BINS + bin_id[None, :],
            mask=e_ok[:, None],
            other=0,
            cache_modifier=".cg",
        )
    return agg, warm, base, counts


@triton.jit
def clear_shares(
    shares,
    coverage,
    ticket_ptr,
    e,
    e_ok,
    CLEAR: tl.constexpr,
):
    """Phase 5, in the last program above one: what the programs accumulated back at 0 for the next
    call (no reset launch).  Every program added its share before its ticket, so nothing writes these
    any more, and the barrier puts every thread's loads before the zeros.  LYNX's aggregate is still
    read by ``lynx_pick_kernel``, which clears it.  ``CLEAR`` = (MODE, NEED_SCORES, PER_REQUEST, LYNX,
    COVER_LISTS, BLOCK_E, BLOCK_BINS)."""
    MODE: tl.constexpr = CLEAR[0]
    NEED_SCORES: tl.constexpr = CLEAR[1]
    PER_REQUEST: tl.constexpr = CLEAR[2]
    LYNX: tl.constexpr = CLEAR[3]
    COVER_LISTS: tl.constexpr = CLEAR[4]
    BLOCK_E: tl.constexpr = CLEAR[5]
    BLOCK_BINS: tl.constexpr = CLEAR[6]
    agg_acc_ptr, warm_acc_ptr, base_acc_ptr, counts_acc_ptr = shares
    _, _, cover_count_ptr, _, cover_agg_ptr, _ = coverage
    tl.debug_barrier()
    tl.store(ticket_ptr, 0)
    if MODE != MODE_ALL and MODE != MODE_STATIC:
        tl.store(warm_acc_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
    if NEED_SCORES and not LYNX:
        tl.store(agg_acc_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
    if MODE == MODE_COVERAGE:
        tl.store(cover_agg_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
    if COVER_LISTS:
        tl.store(cover_count_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
    if PER_REQUEST:
        tl.store(base_acc_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
    if LYNX:
        bin_id = tl.arange(0, BLOCK_BINS)
        tl.store(
            counts_acc_ptr + e[:, None] * BLOCK_BINS + bin_id[None, :],
            tl.zeros([BLOCK_E, BLOCK_BINS], tl.int32),
            mask=e_ok[:, None],
        )


@triton.jit
def apply_rule(
    agg,
    warm,
    base,
    policy,
    tables,
    coverage,
    num_tokens,
    num_experts,
    n_valid,
    e,
    e_ok,
    RULE: tl.constexpr,
    RANKING: tl.constexpr,
):
    """Phase 3's set rule: the keep mask [E] before the cap and the token range.  ``RULE`` = (MODE,
    SCORE_TOPK, ORDER, SEARCH_STEPS, BLOCK_E, WARPS); ``RANKING`` = (COVER_PAIRS, COVER_LISTS, COVER_T,
    COACT_KEYS, WARP_PICKS), the calibrated rankings' variants."""
    MODE: tl.constexpr = RULE[0]
    SCORE_TOPK: tl.constexpr = RULE[1]
    ORDER: tl.constexpr = RULE[2]
    SEARCH_STEPS: tl.constexpr = RULE[3]
    BLOCK_E: tl.constexpr = RULE[4]
    WARPS: tl.constexpr = RULE[5]
    _, top_k, _, count, tau_q, rank_budget, _, _, _, _, _ = policy
    static_ptr, redundancy_ptr, group_ptr = tables
    if MODE == MODE_ALL:
        keep = e_ok
    elif MODE == MODE_WARM:
        keep = warm != 0
    elif MODE == MODE_GIVEN:
        keep = base != 0
    elif MODE == MODE_STATIC:
        place = tl.load(static_ptr + e, mask=e_ok, other=2147483647)
        keep = e_ok & (place < count) & (n_valid > 0)
    elif MODE == MODE_COVERAGE:
        keep = coverage_rule(
            agg,
            coverage,
            count,
            num_tokens,
            num_experts,
            n_valid,
            e,
            e_ok,
            RANKING[0],
            RANKING[1],
            RANKING[4],
            RANKING[2],
            SEARCH_STEPS,
            BLOCK_E,
            WARPS,
        )
    elif MODE == MODE_COACT:
        keep = coact_rule(
            agg, count, redundancy_ptr, num_experts, n_valid, e, e_ok, RANKING[3], RANKING[4], BLOCK_E, WARPS
        )
    elif MODE == MODE_TOP_AGG:
        keep = top_count_keep(agg, e, e_ok, n_valid, count, top_k, SCORE_TOPK, ORDER)
    else:
        if MODE == MODE_GREEDY_BASE:
            start = base != 0
        else:
            start = warm != 0
        keep = grown_keep(
            start,
            agg,
            e,
            e_ok,
            n_valid,
            count,
            top_k,
            rank_budget,
            tau_q,
            group_ptr,
            num_experts,
            MODE,
            SCORE_TOPK,
            ORDER,
            SEARCH_STEPS,
        )
    return keep


@triton.jit
def select_kernel(
    call,
    split,
    policy,
    tables,
    coverage,
    shares,
    lynx,
    ticket_ptr,
    outputs,
    routing,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    MODE: tl.constexpr,
    NEED_SCORES: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    SIGMOID: tl.constexpr,
    PER_REQUEST: tl.constexpr,
    REQUEST_TOP: tl.constexpr,
    LYNX: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    GATED: tl.constexpr,
    METRIC_SCORES: tl.constexpr,
    HAS_STATS: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
    SINGLE: tl.constexpr,
    ROUTE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TRUNCATION: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_BINS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CHUNK_T: tl.constexpr,
    CHUNK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    COVER_T: tl.constexpr,
    COVER_LISTS: tl.constexpr,
    COVER_PAIRS: tl.constexpr,
    COACT_KEYS: tl.constexpr,
    ROUTE_T: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    ROUTE_KEY_SHIFT: tl.constexpr,
    ROW_WARPS: tl.constexpr,
    GROUP_WARPS: tl.constexpr,
    PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    ORDER: tl.constexpr,
    WARPS: tl.constexpr,
    WARP_PICKS: tl.constexpr,
):
    """The module docstring's five phases; the bundles are the launch wrapper's argument groups
    (:func:`xshare_sglang.kernels.launch.kernel_arguments`)."""
    if PDL:
        gdc_wait()  # launched as a programmatic dependent: the kernel before has finished, its writes seen
    if PDL_TRIGGER:
        gdc_launch_dependents()  # the call's next kernel may launch now; it waits for this one to finish
    _, _, _, num_tokens, num_experts, n_valid_ptr, n_valid_arg, _ = call
    keep_ptr, metrics_ptr, metrics_gate_ptr, stats_ptr = outputs
    pid = tl.program_id(0)
    num_parts = tl.num_programs(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    collect = metrics_on(metrics_gate_ptr, GATED)
    # scores wanted: always when the rule, its cap or the stats read them; when only the metrics do
    # (METRIC_SCORES: oea, static moe-spec and LYNX in one program), only in calls that add metrics
    if METRIC_SCORES:
        scoring = collect
    else:
        scoring = tl.full([], 1, tl.int1)
    agg, cover_agg, warm, base, counts = read_rows(
        call,
        split,
        policy,
        coverage,
        pid,
        n_valid,
        scoring,
        e,
        e_ok,
        (MODE, NEED_SCORES, SCORE_TOPK, SIGMOID, PER_REQUEST, REQUEST_TOP, LYNX, SINGLE, COVER_PAIRS, COVER_LISTS),
        (HAS_WEIGHTS, KEY_SHIFT, BLOCK_E, BLOCK_BINS, CHUNK_T),
    )
    if SINGLE:
        last = True
    else:
        add_share(
            shares,
            coverage[4],
            agg,
            cover_agg,
            warm,
            base,
            counts,
            e,
            e_ok,
            (MODE, NEED_SCORES, PER_REQUEST, LYNX, BLOCK_BINS),
        )
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        last = ticket == num_parts - 1
    if last:
        if not SINGLE:
            agg, warm, base, counts = load_shares(
                shares, agg, warm, base, counts, e, e_ok, (MODE, NEED_SCORES, PER_REQUEST, LYNX, BLOCK_BINS)
            )
        if LYNX:
            base = lynx_order(
                lynx,
                call,
                policy,
                counts,
                n_valid,
                e,
                e_ok,
                (SINGLE, HAS_WEIGHTS, KEY_SHIFT, BLOCK_E, BLOCK_BINS, CHUNK, CHUNK_T),
            )
    if LYNX and not SINGLE:
        finish = False  # lynx_pick_kernel finishes the mask
    else:
        finish = last
    if finish:
        keep = apply_rule(
            agg,
            warm,
            base,
            policy,
            tables,
            coverage,
            num_tokens,
            num_experts,
            n_valid,
            e,
            e_ok,
            (MODE, SCORE_TOPK, ORDER, SEARCH_STEPS, BLOCK_E, WARPS),
            (COVER_PAIRS, COVER_LISTS, COVER_T, COACT_KEYS, WARP_PICKS),
        )
        cap, min_tokens, max_tokens = policy[6], policy[7], policy[8]
        keep = finish_keep(
            keep,
            warm != 0,
            agg,
            e,
            e_ok,
            n_valid,
            cap,
            min_tokens,
            max_tokens,
            keep_ptr,
            metrics_ptr,
            collect,
            stats_ptr,
            HAS_CAP,
            HAS_RANGE,
            HAS_METRICS,
            HAS_STATS,
            NEED_SCORES,
            ROUTE_MASS,
        )
        if SINGLE and ROUTE:
            route_rows(
                call,
                routing,
                keep,
                n_valid,
                e,
                e_ok,
                metrics_ptr,
                collect,
                HAS_METRICS,
                ROUTE_T,
                (HAS_WEIGHTS, HAS_BIAS, SIGMOID, RENORMALIZE, TRUNCATION, GROUPED, HAS_SCALE, FILL),
                (BLOCK_E, BLOCK_K, BLOCK_G, GROUP_SIZE, ROUTE_KEY_SHIFT, ROW_WARPS, GROUP_WARPS),
            )
    if not SINGLE:
        if last:
            clear_shares(
                shares,
                coverage,
                ticket_ptr,
                e,
                e_ok,
                (MODE, NEED_SCORES, PER_REQUEST, LYNX, COVER_LISTS, BLOCK_E, BLOCK_BINS),
            )
