"""Token alignment for the MoE-layer benchmark: the slots of a routing sorted by expert, the layout a
fused-MoE kernel reads (SGLang's ``moe_align_block_size``), launched by :func:`align_tokens`
(:mod:`xshare_sglang.bench._moe_align`), with :func:`align_reference`, its torch reference (the two
must agree exactly).

Layout, for ``ids`` of shape [T, top_k] and a block of ``block_m`` rows:

* slot ``s = t * top_k + j`` goes to bucket ``ids[t, j] - expert_offset`` when that is one of this
  rank's ``num_local`` experts, and to the last bucket ``num_local`` otherwise (``-1``, padding rows,
  other ranks' experts);
* buckets follow each other in order, each padded to a multiple of ``block_m``; inside a bucket the
  slots keep their order (ascending ``s``); a padding place holds ``T * top_k``;
* each block of ``block_m`` places names its expert (``-1`` for the last bucket: the fused kernel
  skips such blocks and writes zeros).
"""

from __future__ import annotations

import torch
import triton

from . import _moe_align as jit

__all__ = ["align_reference", "align_tokens", "aligned_length", "local_ids"]


def aligned_length(numel: int, block_m: int, num_local: int) -> int:
    """Places the sorted slots can need: each non-empty bucket adds at most ``block_m - 1`` padding places."""
    return numel + min(numel, num_local + 1) * (block_m - 1)


def slot_buckets(ids: torch.Tensor, num_local: int, expert_offset: int) -> torch.Tensor:
    """Bucket of every slot of ``ids`` (flattened): its local expert, or ``num_local``."""
    local = ids.reshape(-1).long() - expert_offset
    valid = (ids.reshape(-1) >= 0) & (local >= 0) & (local < num_local)
    return torch.where(valid, local, num_local)


def align_reference(ids: torch.Tensor, block_m: int, num_local: int, expert_offset: int = 0):
    """The layout of the module docstring, in plain torch.

    Returns
    -------
    sorted_ids : Tensor, shape [bounds[-1]], int32
    expert_ids : Tensor, shape [bounds[-1] / block_m], int32
    bounds : Tensor, shape [num_local + 2], int32
    """
    bucket = slot_buckets(ids, num_local, expert_offset).cpu()
    numel = bucket.numel()
    counts = torch.bincount(bucket, minlength=num_local + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)])
    sorted_ids = torch.full((int(bounds[-1]),), numel, dtype=torch.int32)
    expert_ids = torch.full((int(bounds[-1]) // block_m,), -1, dtype=torch.int32)
    order = torch.argsort(bucket, stable=True)  # by bucket, ascending slots inside one
    place = bounds[bucket[order]] + torch.arange(numel) - torch.cumsum(counts, 0)[bucket[order]] + counts[bucket[order]]
    sorted_ids[place] = order.to(torch.int32)
    blocks = padded // block_m
    owner = torch.repeat_interleave(torch.arange(num_local + 1), blocks)
    expert_ids[:] = torch.where(owner < num_local, owner, -1).to(torch.int32)
    return sorted_ids, expert_ids, bounds.to(torch.int32)


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
