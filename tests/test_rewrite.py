"""The routing rewrite: a hand example, the kernel against the reference, and the invariants."""

from __future__ import annotations

import pytest
import torch

from xshare_sglang.kernels import rewrite_routing
from xshare_sglang.policies.rewrite import rewrite_routing as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_hand_example() -> None:
    """E=4, keep {0, 2}; 3 rows, the last is padding; column 2 holds a fused shared expert (id 4)."""
    ids = torch.tensor([[0, 1, 4], [2, 3, 4], [1, 0, 4]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4, 1.0], [0.7, 0.3, 1.0], [0.5, 0.5, 1.0]])
    keep = torch.tensor([True, False, True, False])
    metrics = torch.zeros(4, dtype=torch.float64)
    stats = torch.tensor([3, 4], dtype=torch.int64)
    reference(ids, weights, keep, num_valid_tokens=2, metrics_row=metrics, stats=stats)
    assert ids.tolist() == [[0, -1, 4], [2, -1, 4], [-1, -1, -1]]
    torch.testing.assert_close(weights, torch.tensor([[0.6, 0.0, 1.0], [0.7, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    # activated: experts 0 and 2 (the shared id 4 is not a routed expert); kept 2; retained 3/4
    assert metrics.tolist() == [2.0, 2.0, 0.75, 1.0]


def test_physical_ids() -> None:
    """Physical experts 0..5 map to logical [0, 1, 2, 3, 0, 1] (two replicas); keep {1}."""
    ids = torch.tensor([[4, 5, 1, 0]], dtype=torch.int32)
    weights = torch.ones(1, 4)
    p2l = torch.tensor([0, 1, 2, 3, 0, 1])
    reference(ids, weights, torch.tensor([False, True, False, False]), physical_to_logical=p2l)
    assert ids.tolist() == [[-1, 5, 1, -1]]


@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "num_experts", "replicas"),
    [(0, 8, 64, 0), (1, 4, 60, 0), (7, 8, 128, 0), (255, 9, 160, 32), (64, 16, 256, 0)],
)
@pytest.mark.parametrize("valid", ["all", "some", "tensor", "none"])
def test_kernel_matches_reference(num_tokens, num_slots, num_experts, replicas, valid) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_experts)
    num_ids = num_experts + replicas
    ids = torch.randint(-1, num_ids + 2, (num_tokens, num_slots), generator=gen, dtype=torch.int32)
    weights = torch.rand(num_tokens, num_slots, generator=gen)
    keep = torch.rand(num_experts, generator=gen) < 0.4
    p2l = (
        torch.cat([torch.arange(num_experts), torch.randint(0, num_experts, (replicas,), generator=gen)])
        if replicas
        else None
    )
    stats = torch.tensor([5, 9], dtype=torch.int64)
    n_valid = {"all": None, "some": max(0, num_tokens - 3), "tensor": max(0, num_tokens - 2), "none": 0}[valid]
    want_ids, want_weights, want_metrics = ids.clone(), weights.clone(), torch.full((4,), 2.0, dtype=torch.float64)
    reference(
        want_ids,
        want_weights,
        keep,
        num_valid_tokens=n_valid,
        physical_to_logical=p2l,
        metrics_row=want_metrics,
        stats=stats,
    )
    got_ids, got_weights = ids.to(DEVICE), weights.to(DEVICE)
    got_metrics = torch.full((4,), 2.0, dtype=torch.float64, device=DEVICE)
    nv = torch.tensor([n_valid], device=DEVICE) if valid == "tensor" else n_valid
    rewrite_routing(
        got_ids,
        got_weights,
        keep.to(DEVICE),
        num_valid_tokens=nv,
        physical_to_logical=None if p2l is None else p2l.to(DEVICE),
        metrics_row=got_metrics,
        stats=stats.to(DEVICE),
    )
    assert torch.equal(got_ids.cpu(), want_ids)
    assert torch.equal(got_weights.cpu(), want_weights)
    torch.testing.assert_close(got_metrics.cpu(), want_metrics, rtol=0, atol=1e-12)
    # every surviving routed id is kept; padding rows are fully dropped
    survivors = want_ids[(want_ids >= 0) & (want_ids < num_ids)].long()
    logical = survivors if p2l is None else p2l[survivors]
    assert keep[logical].all()
    if n_valid is not None:
        assert (want_ids[n_valid:] == -1).all()
