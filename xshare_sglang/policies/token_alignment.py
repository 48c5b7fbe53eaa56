"""Routed slots sorted by expert, the layout a fused-MoE kernel reads (SGLang's ``moe_align_block_size``).

The pure-torch reference (and CPU path) of the alignment that :func:`xshare_sglang.kernels.prune_route`
can write in the same launches that route the tokens (issue 33, item 3), so a pruned layer needs no
separate alignment kernel.

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

from dataclasses import dataclass

import torch

__all__ = ["TokenAlignment", "align_reference", "aligned_length", "write_alignment"]


def aligned_length(numel: int, block_m: int, num_local: int) -> int:
    """Places the sorted slots can need: each non-empty bucket adds at most ``block_m - 1`` padding places."""
    return numel + min(numel, num_local + 1) * (block_m - 1)


@dataclass(frozen=True)
class TokenAlignment:
    """Where a routing call writes its slots sorted by expert, and how.

    Attributes
    ----------
    block_m : int
        Rows of one block of the fused-MoE kernel (its ``BLOCK_SIZE_M``).
    num_local : int
        Experts this rank computes: global ids ``[expert_offset, expert_offset + num_local)``.
    expert_offset : int
    sorted_ids : Tensor, shape [aligned_length(T * top_k, block_m, num_local)], int32
        Slot indices by bucket; padding places hold ``T * top_k``; the tail past ``bounds[-1]`` is unused.
    expert_ids : Tensor, shape [ceil(len(sorted_ids) / block_m)], int32
        Expert of each block (``-1``: skip); blocks past ``bounds[-1] / block_m`` are unused.
    bounds : Tensor, shape [num_local + 2], int32
        ``bounds[b + 1]`` is the padded end of bucket ``b``; ``bounds[-1]`` the places in use.
    scratch : Tensor, int32, optional
        The kernels' scratch memory (:func:`xshare_sglang.kernels.token_alignment` sizes it); the
        torch path needs none.
    """

    block_m: int
    num_local: int
    expert_offset: int
    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    bounds: torch.Tensor
    scratch: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        num_tokens: int,
        top_k: int,
        block_m: int,
        num_local: int,
        expert_offset: int = 0,
        device: torch.device | str = "cpu",
    ) -> TokenAlignment:
        """Output buffers for calls of ``num_tokens`` x ``top_k`` slots (allocate before graph capture)."""
        if block_m < 1:
            raise ValueError(f"block_m must be at least 1, got {block_m}")
        if num_local < 1 or expert_offset < 0:
            raise ValueError(f"num_local must be >= 1 and expert_offset >= 0, got {num_local} and {expert_offset}")
        length = aligned_length(num_tokens * top_k, block_m, num_local)
        kw = dict(dtype=torch.int32, device=device)
        return cls(
            block_m,
            num_local,
            expert_offset,
            torch.empty(length, **kw),
            torch.empty(-(-length // block_m), **kw),
            torch.empty(num_local + 2, **kw),
        )

    def check(self, num_slots: int, device: torch.device) -> None:
        """Raise ``ValueError`` unless the buffers fit ``num_slots`` (T x top_k) slots routed on ``device``."""
        length = aligned_length(num_slots, self.block_m, self.num_local)
        wanted = {
            "sorted_ids": (self.sorted_ids, length),
            "expert_ids": (self.expert_ids, -(-length // self.block_m)),
            "bounds": (self.bounds, self.num_local + 2),
        }
        for name, (tensor, size) in wanted.items():
            if tensor.dtype != torch.int32 or tensor.dim() != 1 or tensor.numel() < size or not tensor.is_contiguous():
                raise ValueError(f"alignment.{name} must be a contiguous int32 vector of at least {size} entries")
            if tensor.device != device:
                raise ValueError(f"alignment.{name} is on {tensor.device}, the routing on {device}")

    def used(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sorted_ids, expert_ids, bounds) cut to the places in use (reads ``bounds`` on the host)."""
        end = int(self.bounds[-1])
        return self.sorted_ids[:end], self.expert_ids[: end // self.block_m], self.bounds


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


def write_alignment(ids: torch.Tensor, alignment: TokenAlignment) -> None:
    """Write the reference layout of ``ids`` into ``alignment``'s buffers (the CPU path)."""
    alignment.check(ids.numel(), ids.device)
    a = alignment
    sorted_ids, expert_ids, bounds = align_reference(ids, a.block_m, a.num_local, a.expert_offset)
    device = alignment.sorted_ids.device
    alignment.sorted_ids[: sorted_ids.numel()].copy_(sorted_ids.to(device))
    alignment.expert_ids[: expert_ids.numel()].copy_(expert_ids.to(device))
    alignment.bounds[: bounds.numel()].copy_(bounds.to(device))
