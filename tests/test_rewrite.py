"""The routing rewrite of the masked path (SGLang's router inside masked logits): hand examples and
invariants.  The fused path routes in the selection kernels and needs no rewrite (test_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from xshare_sglang.policies.rewrite import RETAINED_ONE
from xshare_sglang.policies.rewrite import rewrite_routing as reference


def test_hand_example() -> None:
    """E=4, keep {0, 2}; 3 rows, the last is padding; column 2 holds a fused shared expert (id 4)."""
    ids = torch.tensor([[0, 1, 4], [2, 3, 4], [1, 0, 4]], dtype=torch.int32)
    weights = torch.tensor([[0.6, 0.4, 1.0], [0.7, 0.3, 1.0], [0.5, 0.5, 1.0]])
    keep = torch.tensor([True, False, True, False])
    metrics = torch.zeros(4, dtype=torch.int64)
    stats = torch.tensor([3, 4], dtype=torch.int64)
    reference(ids, weights, keep, num_valid_tokens=2, metrics_row=metrics, stats=stats)
    assert ids.tolist() == [[0, -1, 4], [2, -1, 4], [-1, -1, -1]]
    torch.testing.assert_close(weights, torch.tensor([[0.6, 0.0, 1.0], [0.7, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    # activated: experts 0 and 2 (the shared id 4 is not a routed expert); kept 2; retained 3/4
    assert metrics.tolist() == [2, 2, RETAINED_ONE * 3 // 4, 1]


def test_physical_ids() -> None:
    """Physical experts 0..5 map to logical [0, 1, 2, 3, 0, 1] (two replicas); keep {1}."""
    ids = torch.tensor([[4, 5, 1, 0]], dtype=torch.int32)
    weights = torch.ones(1, 4)
    p2l = torch.tensor([0, 1, 2, 3, 0, 1])
    reference(ids, weights, torch.tensor([False, True, False, False]), physical_to_logical=p2l)
    assert ids.tolist() == [[-1, 5, 1, -1]]


def test_fill_hand_example() -> None:
    """E=6, keep {1, 4}, k=3.  Row 0 picked (1, 0, 4): 0 is pruned, every kept expert is in the row,
    so the filler is the lowest pruned expert the row no longer holds (0 itself, now at weight 0).  Row 1 picked (4, 5, 3): both
    fillers come from the kept expert it lacks (1), then pruned 0.  Row 2 is padding: the kept
    experts, then pruned 0.  No id repeats within a row; every filler has weight 0."""
    ids = torch.tensor([[1, 0, 4], [4, 5, 3], [3, 2, 1]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.2, 0.3], [0.6, 0.3, 0.1], [0.4, 0.4, 0.2]])
    keep = torch.tensor([False, True, False, False, True, False])
    metrics = torch.zeros(4, dtype=torch.int64)
    reference(ids, weights, keep, num_valid_tokens=2, metrics_row=metrics, fill_dropped=True)
    assert ids.tolist() == [[1, 0, 4], [4, 1, 0], [1, 4, 0]]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.0, 0.3], [0.6, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # the backend reads experts 0, 1 and 4: activated counts the filler
    assert metrics.tolist() == [3, 2, RETAINED_ONE, 1]


@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "num_experts", "replicas"),
    [(0, 8, 64, 0), (1, 4, 60, 0), (7, 8, 128, 0), (255, 9, 160, 32), (64, 16, 256, 0)],
)
@pytest.mark.parametrize("valid", ["all", "some", "none"])
@pytest.mark.parametrize("fill", [False, True], ids=["minus-one", "fill"])
def test_drops_only_pruned_picks_and_padding(num_tokens, num_slots, num_experts, replicas, valid, fill) -> None:
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
    want_ids, want_weights, want_metrics = ids.clone(), weights.clone(), torch.full((4,), 2, dtype=torch.int64)
    reference(
        want_ids,
        want_weights,
        keep,
        num_valid_tokens=n_valid,
        physical_to_logical=p2l,
        metrics_row=want_metrics,
        stats=stats,
        fill_dropped=fill,
    )
    # one call: calls +1, kept +|keep|, retained += floor(float32(5 / 9) * 2**24)
    ratio = torch.tensor(5.0) / torch.tensor(9.0)
    assert want_metrics[1:].tolist() == [2 + int(keep.sum()), 2 + int(torch.floor(ratio * RETAINED_ONE)), 3]
    if fill:
        return
    # every surviving routed id is kept; padding rows are fully dropped
    survivors = want_ids[(want_ids >= 0) & (want_ids < num_ids)].long()
    logical = survivors if p2l is None else p2l[survivors]
    assert keep[logical].all()
    if n_valid is not None:
        assert (want_ids[n_valid:] == -1).all()


@pytest.mark.parametrize(("num_tokens", "num_slots", "num_experts"), [(7, 4, 32), (255, 8, 60), (64, 8, 160)])
@pytest.mark.parametrize("keep_share", [0.05, 0.5])
def test_fill_invariants(num_tokens, num_slots, num_experts, keep_share) -> None:
    """Rows of distinct routed ids (as SGLang's top-k gives): after the fill every slot holds a valid id,
    no row repeats one, dropped slots have weight 0, kept slots are untouched, and the batch reads at
    most max(|keep|, k) experts beyond nothing: fillers come from kept experts while a row lacks any."""
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:num_slots] for _ in range(num_tokens)])
    ids = ids.to(torch.int32)
    weights = torch.rand(num_tokens, num_slots, generator=gen)
    keep = torch.rand(num_experts, generator=gen) < keep_share
    n_valid = num_tokens - 2
    before_ids, before_weights = ids.clone(), weights.clone()
    reference(ids, weights, keep, num_valid_tokens=n_valid, fill_dropped=True)
    assert ((ids >= 0) & (ids < num_experts)).all()
    assert all(len(set(row)) == num_slots for row in ids.tolist())
    kept_before = keep[before_ids.long()]
    kept_before[n_valid:] = False
    assert torch.equal(ids[kept_before], before_ids[kept_before])
    assert torch.equal(weights[kept_before], before_weights[kept_before])
    assert (weights[~kept_before] == 0).all()
    assert torch.unique(ids).numel() <= max(int(keep.sum()), num_slots)


def test_request_experts_counts_each_requests_union() -> None:
    """D = 2: request 0 routes to {0, 1, 2} (ids repeat across its rows), request 1 to {3} (a dropped
    slot, a filler-free row), request 2 is padding (every slot -1) and is not counted; ids outside
    [0, num_ids) never count; a trailing partial request is ignored."""
    from xshare_sglang.policies.rewrite import request_experts

    ids = torch.tensor([[0, 1], [1, 2], [3, -1], [3, 3], [-1, -1], [-1, -1], [5, 4]], dtype=torch.int32)
    assert request_experts(ids, 2, 5).tolist() == [4, 2]
    assert request_experts(ids, 2, 3).tolist() == [3, 1]  # ids 3 and 4 are not experts of 3
    assert request_experts(ids[:6], 1, 5).tolist() == [6, 4]  # D = 1: one row per request
    assert request_experts(ids[:0], 4, 5).tolist() == [0, 0]
