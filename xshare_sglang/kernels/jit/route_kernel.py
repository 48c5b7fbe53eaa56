"""``route_kernel``: the routing of a call above one program, a tile of rows per program; and
``fill_kernel``, which zeroes the coverage ranking's pair sums as a dependent launch.

Each routing program reads the keep mask the selection (or ``lynx_pick_kernel``) wrote, or derives it:
``none`` keeps every expert and static moe-spec's calibrated set is known before the call, so those
launch this kernel alone and its program 0 writes the mask and the call's metrics.  Each program then
routes its rows (:func:`~.routing.route_tile`), adds the experts it routed a token to
(:func:`~.metrics.count_activated`) and, for the rules that need no scores, its rows' retained mass
(:func:`~.metrics.add_route_mass`).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .metrics import add_metric, add_route_mass, count_activated, metrics_on
from .routing import route_tile
from .rows import num_valid_tokens


@triton.jit
def routing_keep(state, tables, pid, n_valid, num_experts, e, e_ok, collect, MASK: tl.constexpr):
    """The keep mask [E] a routing program routes in: every expert (``ALL_KEPT``: policy ``none``),
    static moe-spec's calibrated set (``STATIC_KEEP``: the selection's static rule and token range, no
    cap for moe-spec), or the mask in memory.  Where this program derives it, program 0 stores it and
    adds the kept count and the call (and ``none``'s whole retained mass) to the metrics.  ``MASK`` =
    (ALL_KEPT, STATIC_KEEP, HAS_RANGE, HAS_METRICS)."""
    ALL_KEPT: tl.constexpr = MASK[0]
    STATIC_KEEP: tl.constexpr = MASK[1]
    HAS_RANGE: tl.constexpr = MASK[2]
    HAS_METRICS: tl.constexpr = MASK[3]
    keep_ptr, _, _, metrics_ptr, _, _ = state
    static_ptr, static_count, min_tokens, max_tokens = tables
    if ALL_KEPT:
        keep = e_ok
        if pid == 0:
            tl.store(keep_ptr + e, keep, mask=e_ok)
            if HAS_METRICS:
                if collect:
                    add_metric(metrics_ptr + 1, num_experts)
                    add_metric(metrics_ptr + 2, 1 << 24)
                    add_metric(metrics_ptr + 3, 1)
    elif STATIC_KEEP:
        place = tl.load(static_ptr + e, mask=e_ok, other=2147483647)
        keep = e_ok & (place < static_count) & (n_valid > 0)
        if HAS_RANGE:
            keep = tl.where((n_valid >= min_tokens) & (n_valid <= max_tokens), keep, e_ok)
        if pid == 0:
            tl.store(keep_ptr + e, keep, mask=e_ok)
            if HAS_METRICS:
                if collect:
                    add_metric(metrics_ptr + 1, tl.sum(keep.to(tl.int32), axis=0))
                    add_metric(metrics_ptr + 3, 1)
    else:
        keep = (tl.load(keep_ptr + e, mask=e_ok, other=0) != 0) & e_ok
    return keep


@triton.jit
def route_kernel(
    call,
    routing,
    state,
    tables,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TRUNCATION: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FILL: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    GATED: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    SCORE_KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CHUNK_T: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    ALL_KEPT: tl.constexpr,
    STATIC_KEEP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    ROW_WARPS: tl.constexpr,
    GROUP_WARPS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The module docstring's routing program; the bundles are the launch wrapper's argument groups
    (:func:`xshare_sglang.kernels.launch.kernel_arguments`)."""
    if PDL:
        gdc_wait()
    _, _, _, num_tokens, num_experts, n_valid_ptr, n_valid_arg, _ = call
    _, visits_ptr, _, metrics_ptr, metrics_gate_ptr, _ = state
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    collect = metrics_on(metrics_gate_ptr, GATED)
    keep = routing_keep(
        state, tables, pid, n_valid, num_experts, e, e_ok, collect, (ALL_KEPT, STATIC_KEEP, HAS_RANGE, HAS_METRICS)
    )
    rows = pid * CHUNK_T + tl.arange(0, CHUNK_T)
    used = route_tile(
        call,
        routing,
        rows,
        rows < num_tokens,
        n_valid,
        keep,
        e,
        e_ok,
        (HAS_WEIGHTS, HAS_BIAS, SIGMOID, RENORMALIZE, TRUNCATION, GROUPED, HAS_SCALE, FILL),
        (BLOCK_E, BLOCK_K, BLOCK_G, GROUP_SIZE, KEY_SHIFT, ROW_WARPS, GROUP_WARPS),
    )
    if HAS_METRICS:
        if collect:
            count_activated(visits_ptr, metrics_ptr, used, e, e_ok, BLOCK_E)
    if ROUTE_MASS:
        top_k = routing[5]
        add_route_mass(
            call,
            state,
            rows,
            n_valid,
            keep,
            e,
            e_ok,
            top_k,
            collect,
            (HAS_WEIGHTS, SCORE_TOPK, SIGMOID, SCORE_KEY_SHIFT),
        )


@triton.jit
def fill_kernel(ptr, numel, BLOCK: tl.constexpr):
    """Zero ``numel`` int32 words at ``ptr``: the coverage ranking's pair sums before a multi-program
    call launched as programmatic dependents (otherwise the wrapper zeroes them with torch).  It waits
    for the kernel before it (which may still read the counters) and lets the selection kernel launch
    at once; the selection waits for these zeros on the device."""
    gdc_wait()
    gdc_launch_dependents()
    for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < numel)
