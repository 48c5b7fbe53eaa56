"""MoE-Spec oracle ranking: a hand example, and a plain loop over route_within as the reference."""

from __future__ import annotations

import math

import pytest
import torch

from xshare_sglang import oracle_ranking, route_within


def _example():
    """One token, E=3, top_k=2: natural top-2 = e0 (weight .75), e1 (.25)."""
    logits = torch.tensor([[math.log(3.0), 0.0, -20.0]])
    outputs = torch.tensor([[[1.0, 0.0], [0.0, 4.0], [9.0, 9.0]]])
    return logits, outputs


def test_truncation_hand_example() -> None:
    """Gold output .75*[1,0] + .25*[0,4] = [.75, 1].  Keeping e0 alone leaves error 1.0, e1 alone
    .5625, e2 alone 1.5625 (not in the natural top-2, so it contributes nothing): e1 first, although
    e0 has the larger router weight; then e0 makes the output exact."""
    logits, outputs = _example()
    result = oracle_ranking(logits, outputs, top_k=2)
    assert result.order.tolist() == [1, 0, 2]
    torch.testing.assert_close(result.errors, torch.tensor([0.5625, 0.0, 0.0], dtype=torch.float64))
    assert result.baseline_error == pytest.approx(1.5625)
    assert result.keep_mask(1, 3).tolist() == [False, True, False]


def test_substitution_hand_example() -> None:
    """With substitution a lone kept expert takes the whole weight: e0 alone gives [1, 0] (error
    1.0625), e1 alone [0, 4] (9.5625): e0 first, then e1 restores the gold output."""
    logits, outputs = _example()
    result = oracle_ranking(logits, outputs, top_k=2, coverage="substitution", budget=2)
    assert result.order.tolist() == [0, 1]
    torch.testing.assert_close(result.errors, torch.tensor([1.0625, 0.0], dtype=torch.float64))


def _loop_oracle(logits, outputs, top_k, budget, coverage, num_valid):
    """Greedy by the letter of eq. 6, one candidate at a time through the public route_within."""

    def output(keep):
        ids, weights = route_within(logits, keep, top_k=top_k, coverage=coverage, num_valid_tokens=num_valid)
        out = torch.zeros(logits.shape[0], outputs.shape[2], dtype=torch.float64)
        for t in range(logits.shape[0]):
            for slot in range(top_k):
                if ids[t, slot] >= 0:
                    out[t] += float(weights[t, slot]) * outputs[t, int(ids[t, slot])].double()
        return out

    gold = output(torch.ones(logits.shape[1], dtype=torch.bool))
    kept: list[int] = []
    errors = []
    for _ in range(budget):
        best, best_error = None, math.inf
        for e in range(logits.shape[1]):
            if e in kept:
                continue
            keep = torch.zeros(logits.shape[1], dtype=torch.bool)
            keep[torch.tensor([*kept, e])] = True
            error = float(((gold - output(keep)) ** 2).sum())
            if best is None or error < best_error - 1e-9 * max(1.0, best_error):
                best, best_error = e, error
        kept.append(best)
        errors.append(best_error)
    return kept, errors


@pytest.mark.parametrize("coverage", ["truncation", "substitution"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_loop_reference(coverage: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_experts, hidden, top_k = 7, 13, 5, 3
    logits = torch.randn(num_tokens, num_experts, generator=gen) * 2
    outputs = torch.randn(num_tokens, num_experts, hidden, generator=gen)
    result = oracle_ranking(logits, outputs, top_k=top_k, budget=6, coverage=coverage, num_valid_tokens=5)
    order, errors = _loop_oracle(logits, outputs, top_k, 6, coverage, 5)
    assert result.order.tolist() == order
    torch.testing.assert_close(result.errors, torch.tensor(errors, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_truncation_error_reaches_zero_on_the_routed_union() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 20, generator=gen)
    outputs = torch.randn(6, 20, 4, generator=gen)
    result = oracle_ranking(logits, outputs, top_k=2)
    union = len(set(route_within(logits, torch.ones(20, dtype=torch.bool), top_k=2)[0].flatten().tolist()))
    assert (result.errors[1:] <= result.errors[:-1] + 1e-9).all()
    assert result.errors[union - 1] < 1e-9
    assert result.errors[union - 2] > 1e-6


def test_rejects_bad_shapes() -> None:
    logits, outputs = _example()
    with pytest.raises(ValueError, match="expert_outputs must have shape"):
        oracle_ranking(logits, outputs[:, :2], top_k=2)
    with pytest.raises(ValueError, match="budget"):
        oracle_ranking(logits, outputs, top_k=2, budget=4)
