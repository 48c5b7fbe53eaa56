"""Token alignment for the fused-MoE benchmarks: the launch wrapper of
:mod:`xshare_sglang.kernels._moe_align`, whose torch reference is
:func:`xshare_sglang.policies.token_alignment.align_reference` (the two must agree exactly)."""

from __future__ import annotations

import torch
import triton

from ..kernels import _moe_align as jit
from ..policies.token_alignment import align_reference, aligned_length

__all__ = ["align_reference", "align_tokens", "aligned_length", "local_ids"]


def local_ids(ids: torch.Tensor, offset: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids of this rank's experts (``ids - offset``) and where they are valid."""
    local = ids.long() - offset
    return local, (ids >= 0) & (local >= 0) & (local < num_local)


def align_tokens(ids: torch.Tensor, block_m: int, num_local: int, offset: int, expert_ids: bool = True):
    """Sort the ``[T, k]`` slots by local expert, padding each expert's run to a ``block_m`` multiple.

    Two Triton launches, no host sync, fixed shapes (graph-safe).  Slots of ``-1`` or of another rank's
    experts go to a last bucket whose blocks get expert id ``-1`` (the fused kernel skips those and
    writes zeros), exactly SGLang's moe_align convention.

    Returns
    -------
    sorted_ids : int32 [aligned_length]
        Flat slot indices (``t * k + j``) by bucket; padding holds ``numel``; the tail past
        ``bounds[-1]`` is unused.
    expert_ids : int32 [ceil(len / block_m)] or None
        Expert of each block of ``block_m`` sorted slots (``-1``: skip).
    bounds : int32 [num_local + 2]
        ``bounds[b + 1]`` is the padded end of bucket b; ``bounds[-1]`` the total used length.
    """
    numel = ids.numel()
    length = aligned_length(numel, block_m, num_local)
    device = ids.device
    flat = ids.reshape(-1)
    counts = torch.empty(num_local + 1, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(length, dtype=torch.int32, device=device)
    blocks = torch.empty(-(-length // block_m), dtype=torch.int32, device=device) if expert_ids else counts
    bounds = torch.empty(num_local + 2, dtype=torch.int32, device=device)
    block = max(16, min(1024, triton.next_power_of_2(numel)))
    jit.count_kernel[(num_local + 1,)](flat, counts, numel, offset, num_local, BLOCK=block)
    jit.place_kernel[(num_local + 1,)](
        flat,
        counts,
        sorted_ids,
        blocks,
        bounds,
        numel,
        offset,
        num_local,
        BLOCK_M=block_m,
        BLOCK=block,
        BLOCK_B=triton.next_power_of_2(num_local + 1),
        WRITE_EXPERT_IDS=expert_ids,
    )
    return sorted_ids, (blocks if expert_ids else None), bounds
