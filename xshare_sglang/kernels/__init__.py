"""Triton kernels of the pruner and their graph-safe launch wrappers.

* :func:`prune_route` - keep mask and pruned routing of one MoE layer call (ids and weights in
  SGLang's ``TopKOutput`` layout), in place of SGLang's top-k, in one launch for small batches and
  two otherwise; the reference is :func:`xshare_sglang.policies.prune_route.prune_route`;
* :func:`select_keep_mask` - the keep mask alone, in one launch (same meaning as
  :func:`xshare_sglang.select_experts_mask`);
* :func:`dependent_launch_supported` - whether ``prune_route(..., enable_pdl=True)`` can launch on a
  device (Hopper and newer);
* :class:`SelectionWorkspace` - preallocated scratch, to create before CUDA-graph capture, one per
  (device, E, stream) (:func:`workspace_key`).

The jit code lives in ``_prune_route.py`` and is imported (with triton) on the first launch, so
importing this package stays light.
"""

from .prune_route import (
    SelectionWorkspace,
    dependent_launch_supported,
    per_request_policy,
    plan_for,
    plan_launch,
    prune_route,
    select_keep_mask,
    unsupported_reason,
    workspace_key,
)

__all__ = [
    "SelectionWorkspace",
    "dependent_launch_supported",
    "per_request_policy",
    "plan_for",
    "plan_launch",
    "prune_route",
    "select_keep_mask",
    "unsupported_reason",
    "workspace_key",
]
