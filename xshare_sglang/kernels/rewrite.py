"""``rewrite_routing``: the routing rewrite and per-layer metrics in one Triton launch.

Same signature and meaning as the reference :func:`xshare_sglang.policies.rewrite.rewrite_routing`;
graph-safe (no host syncs, no allocation, the real-token count read on the device).  CPU tensors
without ``TRITON_INTERPRET=1``, more than 4096 experts or more than 64 slots use the reference.
"""

from __future__ import annotations

import torch

from ..policies.rewrite import rewrite_routing as rewrite_routing_reference
from .selection import _interpreting, _next_pow2


def rewrite_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    keep: torch.Tensor,
    *,
    num_valid_tokens: int | torch.Tensor | None = None,
    physical_to_logical: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    fill_dropped: bool = False,
) -> None:
    """See :func:`xshare_sglang.policies.rewrite.rewrite_routing`."""
    num_tokens, num_slots = topk_ids.shape
    num_ids = keep.numel() if physical_to_logical is None else physical_to_logical.numel()
    usable = topk_ids.is_cuda or (_interpreting() and topk_ids.device.type == "cpu")
    if not usable or num_ids > 4096 or num_slots > 64 or topk_ids.stride(1) != 1 or topk_weights.stride(1) != 1:
        rewrite_routing_reference(
            topk_ids,
            topk_weights,
            keep,
            num_valid_tokens=num_valid_tokens,
            physical_to_logical=physical_to_logical,
            metrics_row=metrics_row,
            stats=stats,
            token_weights=token_weights,
            fill_dropped=fill_dropped,
        )
        return

    from ._rewrite import rewrite_routing_kernel  # imports triton

    nv_tensor = isinstance(num_valid_tokens, torch.Tensor)
    block_ids = max(16, _next_pow2(num_ids))
    block_k = max(2, _next_pow2(num_slots))
    rewrite_routing_kernel[(1,)](
        topk_ids,
        topk_weights,
        topk_ids.stride(0),
        topk_weights.stride(0),
        keep,
        physical_to_logical if physical_to_logical is not None else keep,
        num_valid_tokens if nv_tensor else topk_ids,
        num_tokens if (num_valid_tokens is None or nv_tensor) else int(num_valid_tokens),
        metrics_row if metrics_row is not None else topk_weights,
        stats if stats is not None else topk_ids,
        token_weights if token_weights is not None else topk_weights,
        num_tokens,
        num_slots,
        keep.numel(),
        num_ids,
        HAS_NV_PTR=nv_tensor,
        HAS_P2L=physical_to_logical is not None,
        HAS_METRICS=metrics_row is not None,
        HAS_STATS=stats is not None,
        HAS_WEIGHTS=token_weights is not None,
        FILL=fill_dropped,
        BLOCK_IDS=block_ids,
        BLOCK_K=block_k,
        CHUNK_T=max(1, min(16, 8192 // (block_k * block_ids))),
        num_warps=4,
    )
