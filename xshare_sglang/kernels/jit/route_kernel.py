"""``route_kernel``: the routing of a call above one program, a tile of rows per program; and
``fill_kernel``, which zeroes the coverage ranking's pair sums as a dependent launch.

Each routing program reads the keep mask the selection (or ``lynx_pick_kernel``) wrote, or derives it:
``none`` keeps every expert and static moe-spec's calibrated set is known before the call, so those
launch this kernel alone and its program 0 writes the mask and the call's metrics.  Each program then
routes its rows (:func:`~.routing.route_block`), adds the experts it routed a token to
(:func:`~.metrics.count_activated`) and, for the rules that need no scores, its rows' retained mass
(:func:`~.metrics.add_route_mass`).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .metrics import add_metric, add_route_mass, count_activated, metrics_on
from .routing import route_block
from .rows import num_valid_tokens


@triton.jit
def routing_keep(
    state, tables, pid, n_valid, num_experts, e, e_ok, collect, MASK: tl.constexpr, HAS_METRICS: tl.constexpr
):
    """The keep mask [E] a routing program routes in: every expert (``ALL_KEPT``: policy ``none``),
    static moe-spec's calibrated set (``STATIC_KEEP``: the selection's static rule and token range, no
    cap for moe-spec), or the mask in memory.  Where this program derives it, program 0 stores it and
    adds the kept count and the call (and ``none``'s whole retained mass) to the metrics.  ``MASK``: a
    :class:`~xshare_sglang.kernels.bundles.Mask`."""
    keep_ptr = state.keep_ptr
    metrics_ptr = state.metrics_ptr
    if MASK.ALL_KEPT:
        keep = e_ok
        if pid == 0:
            tl.store(keep_ptr + e, keep, mask=e_ok)
            if HAS_METRICS:
                if collect:
                    add_metric(metrics_ptr + 1, num_experts)
                    add_metric(metrics_ptr + 2, 1 << 24)
                    add_metric(metrics_ptr + 3, 1)
    elif MASK.STATIC_KEEP:
        place = tl.load(tables.static_ptr + e, mask=e_ok, other=2147483647)
        keep = e_ok & (place < tables.static_count) & (n_valid > 0)
        if MASK.HAS_RANGE:
            keep = tl.where((n_valid >= tables.min_tokens) & (n_valid <= tables.max_tokens), keep, e_ok)
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
    ROWS: tl.constexpr,
    ROUTER: tl.constexpr,
    MASK: tl.constexpr,
    MASS: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    GATED: tl.constexpr,
    CHUNK_T: tl.constexpr,
    PDL: tl.constexpr,
):
    """The module docstring's routing program.  The bundles are the named tuples of
    :mod:`xshare_sglang.kernels.bundles`; ``MASS`` (a ``RouteMass``) is None unless this kernel adds
    the retained mass."""
    if PDL:
        gdc_wait()
    num_tokens = call.num_tokens
    num_experts = call.num_experts
    pid = tl.program_id(0)
    e = tl.arange(0, ROUTER.BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(call.n_valid_ptr, call.n_valid_arg, num_tokens, ROWS.HAS_NV_PTR)
    collect = metrics_on(state.metrics_gate_ptr, GATED)
    keep = routing_keep(state, tables, pid, n_valid, num_experts, e, e_ok, collect, MASK, HAS_METRICS)
    rows = pid * CHUNK_T + tl.arange(0, CHUNK_T)
    used = route_block(call, routing, rows, rows < num_tokens, n_valid, keep, e, e_ok, ROUTER)
    if HAS_METRICS:
        if collect:
            count_activated(state.visits_ptr, state.metrics_ptr, used, e, e_ok, ROUTER.BLOCK_E)
    if MASS is not None:
        add_route_mass(
            call, state, rows, n_valid, keep, e, e_ok, routing.top_k, collect, ROUTER.HAS_WEIGHTS, ROUTER.SIGMOID, MASS
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
