"""``lynx_pick_kernel``: LYNX's per-token picks above one program, a tile of rows per program.

The selection's last program ranked the experts by LYNX's batch order and stored the ranks; each
program here takes the picks of its rows (:func:`~.lynx.lynx_picks`), marks them with atomics and takes
a ticket; the last program finishes the mask (:func:`~.finish.finish_keep`) and clears the marks, the
aggregate and the ticket.  The serial work per program is one tile, whatever T.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .finish import finish_keep
from .lynx import lynx_picks
from .metrics import metrics_on
from .rows import num_valid_tokens


@triton.jit
def lynx_pick_kernel(
    call,
    policy,
    workspace,
    outputs,
    ROWS: tl.constexpr,
    FINISH: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
    PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
):
    """The module docstring's programs; the bundles are the named tuples of
    :mod:`xshare_sglang.kernels.bundles` (``policy``: :class:`~xshare_sglang.kernels.bundles.LynxPolicyArgs`,
    ``workspace``: :class:`~xshare_sglang.kernels.bundles.LynxPickArgs`)."""
    if PDL:
        gdc_wait()
    if PDL_TRIGGER:
        gdc_launch_dependents()
    num_tokens = call.num_tokens
    agg_acc_ptr = workspace.agg_acc_ptr
    picked_ptr = workspace.picked_ptr
    ticket_ptr = workspace.ticket_ptr
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < call.num_experts
    n_valid = num_valid_tokens(call.n_valid_ptr, call.n_valid_arg, num_tokens, ROWS.HAS_NV_PTR)
    s_rank = tl.load(workspace.s_rank_ptr + e, mask=e_ok, other=0)
    first_row = pid * CHUNK_T
    end_row = tl.minimum(first_row + CHUNK_T, num_tokens)
    picked = lynx_picks(
        call, policy, first_row, end_row, n_valid, s_rank, e, e_ok, ROWS.HAS_WEIGHTS, KEY_SHIFT, BLOCK_E, CHUNK_T
    )
    tl.atomic_max(picked_ptr + e, picked, mask=e_ok & (picked != 0))
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        keep = (tl.load(picked_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") != 0) & e_ok
        agg = tl.zeros([BLOCK_E], tl.int64)
        if FINISH.NEED_SCORES:
            agg = tl.load(agg_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
        finish_keep(
            keep,
            e < 0,
            agg,
            e,
            e_ok,
            n_valid,
            policy,
            outputs,
            metrics_on(outputs.metrics_gate_ptr, FINISH.GATED),
            FINISH,
        )
        # the marks, the aggregate and the ticket back at 0 for the next call (after every thread's loads)
        tl.debug_barrier()
        tl.store(ticket_ptr, 0)
        tl.store(picked_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
        if FINISH.NEED_SCORES:
            tl.store(agg_acc_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
