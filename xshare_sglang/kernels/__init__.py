"""Triton selection kernels and their graph-safe launch wrappers.

* :func:`select_keep_mask` - the keep mask of any policy (same meaning as
  :func:`xshare_sglang.select_experts_mask`, the torch reference it is tested against);
* :func:`apply_keep_mask` - router logits and correction bias with pruned experts masked;
* :func:`rewrite_routing` - after SGLang routed inside the mask: leftover picks of pruned experts
  and padding rows to ``-1``, plus the per-layer metrics, in one launch;
* :class:`SelectionWorkspace` - preallocated scratch, to create before CUDA-graph capture.

The jit code lives in the ``_*.py`` modules and is imported (with triton) on the first launch, so
importing this package stays light.
"""

from .apply import apply_keep_mask
from .rewrite import rewrite_routing
from .selection import SelectionWorkspace, plan_launch, select_keep_mask, unsupported_reason

__all__ = [
    "SelectionWorkspace",
    "apply_keep_mask",
    "plan_launch",
    "rewrite_routing",
    "select_keep_mask",
    "unsupported_reason",
]
