"""The set rules' building blocks: the [E, E] order of experts, prefix sums, greedy picks, the cap.

An order over experts is one comparison of packed keys across all pairs in registers and one column
sum (:func:`places`); it is skipped where the launch's rows settle its answer (``ORDER``). The end of
every rule (:func:`finish_keep`) applies the ``max_experts`` cap, the token range, stores the mask and
adds the call's metrics.
"""

import triton
import triton.language as tl

from .keys import ID_BITS, MIN_KEY, order_key
from .metrics import add_metric
from .numerics import retained_share, threshold_target

# The selection kernel's set rule (constexpr MODE), the values of xshare_sglang.kernels.plan.Mode
MODE_WARM = tl.constexpr(0)  # oea
MODE_GREEDY_WARM = tl.constexpr(1)  # xshare
MODE_GREEDY_BASE = tl.constexpr(2)  # xshare-spec (base = union of per-request sets)
MODE_THRESHOLD = tl.constexpr(3)  # xshare-threshold
MODE_RANK_ROUNDS = tl.constexpr(4)  # xshare-ep
MODE_TOP_AGG = tl.constexpr(5)  # moe-spec, router ranking
MODE_STATIC = tl.constexpr(6)  # moe-spec, static ranking (precomputed places)
MODE_GIVEN = tl.constexpr(7)  # moe-spec per request, lynx (base = union)
MODE_ALL = tl.constexpr(8)  # none: every expert
MODE_COACT = tl.constexpr(9)  # moe-spec, co-activation ranking (greedy with redundancy discounts)
MODE_COVERAGE = tl.constexpr(10)  # moe-spec, coverage ranking (greedy on uncovered per-token mass)
WARM_FIRST = tl.constexpr(2**52)  # cap key: warm-up experts ahead of any aggregate (< 2**47)


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


@triton.jit
def finish_keep(
    keep,
    warm_b,
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
    HAS_CAP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    HAS_STATS: tl.constexpr,
    NEED_SCORES: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
):
    """The end of every set rule: the ``max_experts`` cap (warm-up experts first, then by aggregate),
    the token range, then store the mask, the score stats and the per-call metrics.  Returns keep.

    The metrics are added with relaxed atomics whose result is unused (``RED`` on sm_90): the GPU
    queues them without waiting, where a load-add-store waited a memory round trip per column and
    held back every load after it (the routing's logits in a one-program call).  Without scores
    (policy ``none``, every expert kept) the retained mass is whole.  With ``ROUTE_MASS`` the routing
    kernel adds the retained mass (``route_mass``), and this adds the other two columns.  ``collect``:
    this call adds its metrics (:func:`metrics_on`)."""
    if HAS_CAP:
        # the [E, E] order only when the cap binds
        if tl.sum((keep & e_ok).to(tl.int32), axis=0) > cap:
            cap_key = warm_b.to(tl.int64) * WARM_FIRST + agg
            place = places(cap_key, keep, e, e_ok, e, False)
            keep = keep & (place < cap)
    if HAS_RANGE:
        in_range = (n_valid >= min_tokens) & (n_valid <= max_tokens)
        keep = tl.where(in_range, keep, e_ok)
    keep = keep & e_ok
    tl.store(keep_ptr + e, keep, mask=e_ok)
    if HAS_STATS:
        tl.store(stats_ptr, tl.sum(tl.where(keep, agg, 0), axis=0))
        tl.store(stats_ptr + 1, tl.sum(agg, axis=0))
    if HAS_METRICS:
        if collect:
            if NEED_SCORES and not ROUTE_MASS:
                total = tl.sum(agg, axis=0)
                # the kept mass and the kept count in one sum: agg << 10 | 1 per kept expert (aggregates
                # stay below 2**53 and at most 512 experts are kept, as the set rules' order keys assume)
                kept_packed = tl.sum(tl.where(keep, (agg << 10) + 1, 0), axis=0)
                kept_count = kept_packed & 1023
                retained = retained_share(kept_packed >> 10, total)
            else:
                kept_count = tl.sum(keep.to(tl.int32), axis=0)
                retained = tl.full([], 1 << 24, tl.int64)
            add_metric(metrics_ptr + 1, kept_count)
            if not ROUTE_MASS:
                add_metric(metrics_ptr + 2, retained)
            add_metric(metrics_ptr + 3, 1)
    return keep


@triton.jit
def top_count_keep(agg, e, e_ok, n_valid, count, top_k, SCORE_TOPK: tl.constexpr, ORDER: tl.constexpr):
    """The router ranking's top ``count`` by aggregate.  The [E, E] order only when more experts than
    the count can have an aggregate: with top-k scores at most ``n_valid x top_k`` (a branch on a value
    the whole block holds; ``ORDER`` off when the launch's rows settle it); otherwise the scored
    experts, then the rest in index order (:func:`places_scored_first`)."""
    if ORDER:
        if SCORE_TOPK:
            if n_valid * top_k > count:
                place = places(agg, e_ok, e, e_ok, e, False)
            else:
                place = places_scored_first(agg, e_ok)
        else:
            place = places(agg, e_ok, e, e_ok, e, False)
    else:
        place = places_scored_first(agg, e_ok)
    return e_ok & (place < count) & (n_valid > 0)


@triton.jit
def grown_keep(
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
    MODE: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    ORDER: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """The rules that grow a start set with the candidates (experts outside it with an aggregate):
    expert-parallel rounds (``xshare-ep``), a mass threshold (``xshare-threshold``) or a greedy budget
    (``xshare``, ``xshare-spec``).  With top-k scores at most ``n_valid x top_k`` experts are candidates;
    when every candidate is taken anyway the [E, E] order is skipped (a branch on a value the whole
    block holds)."""
    candidate = e_ok & (~start) & (agg > 0)
    if MODE == MODE_RANK_ROUNDS:
        group_e = tl.load(group_ptr + e, mask=e_ok, other=-1)
        target = rank_budget * (tl.max(tl.where(e_ok, group_e, -1), axis=0) + 1)
        # |start| and the candidates in one sum (disjoint sets, E < 2**16)
        both = tl.sum(start.to(tl.int32) + (candidate.to(tl.int32) << 16), axis=0)
        kept = (both & 0xFFFF).to(tl.int64)
        if kept + (both >> 16) > target:
            place = places(agg, candidate, e, e_ok, group_e, True)
            # fewest rounds R in [0, E] with |start| + #{candidates placed < R} >= target; monotone: bisect
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
        else:
            # the target is not passed before every candidate is in: the rounds take them all
            keep = start | candidate
    elif MODE == MODE_THRESHOLD:
        kept_mass = tl.sum(tl.where(start, agg, 0), axis=0)
        needed = threshold_target(tl.sum(agg, axis=0), tau_q)
        keep = start | prefix_keep(agg, candidate, e, kept_mass, needed)
    else:
        if SCORE_TOPK:
            most = n_valid * top_k
        else:
            most = tl.full([], 0, tl.int64) + num_experts
        keep = start
        if count > 0:
            if ORDER:
                if most > count:
                    place = places(agg, candidate, e, e_ok, e, False)
                    keep = start | (candidate & (place < count))
                else:
                    keep = start | candidate  # every candidate's place is below count
            else:
                keep = start | candidate  # the plan knows that T x top_k <= count
    return keep
