"""``select_kernel``: the keep mask of one layer call, and in a one-program call its routing too.

A grid of P programs over the tokens, in five phases:

1. **load** (:func:`read_rows`, a request at a time, each a tile at a time by :func:`read_tile`): each
   program reads its rows once (requests never straddle programs) and builds its share: aggregate
   scores, warm-up and per-request sets, LYNX bin counts, the coverage ranking's column sums and pair
   sums or row lists;
2. **share** (:func:`add_share`): above one program, each adds its share into the workspace's
   accumulators with integer atomics, then takes a ticket (acquire-release);
3. **rule**: the program holding the last ticket loads the accumulators (:func:`load_shares`) and
   applies the set rule (``RULE``, :mod:`.rules`), the cap and the token range (:func:`~.finish.finish_keep`),
   which stores the mask and the call's metrics. LYNX above one program stores its batch order here
   and leaves the picks and the mask to ``lynx_pick_kernel``;
4. **route** (:func:`route_rows`): with P = 1 the same program routes every row, one launch in all;
5. **clear** (:func:`clear_shares`): the last program puts what the programs accumulated back to 0.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .coverage import COVER_BITS, add_coverage_rows
from .finish import finish_keep
from .keys import pack_key
from .lynx import lynx_bin_counts, lynx_order
from .metrics import metrics_on
from .numerics import SCORE_BITS, fixed_scores
from .order import greedy_iterative
from .routing import route_rows
from .rows import load_rows, num_valid_tokens, row_ranks


@triton.jit
def read_tile(
    call,
    policy,
    coverage,
    rows,
    in_block,
    n_valid,
    n_iter,
    scoring,
    e,
    e_ok,
    votes_r,
    counts,
    warm_r,
    agg_r,
    cover_agg,
    ROWS: tl.constexpr,
    SCORES: tl.constexpr,
    READ: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The per-row reader: one tile of rows ``rows`` [CHUNK_T] added to its request's sums (votes,
    warm-up marks [E] int32, aggregate [E] int64) and the program's (LYNX bin counts [E, BINS], the
    coverage ranking's column sums [E] int64 and its rows).  Returns the five sums."""
    x, row_ok, wq = load_rows(
        call.logits_ptr,
        call.stride_t,
        call.stride_e,
        rows,
        in_block,
        n_valid,
        e,
        e_ok,
        call.weights_ptr,
        ROWS.HAS_WEIGHTS,
    )
    votes_r += tl.sum(row_ok.to(tl.int32), axis=0)
    if READ.LYNX:
        counts += lynx_bin_counts(x, row_ok, e, policy.alpha, policy.beta, READ.CHUNK_T, BLOCK_E, READ.BLOCK_BINS)
    candidate = (x > float("-inf")) & e_ok[None, :]
    key = pack_key(x, e[None, :], candidate, SCORES.KEY_SHIFT)
    rank = row_ranks(key, n_iter, SCORES.KEY_SHIFT)
    warm_rows = (rank < policy.k0) & row_ok[:, None]
    warm_r = tl.maximum(warm_r, tl.max(warm_rows.to(tl.int32), axis=0))
    if SCORES.NEED_SCORES:
        if scoring:
            if SCORES.SCORE_TOPK:
                member = rank < policy.top_k
            else:
                member = candidate
            q = fixed_scores(x, member, wq, SCORES.SIGMOID, SCORES.SCORE_TOPK, ROWS.HAS_WEIGHTS)
            agg_r += tl.sum(tl.where(row_ok[:, None], q, 0), axis=0)
            if READ.COVERAGE and not SINGLE:
                cover_agg += tl.sum(tl.where(row_ok[:, None], q, 0) >> (SCORE_BITS - COVER_BITS), axis=0)
            if READ.COVERAGE:
                add_coverage_rows(coverage, call, policy, q, rank, row_ok, rows, in_block, e, e_ok, READ)
    return votes_r, counts, warm_r, agg_r, cover_agg


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
    ROWS: tl.constexpr,
    SCORES: tl.constexpr,
    READ: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Phase 1: this program's share of the call, from its rows, a request at a time (each a tile at a
    time, :func:`read_tile`, then the request's own set): aggregate scores [E] int64, the coverage
    ranking's column sums [E] int64, warm-up and per-request marks [E] int32, LYNX bin counts [E, BINS]
    int32.  Every rule that reads
    marks (``READ.MARKS``) reads the rows; the others (``keep_all``, ``static``) only for the aggregates
    (the metrics), and only in calls that add them (``scoring``)."""
    BLOCK_BINS: tl.constexpr = READ.BLOCK_BINS
    agg = tl.zeros([BLOCK_E], tl.int64)
    cover_agg = tl.zeros([BLOCK_E], tl.int64)  # the coverage greedy's column sums, on its grid
    warm = tl.zeros([BLOCK_E], tl.int32)
    base = tl.zeros([BLOCK_E], tl.int32)
    counts = tl.zeros([BLOCK_E, BLOCK_BINS], tl.int32)
    first_row = pid * split.rows_per_program
    num_rows = tl.minimum(split.rows_per_program, tl.maximum(call.num_tokens - first_row, 0))
    if READ.MARKS or SCORES.NEED_SCORES:
        if SCORES.NEED_SCORES and SCORES.SCORE_TOPK:
            n_iter = tl.where(scoring, tl.maximum(policy.top_k, policy.k0), policy.k0)
        else:
            n_iter = policy.k0
        if READ.MARKS:
            rows_read = num_rows
        else:
            rows_read = tl.where(scoring, num_rows, 0)  # the rows hold nothing else for these rules
        for r0 in range(0, rows_read, split.rows_per_request):
            # one request's rows, a tile at a time
            agg_r = tl.zeros([BLOCK_E], tl.int64)
            warm_r = tl.zeros([BLOCK_E], tl.int32)
            votes_r = tl.zeros([], tl.int32)
            for c in range(0, split.rows_per_request, READ.CHUNK_T):
                offs = r0 + c + tl.arange(0, READ.CHUNK_T)
                in_block = (offs < num_rows) & (offs < r0 + split.rows_per_request)
                rows = first_row + offs
                votes_r, counts, warm_r, agg_r, cover_agg = read_tile(
                    call,
                    policy,
                    coverage,
                    rows,
                    in_block,
                    n_valid,
                    n_iter,
                    scoring,
                    e,
                    e_ok,
                    votes_r,
                    counts,
                    warm_r,
                    agg_r,
                    cover_agg,
                    ROWS,
                    SCORES,
                    READ,
                    SINGLE,
                    BLOCK_E,
                )
            agg += agg_r
            warm = tl.maximum(warm, warm_r)
            if READ.PER_REQUEST:
                chosen = greedy_iterative(
                    warm_r, agg_r, e, e_ok, policy.request_budget, votes_r > 0, READ.REQUEST_TOP, BLOCK_E
                )
                base = tl.maximum(base, chosen)
    return agg, cover_agg, warm, base, counts


@triton.jit
def add_share(shares, coverage, agg, cover_agg, warm, base, counts, e, e_ok, SCORES: tl.constexpr, READ: tl.constexpr):
    """Phase 2: this program's share, added into the call's accumulators (0 when the call starts: the
    last program of the call before cleared them); integer sums and maxima do not depend on the order
    the programs arrive in."""
    if READ.MARKS:
        tl.atomic_max(shares.warm_acc_ptr + e, warm, mask=e_ok & (warm != 0), sem="relaxed")
    if SCORES.NEED_SCORES:
        tl.atomic_add(shares.agg_acc_ptr + e, agg, mask=e_ok & (agg != 0), sem="relaxed")
    if READ.COVERAGE:
        tl.atomic_add(coverage.cover_agg_ptr + e, cover_agg, mask=e_ok & (cover_agg != 0), sem="relaxed")
    if READ.PER_REQUEST:
        tl.atomic_max(shares.base_acc_ptr + e, base, mask=e_ok & (base != 0), sem="relaxed")
    if READ.LYNX:
        bin_id = tl.arange(0, READ.BLOCK_BINS)
        tl.atomic_add(
            shares.counts_acc_ptr + e[:, None] * READ.BLOCK_BINS + bin_id[None, :],
            counts,
            mask=e_ok[:, None] & (counts != 0),
            sem="relaxed",
        )


@triton.jit
def load_shares(shares, agg, warm, base, counts, e, e_ok, SCORES: tl.constexpr, READ: tl.constexpr):
    """Phase 3, above one program: the call's totals, once every program's share is in the
    accumulators (its atomics precede its ticket)."""
    if READ.MARKS:
        warm = tl.load(shares.warm_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
    if SCORES.NEED_SCORES:
        agg = tl.load(shares.agg_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
    if READ.PER_REQUEST:
        base = tl.load(shares.base_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
    if READ.LYNX:
        bin_id = tl.arange(0, READ.BLOCK_BINS)
        counts = tl.load(
            shares.counts_acc_ptr + e[:, None] * READ.BLOCK_BINS + bin_id[None, :],
            mask=e_ok[:, None],
            other=0,
            cache_modifier=".cg",
        )
    return agg, warm, base, counts


@triton.jit
def clear_shares(
    shares, coverage, ticket_ptr, e, e_ok, SCORES: tl.constexpr, READ: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Phase 5, in the last program above one: what the programs accumulated back at 0 for the next
    call (no reset launch).  Every program added its share before its ticket, so nothing writes these
    any more, and the barrier puts every thread's loads before the zeros.  LYNX's aggregate is still
    read by ``lynx_pick_kernel``, which clears it."""
    tl.debug_barrier()
    tl.store(ticket_ptr, 0)
    if READ.MARKS:
        tl.store(shares.warm_acc_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
    if SCORES.NEED_SCORES and not READ.LYNX:
        tl.store(shares.agg_acc_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
    if READ.COVERAGE:
        tl.store(coverage.cover_agg_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
    if READ.COVER_LISTS:
        tl.store(coverage.cover_count_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
    if READ.PER_REQUEST:
        tl.store(shares.base_acc_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
    if READ.LYNX:
        BLOCK_BINS: tl.constexpr = READ.BLOCK_BINS
        bin_id = tl.arange(0, BLOCK_BINS)
        tl.store(
            shares.counts_acc_ptr + e[:, None] * BLOCK_BINS + bin_id[None, :],
            tl.zeros([BLOCK_E, BLOCK_BINS], tl.int32),
            mask=e_ok[:, None],
        )


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
    ROWS: tl.constexpr,
    SCORES: tl.constexpr,
    READ: tl.constexpr,
    RULE: tl.constexpr,
    RULE_CONFIG: tl.constexpr,
    FINISH: tl.constexpr,
    ROUTER: tl.constexpr,
    ROUTE_T: tl.constexpr,
    SINGLE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
):
    """The module docstring's five phases.  The runtime bundles and the constexpr ones (``ROWS``,
    ``SCORES``, ``READ``, ``FINISH``, ``ROUTER``: None where this program does not route) are the named
    tuples of :mod:`xshare_sglang.kernels.bundles`; ``RULE`` is a set rule of :mod:`.rules` and
    ``RULE_CONFIG`` its config."""
    if PDL:
        gdc_wait()  # launched as a programmatic dependent: the kernel before has finished, its writes seen
    if PDL_TRIGGER:
        gdc_launch_dependents()  # the call's next kernel may launch now; it waits for this one to finish
    pid = tl.program_id(0)
    num_parts = tl.num_programs(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < call.num_experts
    n_valid = num_valid_tokens(call.n_valid_ptr, call.n_valid_arg, call.num_tokens, ROWS.HAS_NV_PTR)
    collect = metrics_on(outputs.metrics_gate_ptr, FINISH.GATED)
    # scores wanted: always when the rule, its cap or the stats read them; when only the metrics do
    # (METRIC_SCORES: oea, static moe-spec and LYNX in one program), only in calls that add metrics
    if SCORES.METRIC_SCORES:
        scoring = collect
    else:
        scoring = tl.full([], 1, tl.int1)
    agg, cover_agg, warm, base, counts = read_rows(
        call, split, policy, coverage, pid, n_valid, scoring, e, e_ok, ROWS, SCORES, READ, SINGLE, BLOCK_E
    )
    if SINGLE:
        last = True
    else:
        add_share(shares, coverage, agg, cover_agg, warm, base, counts, e, e_ok, SCORES, READ)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        last = ticket == num_parts - 1
    if last:
        if not SINGLE:
            agg, warm, base, counts = load_shares(shares, agg, warm, base, counts, e, e_ok, SCORES, READ)
        if READ.LYNX:
            base = lynx_order(lynx, call, policy, counts, n_valid, e, e_ok, ROWS, SCORES, READ, SINGLE, BLOCK_E)
    if READ.LYNX and not SINGLE:
        finish = False  # lynx_pick_kernel finishes the mask
    else:
        finish = last
    if finish:
        keep = RULE(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, RULE_CONFIG)
        keep = finish_keep(keep, warm != 0, agg, e, e_ok, n_valid, policy, outputs, collect, FINISH)
        if SINGLE and ROUTER is not None:
            route_rows(
                call, routing, keep, n_valid, e, e_ok, outputs.metrics_ptr, collect, FINISH.HAS_METRICS, ROUTE_T, ROUTER
            )
    if not SINGLE:
        if last:
            clear_shares(shares, coverage, ticket_ptr, e, e_ok, SCORES, READ, BLOCK_E)
