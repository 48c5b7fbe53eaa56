"""Triton kernels that align routed token slots by expert, the layout SGLang's fused-MoE kernel reads
(its ``moe_align_block_size``): slots sorted by local expert, each expert's run padded to a multiple
of the kernel's block.  The MoE-layer benchmark uses them (:mod:`xshare_sglang.bench.moe_align` launches
them and holds their torch reference).
"""

import triton
import triton.language as tl


@triton.jit
def load_buckets(ids_ptr, offs, numel, expert_offset, num_local):
    """Bucket of each slot: its local expert, or ``num_local`` for -1, padding and other ranks' experts."""
    ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
    local = ids - expert_offset
    return tl.where((ids >= 0) & (local >= 0) & (local < num_local), local, num_local)


@triton.jit
def count_kernel(ids_ptr, counts_ptr, numel, expert_offset, num_local, BLOCK: tl.constexpr):
    """counts[b] = slots routed to local expert b; bucket ``num_local`` holds every other slot."""
    bucket = tl.program_id(0)
    total = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    for start in range(0, numel, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key = load_buckets(ids_ptr, offs, numel, expert_offset, num_local)
        total += tl.sum(((key == bucket) & (offs < numel)).to(tl.int32), axis=0)
    tl.store(counts_ptr + bucket, total)


@triton.jit
def place_kernel(
    ids_ptr,
    counts_ptr,
    sorted_ptr,
    expert_ids_ptr,
    bounds_ptr,
    numel,
    expert_offset,
    num_local,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    WRITE_EXPERT_IDS: tl.constexpr,
):
    """Slots sorted by bucket, each bucket padded to a BLOCK_M multiple (SGLang's moe_align layout)."""
    bucket = tl.program_id(0)
    buckets = tl.arange(0, BLOCK_B)
    counts = tl.load(counts_ptr + buckets, mask=buckets <= num_local, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(buckets < bucket, padded, 0), axis=0)
    size = tl.sum(tl.where(buckets == bucket, padded, 0), axis=0)
    count = tl.sum(tl.where(buckets == bucket, counts, 0), axis=0)
    tl.store(bounds_ptr + bucket + 1, start + size)
    if bucket == 0:
        tl.store(bounds_ptr, 0)
    placed = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
    for base in range(0, numel, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        key = load_buckets(ids_ptr, offs, numel, expert_offset, num_local)
        hit = (key == bucket) & (offs < numel)
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1 + placed
        tl.store(sorted_ptr + start + rank, offs.to(tl.int32), mask=hit)
        placed += tl.sum(hit.to(tl.int32), axis=0)
    if BLOCK_M > 1:
        pad = tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + start + count + pad, tl.zeros([BLOCK_M], tl.int32) + numel, mask=pad < size - count)
    if WRITE_EXPERT_IDS:
        expert = tl.where(bucket < num_local, bucket, -1)
        blocks = size // BLOCK_M
        for b0 in range(0, blocks, BLOCK):
            offs = b0 + tl.arange(0, BLOCK)
            tl.store(expert_ids_ptr + start // BLOCK_M + offs, tl.zeros([BLOCK], tl.int32) + expert, mask=offs < blocks)
