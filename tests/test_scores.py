"""Per-token scores against float64 formulas, and the fixed-point aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from tests.strategies import make_logits
from xshare_sglang.policies.scores import (
    SCORE_ONE,
    aggregate,
    exp32,
    sanitize_logits,
    sigmoid32,
    token_scores,
)


def _reference(row: list[float], score: str, scoring: str, top_k: int) -> list[float]:
    finite = [e for e, v in enumerate(row) if v > -math.inf]
    members = sorted(finite, key=lambda e: (-row[e], e))[:top_k] if score == "topk" else finite
    if scoring == "softmax":
        if not members:
            return [0.0] * len(row)
        m = max(row[e] for e in members)
        z = sum(math.exp(row[e] - m) for e in members)
        return [math.exp(row[e] - m) / z if e in members else 0.0 for e in range(len(row))]
    sig = [1 / (1 + math.exp(-v)) if v > -700 else 0.0 for v in row]
    if score == "probs":
        return [sig[e] if e in finite else 0.0 for e in range(len(row))]
    z = sum(sig[e] for e in members)
    return [sig[e] / z if e in members and z > 0 else 0.0 for e in range(len(row))]


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    # fixed-point scores from the logits cast to float32, whatever the input dtype: two grid steps
    # (the floor of a term and of the quotient) plus exp32's float32 error
    [
        (torch.float32, dict(atol=2 * 2**-24, rtol=1e-6)),
        (torch.bfloat16, dict(atol=2 * 2**-24, rtol=1e-6)),
        (torch.float16, dict(atol=2 * 2**-24, rtol=1e-6)),
    ],
)
@pytest.mark.parametrize("score", ["topk", "probs"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("style", ["normal", "integers", "nonfinite", "few_finite"])
@pytest.mark.parametrize("num_experts", [60, 64, 160, 256])
def test_token_scores_match_formula(dtype, tolerance, score, scoring, style, num_experts) -> None:
    logits = make_logits(7, num_experts, style, seed=num_experts).to(dtype)
    clean = sanitize_logits(logits)
    got = token_scores(clean, score=score, scoring=scoring, top_k=4)
    want = torch.tensor([_reference(row, score, scoring, 4) for row in clean.tolist()], dtype=torch.float64)
    assert got.dtype == torch.int64
    assert (got >= 0).all() and (got <= SCORE_ONE).all()
    torch.testing.assert_close(got.to(torch.float64) / SCORE_ONE, want, **tolerance)
    if score == "topk" or scoring == "softmax":  # renormalized rows sum to one, less the floors
        sums = got.sum(dim=1)
        nonempty = clean.isfinite().any(dim=1)
        assert ((sums <= SCORE_ONE) & ((sums > SCORE_ONE - got.shape[1]) | ~nonempty)).all()


def test_rows_are_independent() -> None:
    """A token's scores do not depend on the other rows of the batch (bit for bit)."""
    logits = sanitize_logits(make_logits(255, 160, "nonfinite", seed=3))
    for score in ("topk", "probs"):
        for scoring in ("softmax", "sigmoid"):
            batched = token_scores(logits, score=score, scoring=scoring, top_k=8)
            for t in (0, 1, 100, 254):
                alone = token_scores(logits[t : t + 1], score=score, scoring=scoring, top_k=8)
                assert torch.equal(batched[t : t + 1], alone)


def test_sanitize() -> None:
    raw = torch.tensor([[float("nan"), float("inf"), float("-inf"), 1.5]], dtype=torch.bfloat16)
    clean = sanitize_logits(raw)
    assert clean.dtype == torch.float32
    assert clean.tolist() == [[float("-inf"), torch.finfo(torch.float32).max, float("-inf"), 1.5]]
    assert raw.isnan().any()  # the input is left alone


def test_exp32_is_accurate_and_exact_at_zero() -> None:
    """exp32 is within 2 ulp of the true exp over its whole range, 1 at 0, 0 below -87, inf above 88."""
    x = torch.cat([torch.linspace(-87.0, 88.0, 200_001), -torch.rand(100_000) * 30, torch.tensor([0.0, -0.0])])
    got = exp32(x).to(torch.float64)
    want = torch.exp(x.to(torch.float64))
    ulp = torch.abs(torch.nextafter(want.float(), torch.tensor(float("inf"))).to(torch.float64) - want.float().double())
    assert ((got - want).abs() <= 2 * ulp).all()
    assert exp32(torch.tensor([0.0, -0.0])).tolist() == [1.0, 1.0]
    assert exp32(torch.tensor([-87.5, float("-inf"), 88.5, float("inf")])).tolist() == [
        0.0,
        0.0,
        float("inf"),
        float("inf"),
    ]
    assert sigmoid32(torch.tensor([float("-inf"), -100.0, 0.0, 100.0, float("inf")])).tolist() == [
        0.0,
        0.0,
        0.5,
        1.0,
        1.0,
    ]


def test_fixed_point_is_exact_and_order_free() -> None:
    q = token_scores(torch.tensor([[0.0, 0.0, -40.0, float("-inf")]]), score="probs", scoring="softmax", top_k=2)
    assert SCORE_ONE == 2**24
    assert q.tolist() == [[SCORE_ONE // 2, SCORE_ONE // 2, 0, 0]]
    gen = torch.Generator().manual_seed(1)
    many = torch.randint(0, SCORE_ONE + 1, (4097, 64), generator=gen)
    valid = torch.ones(4097, dtype=torch.bool)
    forward = aggregate(many, valid)
    backward = aggregate(many.flip(0), valid)
    assert torch.equal(forward, backward)
    assert torch.equal(forward, torch.tensor([sum(col) for col in many.T.tolist()]))
