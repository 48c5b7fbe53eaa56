"""The benchmarks' library (``xshare_sglang.bench``): the token alignment kernels against their
torch reference, exactly, under TRITON_INTERPRET=1 on CPU (set by conftest.py) or on a GPU."""

from __future__ import annotations

import pytest
import torch

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
