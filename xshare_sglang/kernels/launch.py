"""Graph-safe launch wrappers of the fused selection kernels.

* :func:`prune_route` - keep mask and pruned routing of one MoE layer call (ids and weights in
  SGLang's ``TopKOutput`` layout), in place of SGLang's own top-k;
* :func:`select_keep_mask` - the keep mask alone.

Same inputs and meaning as the torch references :func:`xshare_sglang.policies.prune_route.prune_route`
and :func:`xshare_sglang.policies.select`, plus preallocated outputs and a workspace, so that a call
inside a CUDA graph allocates nothing and never talks to the host.  What runs is
:func:`~.plan.plan_call`'s answer; this module only passes each launch its arguments.

Where the kernels do not cover a case (CPU tensors without ``TRITON_INTERPRET=1``, E > 512, top_k >
16, more than 32 expert groups, D > 64, LYNX with beta > 14, more than 2**22 tokens, another dtype)
the call goes to the torch reference and a warning says so once per reason.  The answer is the same
either way.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from ..config import PrunerConfig
from ..devices import canonical_device
from ..policies.api import select
from ..policies.call import RoutingCall
from ..policies.greedy import tau_fixed_point
from ..policies.moe_spec import layer_redundancy, static_positions
from ..policies.prune_route import PrunedRouting, check_outputs, route_checked
from ..policies.rewrite import add_metrics, selection_metrics
from ..policies.scores import float32_value
from .plan import (
    MAX_COVERAGE_TOKENS,
    MAX_EXPERTS,
    MAX_GROUPS,
    MAX_LYNX_BETA,
    MAX_TOKENS,
    MAX_TOKENS_PER_REQUEST,
    MAX_TOP_K,
    PRODUCTION_LIMITS,
    SUPPORTED_DTYPES,
    CallPlan,
    CallSpec,
    PlanLimits,
    per_request_policy,
    plan_call,
)
from .workspace import SelectionWorkspace, default_workspace

logger = logging.getLogger(__name__)

_reported: set[str] = set()


def kernel_module():
    """The package that holds the jit kernels, by the names the plan gives them (imports triton)."""
    from . import jit

    return jit


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unsupported_reason(call: RoutingCall, cfg: PrunerConfig) -> str | None:
    """Why the kernels cannot serve this call, or None when they can."""
    logits = call.logits
    if not (logits.is_cuda or (_interpreting() and logits.device.type == "cpu")):
        return f"logits on {logits.device.type} (the kernels need CUDA, or TRITON_INTERPRET=1 on CPU)"
    if logits.dtype not in SUPPORTED_DTYPES:
        return f"logits dtype {logits.dtype} (supported: float32, bfloat16, float16)"
    num_tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS:
        return f"E={num_experts} experts (the kernels support up to {MAX_EXPERTS})"
    if call.top_k > MAX_TOP_K:
        return f"top_k={call.top_k} (the kernels support up to {MAX_TOP_K})"
    if num_tokens > MAX_TOKENS:
        return f"T={num_tokens} tokens (the kernels support up to {MAX_TOKENS})"
    if per_request_policy(cfg) and call.tokens_per_request > MAX_TOKENS_PER_REQUEST:
        return f"tokens_per_request={call.tokens_per_request} (the kernels support up to {MAX_TOKENS_PER_REQUEST})"
    if cfg.policy == "moe-spec" and cfg.ranking == "coverage" and num_tokens > MAX_COVERAGE_TOKENS:
        return f"T={num_tokens} tokens with ranking=coverage (the kernels support up to {MAX_COVERAGE_TOKENS})"
    if cfg.policy == "lynx" and cfg.beta > MAX_LYNX_BETA:
        return f"lynx beta={cfg.beta} (the kernels support up to {MAX_LYNX_BETA})"
    if call.router.num_expert_group > MAX_GROUPS:
        return f"{call.router.num_expert_group} expert groups (the kernels support up to {MAX_GROUPS})"
    return None


def _report(reason: str) -> None:
    if reason not in _reported:
        _reported.add(reason)
        logger.warning("moe-pruner selection uses the torch reference: %s", reason)


def call_spec(
    call: RoutingCall,
    *,
    route: bool,
    fill_dropped: bool,
    outputs: Outputs,
    pdl: bool,
    limits: PlanLimits = PRODUCTION_LIMITS,
) -> CallSpec:
    """What :func:`~.plan.plan_call` needs to know of a call and its outputs (and the plan's limits)."""
    num_tokens, num_experts = call.logits.shape
    metrics = "off" if outputs.metrics_row is None else ("gated" if outputs.metrics_gate is not None else "on")
    return CallSpec(
        num_tokens=num_tokens,
        num_experts=num_experts,
        router=call.router,
        dtype=call.logits.dtype,
        tokens_per_request=call.tokens_per_request,
        layer_id=call.layer_id,
        has_bias=call.correction_bias is not None,
        has_vote_weights=call.token_weights is not None,
        num_valid_on_device=isinstance(call.num_valid_tokens, torch.Tensor),
        route=route,
        fill_dropped=fill_dropped,
        metrics=metrics,
        stats=outputs.stats_out is not None,
        pdl=pdl,
        limits=limits,
    )


@dataclass(frozen=True)
class Outputs:
    """The buffers one call writes (None where the call has none)."""

    keep: torch.Tensor
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    metrics_row: torch.Tensor | None = None
    metrics_gate: torch.Tensor | None = None
    stats_out: torch.Tensor | None = None


#: The names of each kernel's arguments, in the groups the kernels take them in (a tuple flattens into
#: the kernel's parameters in order): for tools that read a launch's arguments by name.
_CALL = ("logits_ptr", "stride_t", "stride_e", "num_tokens", "num_experts", "n_valid_ptr", "n_valid_arg", "weights_ptr")
_ROUTING = (
    *("bias_ptr", "ids_ptr", "ids_stride", "out_w_ptr", "out_w_stride"),
    *("top_k", "topk_group", "group_size", "num_groups", "scale"),
)
_OUTPUTS = ("keep_ptr", "metrics_ptr", "metrics_gate_ptr", "stats_ptr")
_POLICY = ("k0", "top_k", "request_budget", "count", "tau_q", "rank_budget", "cap", "min_tokens", "max_tokens")
ARGUMENT_NAMES = {
    "fill_kernel": ("ptr", "numel"),
    "select_kernel": (
        _CALL,
        ("rows_per_program", "rows_per_request"),
        (*_POLICY, "alpha", "beta"),
        ("static_ptr", "redundancy_ptr", "group_ptr"),
        ("row_scores_ptr", "cover_rows_ptr", "cover_count_ptr", "cover_capacity", "cover_agg_ptr", "cover_pairs_ptr"),
        ("agg_acc_ptr", "warm_acc_ptr", "base_acc_ptr", "counts_acc_ptr"),
        ("digits_ptr", "s_rank_ptr"),
        "ticket_ptr",
        _OUTPUTS,
        _ROUTING,
    ),
    "lynx_pick_kernel": (
        _CALL,
        ("top_k", "alpha", "beta", "cap", "min_tokens", "max_tokens"),
        ("s_rank_ptr", "agg_acc_ptr", "picked_ptr", "ticket_ptr"),
        _OUTPUTS,
    ),
    "route_kernel": (
        _CALL,
        _ROUTING,
        ("keep_ptr", "visits_ptr", "ticket_ptr", "metrics_ptr", "metrics_gate_ptr", "mass_ptr"),
        ("static_ptr", "static_count", "min_tokens", "max_tokens"),
    ),
}


def named_arguments(kernel: str, args: tuple) -> dict:
    """A launch's positional arguments by name (:data:`ARGUMENT_NAMES`), its tuples flattened."""
    named = {}
    for names, value in zip(ARGUMENT_NAMES[kernel], args, strict=True):
        if isinstance(names, tuple):
            named.update(zip(names, value, strict=True))
        else:
            named[names] = value
    return named


def kernel_arguments(call: RoutingCall, cfg: PrunerConfig, plan: CallPlan, ws: SelectionWorkspace, out: Outputs):
    """``{kernel name: positional arguments}`` of the plan's launches, grouped as
    :data:`ARGUMENT_NAMES` says: the call's tensors and scalars, the workspace's buffers, and
    placeholders where a constexpr says a kernel never reads one."""
    logits, router, rule, split = call.logits, call.router, plan.rule, plan.split
    num_tokens, num_experts = logits.shape
    num_valid = call.num_valid_tokens
    on_device = isinstance(num_valid, torch.Tensor)
    nv_ptr = num_valid if on_device else ws.tickets
    nv_arg = num_tokens if (num_valid is None or on_device) else int(num_valid)
    weights_in = call.token_weights.contiguous() if call.token_weights is not None else ws.prim
    rows = (logits, logits.stride(0), logits.stride(1), num_tokens, num_experts, nv_ptr, nv_arg, weights_in)
    route = out.ids is not None
    ids, weights = (out.ids, out.weights) if route else (ws.placeholder_i32, ws.prim)
    num_groups = router.num_expert_group
    scale = float32_value(router.routed_scaling_factor) if router.routed_scaling_factor is not None else 1.0
    routing = (
        call.correction_bias if call.correction_bias is not None else ws.prim,
        ids,
        ids.stride(0) if route else 0,
        weights,
        weights.stride(0) if route else 0,
        router.top_k,
        router.topk_group,
        num_experts // num_groups,
        num_groups,
        scale,
    )
    metrics = out.metrics_row if out.metrics_row is not None else ws.mass
    gate = out.metrics_gate if out.metrics_gate is not None else ws.placeholder_i32
    stats = out.stats_out if out.stats_out is not None else ws.mass
    outputs = (out.keep, metrics, gate, stats)
    static = static_positions(cfg, call.layer_id, call.device) if rule.static else ws.placeholder_i32
    redundancy = layer_redundancy(cfg, call.layer_id, call.device) if rule.coactivation else ws.placeholder_i32
    cap = cfg.max_experts if rule.has_cap else 0
    min_tokens = cfg.min_tokens if cfg.min_tokens is not None else 0
    max_tokens = cfg.max_tokens if cfg.max_tokens is not None else MAX_TOKENS
    alpha = float32_value(cfg.alpha)
    pairs = ws.cover_pairs.view(-1).view(torch.int32)
    policy = (rule.k0, router.top_k, rule.request_budget, rule.count, tau_fixed_point(cfg.tau), cfg.rank_budget)
    return {
        "fill_kernel": (pairs, pairs.numel()),
        "select_kernel": (
            rows,
            (split.rows_per_program, split.rows_per_request),
            (*policy, cap, min_tokens, max_tokens, alpha, cfg.beta),
            (static, redundancy, call.expert_to_rank if call.expert_to_rank is not None else ws.flag),
            (ws.row_scores, ws.cover_rows, ws.cover_counts, MAX_COVERAGE_TOKENS, ws.cover_aggregate, ws.cover_pairs),
            (ws.aggregate, ws.warm_marks, ws.base_marks, ws.lynx_counts),
            (ws.lynx_digits, ws.lynx_rank),
            ws.tickets,
            outputs,
            routing,
        ),
        "lynx_pick_kernel": (
            rows,
            (router.top_k, alpha, cfg.beta, cap, min_tokens, max_tokens),
            (ws.lynx_rank, ws.aggregate, ws.picked, ws.tickets[2:]),
            outputs,
        ),
        # (the routing's kept and total mass in the aggregate's first two words: no selection of a
        # rule that leaves the mass to the routing touches the aggregate)
        "route_kernel": (
            rows,
            routing,
            (out.keep, ws.visits, ws.tickets[1:], metrics, gate, ws.aggregate),
            (static if plan.static_alone else ws.placeholder_i32, rule.count, min_tokens, max_tokens),
        ),
    }


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _launch(
    call: RoutingCall,
    cfg: PrunerConfig,
    out: Outputs,
    *,
    route: bool,
    fill_dropped: bool = False,
    pdl: bool = False,
    workspace: SelectionWorkspace | None,
    limits: PlanLimits = PRODUCTION_LIMITS,
) -> None:
    """Launch the call's kernels on ``workspace`` (the shared one of the device, E and stream when
    None).  The kernels leave the workspace's counters at 0 when they complete; a call that fails
    part-way (a compile or launch error after an earlier kernel of the call was queued) resets them,
    so that the next call finds them at 0 as well.  Not while a CUDA graph is being captured, where
    nothing ran."""
    num_experts = call.logits.shape[1]
    ws = workspace if workspace is not None else default_workspace(num_experts, call.logits.device)
    if ws.num_experts != num_experts or ws.device != canonical_device(call.logits.device):
        raise ValueError(
            f"workspace is for E={ws.num_experts} on {ws.device}, the call has E={num_experts} on {call.logits.device}"
        )
    spec = call_spec(call, route=route, fill_dropped=fill_dropped, outputs=out, pdl=pdl, limits=limits)
    plan = plan_call(cfg, spec)
    try:
        jit = kernel_module()
        arguments = kernel_arguments(call, cfg, plan, ws, out)
        if plan.zero_pairs:
            ws.cover_pairs.zero_()
        for launch in plan.launches:
            kernel = getattr(jit, launch.kernel)
            kernel[launch.grid](*arguments[launch.kernel], **launch.constexprs, **launch.options)
    except BaseException:
        if not _capturing(ws.device):
            ws.reset()
        raise


def prune_route(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    fill_dropped: bool = False,
    keep_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    weights_out: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    metrics_gate: torch.Tensor | None = None,
    workspace: SelectionWorkspace | None = None,
    enable_pdl: bool = False,
    limits: PlanLimits = PRODUCTION_LIMITS,
) -> PrunedRouting:
    """Keep mask and routing of one MoE layer call, on the device, in one to three launches.

    See :func:`xshare_sglang.policies.prune_route.prune_route` for the parameters; ``workspace`` is
    the scratch memory (default: one shared per (device, E), created on first use).

    ``enable_pdl`` launches every kernel of the call as a programmatic dependent of the kernel
    before it in the stream (Hopper and newer; a ``ValueError`` on an older GPU): each program waits
    for that kernel to finish (``griddepcontrol.wait``) before it reads or writes memory, and a
    selection kernel that another kernel of the call follows lets it launch at once, so the
    follower's launch overlaps the selection.  Inside a CUDA graph the launches become programmatic
    edges.  The results are the same.  Off by default here; the serving plugin turns it on where
    :func:`dependent_launch_supported`.  No effect under Triton's interpreter (which runs no PTX).

    Parameters
    ----------
    limits : PlanLimits, optional
        The plan's limits that depend on T (:class:`~.plan.limits.PlanLimits`; default
        :data:`~.plan.limits.PRODUCTION_LIMITS`, what every served call uses).  Lower ones make a call
        of a few dozen rows launch what a served call launches only at thousands (several programs of
        several tiles each): for tests under Triton's interpreter.  The results are the same.

    Returns
    -------
    PrunedRouting
        ``topk_ids`` [T, top_k] int32, ``topk_weights`` [T, top_k] float32, ``keep`` [E] bool.
    """
    check_outputs(call, keep_out, ids_out, weights_out, metrics_row, metrics_gate)
    if enable_pdl:
        check_pdl(call.device)
    reason = unsupported_reason(call, cfg)
    if reason is not None:
        _report(reason)
        return route_checked(
            call,
            cfg,
            fill_dropped=fill_dropped,
            keep_out=keep_out,
            ids_out=ids_out,
            weights_out=weights_out,
            metrics_row=metrics_row,
            metrics_gate=metrics_gate,
        )
    call.check_config(cfg)
    num_tokens, num_experts = call.logits.shape
    device = call.device
    out = Outputs(
        keep=keep_out if keep_out is not None else torch.empty(num_experts, dtype=torch.bool, device=device),
        ids=ids_out if ids_out is not None else torch.empty(num_tokens, call.top_k, dtype=torch.int32, device=device),
        weights=weights_out
        if weights_out is not None
        else torch.empty(num_tokens, call.top_k, dtype=torch.float32, device=device),
        metrics_row=metrics_row,
        metrics_gate=metrics_gate,
    )
    # not under the interpreter, which runs no PTX (read from the environment itself: the
    # compile-only capture of bench.kernel_manifest stands in for _interpreting())
    pdl = enable_pdl and os.environ.get("TRITON_INTERPRET") != "1"
    _launch(call, cfg, out, route=True, fill_dropped=fill_dropped, pdl=pdl, workspace=workspace, limits=limits)
    return PrunedRouting(out.ids, out.weights, out.keep)


def check_pdl(device: torch.device) -> None:
    """Raise ``ValueError`` unless ``device`` can launch programmatic dependents (CUDA, sm_90+)."""
    if device.type != "cuda":
        return  # the interpreter (or the compile-only capture) on CPU tensors: no launch to overlap
    major, minor = _capability(canonical_device(device))
    if major < 9:
        raise ValueError(
            f"enable_pdl needs a GPU of compute capability 9.0 or newer (programmatic dependent launch); "
            f"{device} is {major}.{minor}"
        )


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether ``prune_route(..., enable_pdl=True)`` launches programmatic dependents on ``device``:
    a CUDA GPU of compute capability 9.0 or newer, with the kernels compiled (not under Triton's
    interpreter)."""
    if device.type != "cuda" or _interpreting():
        return False
    return _capability(canonical_device(device))[0] >= 9


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def select_keep_mask(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    out: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    metrics_gate: torch.Tensor | None = None,
    workspace: SelectionWorkspace | None = None,
    limits: PlanLimits = PRODUCTION_LIMITS,
) -> torch.Tensor:
    """Keep mask of one MoE layer call, computed on the device in one launch.

    Parameters
    ----------
    call : RoutingCall
        Its router's ``top_k`` and scoring are read; the rest of the router is not.
    cfg : PrunerConfig
    out : Tensor, shape [E], bool, optional
        Written in place and returned; pass one inside CUDA graphs.
    stats_out : Tensor, shape [2], int64, optional
        Receives the aggregate score of the kept experts and of all experts (fixed point, the
        policy's score over the real tokens): their ratio is the share of score mass kept.
    metrics_row : Tensor, shape [4], int64, optional
        Receives ``+=`` the call's kept experts, retained score mass and call count (columns 1-3 of
        :data:`~xshare_sglang.policies.rewrite.METRIC_COLUMNS`, as
        :func:`~xshare_sglang.policies.rewrite.selection_metrics` computes them), added by the
        kernel that finishes the mask.  Column 0, the activated experts, is left to whoever routes
        the call.
    metrics_gate : Tensor, shape [1], int32, optional
        With ``metrics_row``: add them only while this device value is nonzero (see
        :func:`prune_route`).
    workspace : SelectionWorkspace, optional
    limits : PlanLimits, optional
        The plan's limits that depend on T, as :func:`prune_route`'s.

    Returns
    -------
    Tensor, shape [E], bool
    """
    num_experts = call.num_experts
    if out is not None and (out.shape != (num_experts,) or out.dtype != torch.bool or out.device != call.device):
        raise ValueError(f"out must be a bool tensor of shape ({num_experts},) on {call.device}")
    if stats_out is not None and (stats_out.shape != (2,) or stats_out.dtype != torch.int64):
        raise ValueError("stats_out must be an int64 tensor of shape (2,)")
    check_outputs(call, None, None, None, metrics_row, metrics_gate)
    if cfg.policy == "none" and stats_out is None and metrics_row is None:
        return torch.ones(num_experts, dtype=torch.bool, device=call.device) if out is None else out.fill_(True)
    reason = unsupported_reason(call, cfg)
    if reason is not None:
        _report(reason)
        keep, aggregate = select(call, cfg)
        kept_total, total = torch.where(keep, aggregate, 0).sum(), aggregate.sum()
        if stats_out is not None:
            stats_out[0] = kept_total
            stats_out[1] = total
        if metrics_row is not None:
            add_metrics(metrics_row, selection_metrics(keep, kept_total, total), metrics_gate)
        return keep if out is None else out.copy_(keep)
    call.check_config(cfg)
    keep = out if out is not None else torch.empty(num_experts, dtype=torch.bool, device=call.device)
    outputs = Outputs(keep=keep, metrics_row=metrics_row, metrics_gate=metrics_gate, stats_out=stats_out)
    _launch(call, cfg, outputs, route=False, workspace=workspace, limits=limits)
    return keep
