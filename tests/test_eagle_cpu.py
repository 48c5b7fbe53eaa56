"""The CPU test servers' EAGLE verify attention (``xshare_sglang.testing.eagle_cpu``) against plain
attention, for the tree shapes adaptive speculation passes through."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from xshare_sglang.testing.eagle_cpu import tree_verify_attention

HEADS, DIM, SLOTS = 2, 8, 64


def _cache(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SLOTS, HEADS, DIM, generator=gen), torch.randn(SLOTS, HEADS, DIM, generator=gen)


@pytest.mark.parametrize("mask_numel", [3, 1781, 48])
def test_one_token_trees_attend_like_a_decode_step(mask_numel) -> None:
    """D = 1 (0 draft steps): each request's one token sees its prefix and itself, whatever the size of
    the all-True mask SGLang hands over (its request count, seq_lens_sum + bs, or a larger buffer)."""
    k_cache, v_cache = _cache(0)
    prefix_lens = torch.tensor([5, 9, 2])
    req_to_token = torch.randperm(SLOTS).reshape(4, 16)
    req_pool_indices = torch.tensor([2, 0, 3])
    query = torch.randn(3, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    out = tree_verify_attention(
        query,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        torch.ones(mask_numel, dtype=torch.bool),
        1,
        scaling=None,
        enable_gqa=False,
    )
    for b in range(3):
        slots = req_to_token[req_pool_indices[b], : prefix_lens[b] + 1]
        key, value = k_cache[slots].movedim(0, 1), v_cache[slots].movedim(0, 1)
        want = scaled_dot_product_attention(query[b : b + 1].movedim(0, 1), key, value)
        torch.testing.assert_close(out[b], want.movedim(1, 0)[0])


def test_a_tree_mask_of_the_wrong_size_is_refused() -> None:
    k_cache, v_cache = _cache(2)
    with pytest.raises(ValueError, match="QLEN_ONLY mask of 2\\*3\\*3 entries, got 17"):
        tree_verify_attention(
            torch.zeros(6, HEADS, DIM),
            k_cache,
            v_cache,
            torch.arange(SLOTS).reshape(4, 16),
            torch.tensor([0, 1]),
            torch.tensor([3, 4]),
            torch.ones(17, dtype=torch.bool),
            3,
            scaling=None,
            enable_gqa=False,
        )
