"""The benchmarks' library (``xshare_sglang.bench``): the token alignment's torch reference on a worked
example and on random routings (every slot once, in its bucket, in order; every bucket padded to the
block; each block's expert), and its kernels against it, exactly, under TRITON_INTERPRET=1 on CPU (set
by conftest.py) or on a GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xshare_sglang.bench.moe_align import align_reference, align_tokens, aligned_length

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_local", "offset", "block_m"),
    [(1, 8, 128, 0, 16), (7, 4, 60, 0, 1), (33, 8, 32, 32, 16), (64, 2, 16, 5, 64)],
)
def test_alignment_equals_reference(num_tokens, top_k, num_local, offset, block_m) -> None:
    """Sorted slots, per-block expert ids and bounds: identical to the torch layout, including
    dropped slots (-1) and other ranks' experts, which go to the last bucket."""
    generator = torch.Generator().manual_seed(num_tokens)
    ids = torch.randint(-1, offset + num_local + 8, (num_tokens, top_k), generator=generator)
    sorted_ids, expert_ids, bounds = align_tokens(ids.to(DEVICE), block_m, num_local, offset)
    want_sorted, want_experts, want_bounds = align_reference(ids, block_m, num_local, offset)
    used = int(want_bounds[-1])
    assert torch.equal(bounds.cpu(), want_bounds)
    assert torch.equal(sorted_ids.cpu()[:used], want_sorted)
    assert torch.equal(expert_ids.cpu()[: used // block_m], want_experts)
    assert used <= aligned_length(ids.numel(), block_m, num_local)


def test_reference_worked_example() -> None:
    # 4 tokens x 2 slots, experts 0..3 on this rank, block 2; slot 5 is dropped (-1), slot 7 remote (9)
    ids = torch.tensor([[2, 0], [2, 3], [0, -1], [3, 9]])
    sorted_ids, expert_ids, bounds = align_reference(ids, block_m=2, num_local=4)
    # buckets: 0 <- slots 1, 4; 1 <- none; 2 <- 0, 2; 3 <- 3, 6; skipped <- 5, 7
    assert bounds.tolist() == [0, 2, 2, 4, 6, 8]
    assert sorted_ids.tolist() == [1, 4, 0, 2, 3, 6, 5, 7]
    assert expert_ids.tolist() == [0, 2, 3, -1]
    # block 4: each bucket padded to 4 with the sentinel T * top_k = 8; a shard of experts [2, 4)
    sorted_ids, expert_ids, bounds = align_reference(ids, block_m=4, num_local=2, expert_offset=2)
    assert bounds.tolist() == [0, 4, 8, 12]
    assert sorted_ids.tolist() == [0, 2, 8, 8, 3, 6, 8, 8, 1, 4, 5, 7]
    assert expert_ids.tolist() == [0, 1, -1]


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    top_k=st.integers(1, 8),
    num_local=st.integers(1, 20),
    expert_offset=st.integers(0, 6),
    block_m=st.sampled_from([1, 2, 3, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_places_every_slot_once_in_its_bucket(num_tokens, top_k, num_local, expert_offset, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, num_local + 2 * expert_offset + 1, (num_tokens, top_k), generator=gen)
    sorted_ids, expert_ids, bounds = align_reference(ids, block_m, num_local, expert_offset)
    numel = ids.numel()
    assert int(bounds[-1]) <= aligned_length(numel, block_m, num_local)
    sizes = bounds[1:] - bounds[:-1]
    assert bool((sizes % block_m == 0).all())
    real = sorted_ids[sorted_ids < numel]
    assert sorted(real.tolist()) == list(range(numel))  # every slot exactly once; the rest is padding
    flat = ids.reshape(-1)
    for b in range(num_local + 1):
        run = sorted_ids[bounds[b] : bounds[b + 1]]
        slots = run[run < numel]
        assert slots.tolist() == sorted(slots.tolist())  # slots keep their order
        assert len(slots) > sizes[b] - block_m  # padding shorter than a block
        local = flat[slots.long()] - expert_offset
        if b < num_local:
            assert bool((local == b).all())
        else:
            assert bool(((flat[slots.long()] < 0) | (local < 0) | (local >= num_local)).all())
        owner = expert_ids[bounds[b] // block_m : bounds[b + 1] // block_m]
        assert bool((owner == (b if b < num_local else -1)).all())
