"""``apply_keep_mask``: write masked router logits (and correction bias) with a Triton kernel.

Same contract as the reference :func:`xshare_sglang.policies.apply.mask_router_inputs`: pruned
experts get ``MASKED_LOGIT``; ``out`` / ``bias_out`` may be the inputs themselves (in place) or
preallocated buffers, so the call allocates nothing inside a CUDA graph.
"""

from __future__ import annotations

import torch

from ..policies.apply import MASKED_LOGIT, mask_router_inputs
from .selection import SUPPORTED_DTYPES, _interpreting, _next_pow2

BLOCK_T = 16


def apply_keep_mask(
    logits: torch.Tensor,
    keep: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    bias_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked router logits [T, E] and masked bias [E] (or None); see ``mask_router_inputs``."""
    num_tokens, num_experts = logits.shape
    if keep.shape != (num_experts,) or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool tensor of shape ({num_experts},)")
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"bias must have shape ({num_experts},), got {tuple(bias.shape)}")
    usable = (logits.is_cuda or (_interpreting() and logits.device.type == "cpu")) and logits.dtype in SUPPORTED_DTYPES
    if not usable or num_experts > 4096:
        return mask_router_inputs(logits, keep, bias=bias, out=out, bias_out=bias_out)

    from ._apply import apply_mask_kernel  # imports triton

    if out is None:
        out = torch.empty_like(logits)
    if bias is not None and bias_out is None:
        bias_out = torch.empty_like(bias)
    apply_mask_kernel[(max(1, -(-num_tokens // BLOCK_T)),)](
        logits,
        logits.stride(0),
        logits.stride(1),
        out,
        out.stride(0),
        out.stride(1),
        keep,
        bias if bias is not None else keep,
        bias_out if bias is not None else keep,
        num_tokens,
        num_experts,
        MASKED_LOGIT,
        HAS_BIAS=bias is not None,
        BLOCK_T=BLOCK_T,
        BLOCK_E=max(16, _next_pow2(num_experts)),
    )
    return out, bias_out
