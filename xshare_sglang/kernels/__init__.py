"""Triton kernels of the pruner and their graph-safe launch wrappers.

* :func:`prune_route` - keep mask and pruned routing of one MoE layer call (ids and weights in
  SGLang's ``TopKOutput`` layout), in place of SGLang's top-k; the reference is
  :func:`xshare_sglang.policies.prune_route.prune_route`;
* :func:`select_keep_mask` - the keep mask alone (same meaning as
  :func:`xshare_sglang.select_experts_mask`);
* :func:`plan_call` - what a call launches: every kernel with its grid, warps and constexprs
  (``python -m xshare_sglang.kernels.plan`` prints the table);
* :func:`dependent_launch_supported` - whether ``prune_route(..., enable_pdl=True)`` can launch on a
  device (Hopper and newer);
* :class:`SelectionWorkspace` - preallocated scratch, to create before CUDA-graph capture, one per
  (device, E, stream) (:func:`workspace_key`).

The jit code is imported (with triton) on the first launch, so importing this package stays light.
"""

from .launch import dependent_launch_supported, prune_route, select_keep_mask, unsupported_reason
from .plan import CallSpec, per_request_policy, plan_call, plan_for, plan_launch
from .workspace import SelectionWorkspace, default_workspace, workspace_key

__all__ = [
    "CallSpec",
    "SelectionWorkspace",
    "default_workspace",
    "dependent_launch_supported",
    "per_request_policy",
    "plan_call",
    "plan_for",
    "plan_launch",
    "prune_route",
    "select_keep_mask",
    "unsupported_reason",
    "workspace_key",
]
