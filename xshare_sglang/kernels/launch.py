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
from .bundles import (
    KERNEL_BUNDLES,
    CallArgs,
    CoverageArgs,
    LynxArgs,
    LynxPickArgs,
    LynxPolicyArgs,
    OutputArgs,
    PolicyArgs,
    RouteStateArgs,
    RoutingArgs,
    ShareArgs,
    SplitArgs,
    StaticArgs,
    TableArgs,
)
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


def unsupported_reason(call: RoutingCall, cfg: PrunerConfig, *, check_device: bool = True) -> str | None:
    """Why the kernels cannot serve this call, or None when they can (``check_device=False``: its
    shapes, dtype and policy alone, wherever its tensors are)."""
    logits = call.logits
    if check_device and not (logits.is_cuda or (_interpreting() and logits.device.type == "cpu")):
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
    routing_sums_mass: bool = True,
) -> CallSpec:
    """What :func:`~.plan.plan_call` needs to know of a call and its outputs (and the plan's limits
    and open switch, :class:`~.plan.CallSpec`)."""
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
        routing_sums_mass=routing_sums_mass,
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


def named_arguments(kernel: str, args: tuple) -> dict:
    """A launch's positional arguments by name: each bundle's fields (:data:`~.bundles.KERNEL_BUNDLES`)
    and the plain arguments; a field name two bundles share keeps the later bundle's value."""
    named = {}
    for (name, bundle), value in zip(KERNEL_BUNDLES[kernel], args, strict=True):
        if bundle is None:
            named[name] = value
        else:
            named.update(value._asdict())
    return named


def kernel_arguments(call: RoutingCall, cfg: PrunerConfig, plan: CallPlan, ws: SelectionWorkspace, out: Outputs):
    """``{kernel name: positional arguments}`` of the plan's launches (only those), in the bundles of
    :data:`~.bundles.KERNEL_BUNDLES`: the call's tensors and scalars, the workspace's buffers, and
    placeholders where a constexpr says a kernel never reads one."""
    logits, router, rule, split = call.logits, call.router, plan.rule, plan.split
    num_tokens, num_experts = logits.shape
    num_valid = call.num_valid_tokens
    on_device = isinstance(num_valid, torch.Tensor)
    rows = CallArgs(
        logits_ptr=logits,
        stride_t=logits.stride(0),
        stride_e=logits.stride(1),
        num_tokens=num_tokens,
        num_experts=num_experts,
        n_valid_ptr=num_valid if on_device else ws.tickets,
        n_valid_arg=num_tokens if (num_valid is None or on_device) else int(num_valid),
        weights_ptr=call.token_weights.contiguous() if call.token_weights is not None else ws.prim,
    )
    route = out.ids is not None
    ids, weights = (out.ids, out.weights) if route else (ws.placeholder_i32, ws.prim)
    num_groups = router.num_expert_group
    routing = RoutingArgs(
        bias_ptr=call.correction_bias if call.correction_bias is not None else ws.prim,
        ids_ptr=ids,
        ids_stride=ids.stride(0) if route else 0,
        out_w_ptr=weights,
        out_w_stride=weights.stride(0) if route else 0,
        top_k=router.top_k,
        topk_group=router.topk_group,
        group_size=num_experts // num_groups,
        num_groups=num_groups,
        scale=float32_value(router.routed_scaling_factor) if router.routed_scaling_factor is not None else 1.0,
    )
    metrics = out.metrics_row if out.metrics_row is not None else ws.mass
    gate = out.metrics_gate if out.metrics_gate is not None else ws.placeholder_i32
    stats = out.stats_out if out.stats_out is not None else ws.mass
    outputs = OutputArgs(keep_ptr=out.keep, metrics_ptr=metrics, metrics_gate_ptr=gate, stats_ptr=stats)
    cap = cfg.max_experts if rule.has_cap else 0
    min_tokens = cfg.min_tokens if cfg.min_tokens is not None else 0
    max_tokens = cfg.max_tokens if cfg.max_tokens is not None else MAX_TOKENS
    alpha = float32_value(cfg.alpha)
    arguments = {}
    for kernel in plan.kernels:
        if kernel == "fill_kernel":
            pairs = ws.cover_pairs.view(-1).view(torch.int32)
            arguments[kernel] = (pairs, pairs.numel())
        elif kernel == "select_kernel":
            static = static_positions(cfg, call.layer_id, call.device) if rule.static else ws.placeholder_i32
            redundancy = layer_redundancy(cfg, call.layer_id, call.device) if rule.coactivation else ws.placeholder_i32
            arguments[kernel] = (
                rows,
                SplitArgs(split.rows_per_program, split.rows_per_request),
                PolicyArgs(
                    k0=rule.k0,
                    top_k=router.top_k,
                    request_budget=rule.request_budget,
                    count=rule.count,
                    tau_q=tau_fixed_point(cfg.tau),
                    rank_budget=cfg.rank_budget,
                    cap=cap,
                    min_tokens=min_tokens,
                    max_tokens=max_tokens,
                    alpha=alpha,
                    beta=cfg.beta,
                ),
                TableArgs(
                    static_ptr=static,
                    redundancy_ptr=redundancy,
                    group_ptr=call.expert_to_rank if call.expert_to_rank is not None else ws.flag,
                ),
                CoverageArgs(
                    row_scores_ptr=ws.row_scores,
                    cover_rows_ptr=ws.cover_rows,
                    cover_count_ptr=ws.cover_counts,
                    cover_capacity=MAX_COVERAGE_TOKENS,
                    cover_agg_ptr=ws.cover_aggregate,
                    cover_pairs_ptr=ws.cover_pairs,
                ),
                ShareArgs(ws.aggregate, ws.warm_marks, ws.base_marks, ws.lynx_counts),
                LynxArgs(digits_ptr=ws.lynx_digits, s_rank_ptr=ws.lynx_rank),
                ws.tickets,
                outputs,
                routing,
            )
        elif kernel == "lynx_pick_kernel":
            arguments[kernel] = (
                rows,
                LynxPolicyArgs(router.top_k, alpha, cfg.beta, cap, min_tokens, max_tokens),
                LynxPickArgs(ws.lynx_rank, ws.aggregate, ws.picked, ws.tickets[2:]),
                outputs,
            )
        else:
            # (the routing's kept and total mass in the aggregate's first two words: no selection of a
            # rule that leaves the mass to the routing touches the aggregate)
            static = static_positions(cfg, call.layer_id, call.device) if plan.static_alone else ws.placeholder_i32
            arguments[kernel] = (
                rows,
                routing,
                RouteStateArgs(out.keep, ws.visits, ws.tickets[1:], metrics, gate, ws.aggregate),
                StaticArgs(static, rule.count, min_tokens, max_tokens),
            )
    return arguments


@dataclass(frozen=True)
class PlannedLaunch:
    """One launch as the wrapper makes it: the jit function's name, grid, positional arguments and
    keywords (constexprs, the set rule's jit function in ``RULE``, and launch options)."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict

    @property
    def fn(self):
        """The jit function (imports triton)."""
        return getattr(kernel_module(), self.kernel)


def _launches(call: RoutingCall, cfg: PrunerConfig, plan: CallPlan, ws: SelectionWorkspace, out: Outputs):
    jit = kernel_module()
    arguments = kernel_arguments(call, cfg, plan, ws, out)
    launches = []
    for launch in plan.launches:
        constexprs = dict(launch.constexprs)
        if "RULE" in constexprs:
            constexprs["RULE"] = jit.RULES[constexprs["RULE"]]
        launches.append(
            PlannedLaunch(launch.kernel, launch.grid, arguments[launch.kernel], constexprs | launch.options)
        )
    return launches


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
    routing_sums_mass: bool = True,
    run: bool = True,
) -> list[PlannedLaunch]:
    """Launch the call's kernels on ``workspace`` (the shared one of the device, E and stream when
    None).  The kernels leave the workspace's counters at 0 when they complete; a call that fails
    part-way (a compile or launch error after an earlier kernel of the call was queued) resets them,
    so that the next call finds them at 0 as well.  Not while a CUDA graph is being captured, where
    nothing ran.  Returns the launches; with ``run=False`` only plans them (:func:`planned_launches`)."""
    num_experts = call.logits.shape[1]
    ws = workspace if workspace is not None else default_workspace(num_experts, call.logits.device)
    if ws.num_experts != num_experts or ws.device != canonical_device(call.logits.device):
        raise ValueError(
            f"workspace is for E={ws.num_experts} on {ws.device}, the call has E={num_experts} on {call.logits.device}"
        )
    spec = call_spec(
        call,
        route=route,
        fill_dropped=fill_dropped,
        outputs=out,
        pdl=pdl,
        limits=limits,
        routing_sums_mass=routing_sums_mass,
    )
    plan = plan_call(cfg, spec)
    launches = _launches(call, cfg, plan, ws, out)
    if not run:
        return launches
    try:
        if plan.zero_pairs:
            ws.cover_pairs.zero_()
        for launch in launches:
            launch.fn[launch.grid](*launch.args, **launch.kwargs)
    except BaseException:
        if not _capturing(ws.device):
            ws.reset()
        raise
    return launches


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
    routing_sums_mass: bool = True,
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
    routing_sums_mass : bool, optional
        The open A/B switch of :attr:`~.plan.CallSpec.routing_sums_mass` (default on, what every served
        call uses).  The results are the same.

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
    out = _route_outputs(call, keep_out, ids_out, weights_out, metrics_row, metrics_gate)
    _launch(
        call,
        cfg,
        out,
        route=True,
        fill_dropped=fill_dropped,
        pdl=enable_pdl and not _interpreting(),  # the interpreter runs no PTX
        workspace=workspace,
        limits=limits,
        routing_sums_mass=routing_sums_mass,
    )
    return PrunedRouting(out.ids, out.weights, out.keep)


def _route_outputs(call, keep_out, ids_out, weights_out, metrics_row, metrics_gate) -> Outputs:
    """:func:`prune_route`'s outputs: the given buffers, new ones where None."""
    num_tokens, num_experts = call.logits.shape
    device = call.device
    return Outputs(
        keep=keep_out if keep_out is not None else torch.empty(num_experts, dtype=torch.bool, device=device),
        ids=ids_out if ids_out is not None else torch.empty(num_tokens, call.top_k, dtype=torch.int32, device=device),
        weights=weights_out
        if weights_out is not None
        else torch.empty(num_tokens, call.top_k, dtype=torch.float32, device=device),
        metrics_row=metrics_row,
        metrics_gate=metrics_gate,
    )


def planned_launches(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    entry: str = "prune_route",
    fill_dropped: bool = False,
    metrics_row: torch.Tensor | None = None,
    metrics_gate: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    workspace: SelectionWorkspace | None = None,
    enable_pdl: bool = False,
    limits: PlanLimits = PRODUCTION_LIMITS,
    routing_sums_mass: bool = True,
) -> list[PlannedLaunch]:
    """The launches one :func:`prune_route` (``entry="prune_route"``) or :func:`select_keep_mask`
    (``entry="select"``) call of these arguments makes, with every argument built, none run: for tools
    that compile or inspect them (the golden manifest, the PTX and SASS checks), on any device,
    CPU tensors included.  Dependent launch is planned as asked (``enable_pdl``), whatever runs here.

    Raises ``ValueError`` for a call the kernels do not serve (:func:`unsupported_reason` but for its
    device), which the entry points would send to the torch reference.
    """
    if entry not in ("prune_route", "select"):
        raise ValueError(f"entry={entry!r}: must be 'prune_route' or 'select'")
    reason = unsupported_reason(call, cfg, check_device=False)
    if reason is not None:
        raise ValueError(f"the kernels do not serve this call: {reason}")
    check_outputs(call, None, None, None, metrics_row, metrics_gate)
    call.check_config(cfg)
    common = dict(workspace=workspace, limits=limits, routing_sums_mass=routing_sums_mass, run=False)
    if entry == "prune_route":
        out = _route_outputs(call, None, None, None, metrics_row, metrics_gate)
        return _launch(call, cfg, out, route=True, fill_dropped=fill_dropped, pdl=enable_pdl, **common)
    if cfg.policy == "none" and stats_out is None and metrics_row is None:
        return []  # select_keep_mask fills the mask without a launch
    keep = torch.empty(call.num_experts, dtype=torch.bool, device=call.device)
    out = Outputs(keep=keep, metrics_row=metrics_row, metrics_gate=metrics_gate, stats_out=stats_out)
    return _launch(call, cfg, out, route=False, **common)


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
    routing_sums_mass: bool = True,
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
    routing_sums_mass : bool, optional
        The open A/B switch, as :func:`prune_route`'s.

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
    _launch(call, cfg, outputs, route=False, workspace=workspace, limits=limits, routing_sums_mass=routing_sums_mass)
    return keep
