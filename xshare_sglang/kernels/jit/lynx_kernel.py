"""``lynx_pick_kernel``: LYNX's per-token picks above one program, a tile of rows per program.

The selection's last program ranked the experts by LYNX's batch order and stored the ranks; each
program here takes the picks of its rows (:func:`~.lynx.lynx_picks`), marks them with atomics and takes
a ticket; the last program finishes the mask (:func:`~.rules.finish_keep`) and clears the marks, the
aggregate and the ticket.  The serial work per program is one tile, whatever T.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .lynx import lynx_picks
from .metrics import metrics_on
from .rows import num_valid_tokens
from .rules import finish_keep


@triton.jit
def lynx_pick_kernel(
    call,
    policy,
    workspace,
    outputs,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NEED_SCORES: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    GATED: tl.constexpr,
    HAS_STATS: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
    PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
):
    """The module docstring's programs; ``policy`` = (top_k, alpha, beta, cap, min_tokens, max_tokens),
    ``workspace`` = (the ranks, the aggregate, the marks, the ticket), ``outputs`` = (keep, metrics,
    metrics gate, stats)."""
    if PDL:
        gdc_wait()
    if PDL_TRIGGER:
        gdc_launch_dependents()
    logits_ptr, stride_t, stride_e, num_tokens, num_experts, n_valid_ptr, n_valid_arg, weights_ptr = call
    top_k, alpha, beta, cap, min_tokens, max_tokens = policy
    s_rank_ptr, agg_acc_ptr, picked_ptr, ticket_ptr = workspace
    keep_ptr, metrics_ptr, metrics_gate_ptr, stats_ptr = outputs
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    s_rank = tl.load(s_rank_ptr + e, mask=e_ok, other=0)
    first_row = pid * CHUNK_T
    picked = lynx_picks(
        logits_ptr,
        stride_t,
        stride_e,
        first_row,
        tl.minimum(first_row + CHUNK_T, num_tokens),
        n_valid,
        weights_ptr,
        s_rank,
        e,
        e_ok,
        top_k,
        alpha,
        beta,
        HAS_WEIGHTS,
        KEY_SHIFT,
        BLOCK_E,
        CHUNK_T,
    )
    tl.atomic_max(picked_ptr + e, picked, mask=e_ok & (picked != 0))
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        keep = (tl.load(picked_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") != 0) & e_ok
        agg = tl.zeros([BLOCK_E], tl.int64)
        if NEED_SCORES:
            agg = tl.load(agg_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
        finish_keep(
            keep,
            e < 0,
            agg,
            e,
            e_ok,
            n_valid,
            cap,
            min_tokens,
            max_tokens,
            keep_ptr,
            metrics_ptr,
            metrics_on(metrics_gate_ptr, GATED),
            stats_ptr,
            HAS_CAP,
            HAS_RANGE,
            HAS_METRICS,
            HAS_STATS,
            NEED_SCORES,
            ROUTE_MASS,
        )
        # the marks, the aggregate and the ticket back at 0 for the next call (after every thread's loads)
        tl.debug_barrier()
        tl.store(ticket_ptr, 0)
        tl.store(picked_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
        if NEED_SCORES:
            tl.store(agg_acc_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
