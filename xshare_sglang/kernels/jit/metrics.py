"""The per-call metrics row: kept and activated experts, retained score mass, calls.

The metrics are relaxed atomic adds nobody reads back (``RED`` on sm_90). With a device gate every
program of every kernel of a call reads one int32 word (:func:`metrics_on`) and, while it is 0, adds
no metrics and skips their work, every program taking the same branch. Above one program the rules
that need no scores leave the retained mass to the routing kernel (:func:`route_mass`).
"""

import triton
import triton.language as tl

from .keys import pack_key
from .numerics import fixed_scores, retained_share
from .rows import load_rows, row_ranks


@triton.jit
def add_metric(ptr, value):
    """Add ``value`` (an integer) to one int64 metric: a relaxed atomic nobody waits for (see finish_keep)."""
    tl.atomic_add(ptr, tl.zeros([], tl.int64) + value, sem="relaxed")


@triton.jit
def metrics_on(gate_ptr, GATED: tl.constexpr):
    """Whether this call adds its metrics: with ``GATED``, the caller's device gate (an int32, nonzero:
    add them), read by every program, so every program of every kernel of the call takes the same
    branch; without, always.  (A constant true branch compiles away.)"""
    if GATED:
        return tl.load(gate_ptr) != 0
    else:
        return tl.full([], 1, tl.int1)


@triton.jit
def route_mass(
    logits_ptr,
    stride_t,
    stride_e,
    rows,
    rows_in_block,
    n_valid,
    weights_ptr,
    keep,
    e,
    e_ok,
    top_k,
    HAS_WEIGHTS: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    SIGMOID: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
):
    """The kept and the total score mass of a routing tile's voting rows (int64 scalars): the
    selection's aggregate of these rows, summed over the kept experts and over all of them.

    For the rules that need no scores (``oea``, static moe-spec, LYNX) the selection computed the
    scores above one program only for the retained-mass metric, on the call's critical path (scores,
    E atomics, the ticket, the last program's loads and sums); the routing programs hold their rows
    and the final mask, so each adds two sums instead.  Exact: the same integer terms as the
    selection's aggregate, summed in another order."""
    x, _voting, wq = load_rows(
        logits_ptr, stride_t, stride_e, rows, rows_in_block, n_valid, e, e_ok, weights_ptr, HAS_WEIGHTS
    )
    candidate = (x > float("-inf")) & e_ok[None, :]
    if SCORE_TOPK:
        member = row_ranks(pack_key(x, e[None, :], candidate, KEY_SHIFT), top_k, KEY_SHIFT) < top_k
    else:
        member = candidate
    # (a row that does not vote reads as -inf: no member, every score 0)
    q = fixed_scores(x, member, wq, SIGMOID, SCORE_TOPK, HAS_WEIGHTS)
    return tl.sum(tl.sum(tl.where(keep[None, :], q, 0), axis=1), axis=0), tl.sum(tl.sum(q, axis=1), axis=0)


@triton.jit
def count_activated(visits_ptr, metrics_ptr, used, e, e_ok, BLOCK_E: tl.constexpr):
    """Add the experts the call routed a token to, without a ticket: each routing program adds to
    every expert's int64 word one visit (low half) and, where it routed a token (``used``), one mark
    (high half).  The program whose add finds P - 1 visits before its own is the last to touch that
    word in this call: it counts the expert when any program marked it, and clears the word."""
    visit = tl.where(used != 0, (1 << 32) + 1, 1).to(tl.int64)
    before = tl.atomic_add(visits_ptr + e, visit, mask=e_ok, sem="relaxed")
    marks_before = before >> 32
    last_visit = e_ok & (before - (marks_before << 32) == tl.num_programs(0) - 1)
    activated = last_visit & ((marks_before > 0) | (used != 0))
    tl.atomic_add(metrics_ptr + e * 0, tl.full([BLOCK_E], 1, tl.int64), mask=activated, sem="relaxed")
    tl.store(visits_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=last_visit)


@triton.jit
def add_route_mass(
    call,
    state,
    rows,
    n_valid,
    keep,
    e,
    e_ok,
    top_k,
    collect,
    HAS_WEIGHTS: tl.constexpr,
    SIGMOID: tl.constexpr,
    MASS: tl.constexpr,
):
    """The retained mass of a rule that needs no scores, from the routing programs: each adds its
    tile's kept and total score mass (:func:`route_mass`), takes a ticket, and the last divides and
    adds the share to the metrics, then clears the sums.  Only in calls that add metrics (the same gate
    in every program: all of them take a ticket, or none).  ``MASS``: a
    :class:`~xshare_sglang.kernels.bundles.RouteMass`."""
    ticket_ptr = state.ticket_ptr
    metrics_ptr = state.metrics_ptr
    mass_ptr = state.mass_ptr
    if collect:
        kept_mass, total_mass = route_mass(
            call.logits_ptr,
            call.stride_t,
            call.stride_e,
            rows,
            rows < call.num_tokens,
            n_valid,
            call.weights_ptr,
            keep,
            e,
            e_ok,
            top_k,
            HAS_WEIGHTS,
            MASS.SCORE_TOPK,
            SIGMOID,
            MASS.KEY_SHIFT,
        )
        tl.atomic_add(mass_ptr, kept_mass, sem="relaxed")
        tl.atomic_add(mass_ptr + 1, total_mass, sem="relaxed")
    if collect:
        tl.debug_barrier()  # every thread's atomics and stores before the ticket (acquire-release)
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            tl.store(ticket_ptr, 0)  # every program has its ticket: back at 0 for the next call
            kept_total = tl.load(mass_ptr, cache_modifier=".cg")
            total = tl.load(mass_ptr + 1, cache_modifier=".cg")
            add_metric(metrics_ptr + 2, retained_share(kept_total, total))
            tl.debug_barrier()  # every thread's loads before the zeros
            tl.store(mass_ptr, tl.zeros([], tl.int64))
            tl.store(mass_ptr + 1, tl.zeros([], tl.int64))
