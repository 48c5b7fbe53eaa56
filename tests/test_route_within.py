"""route_within against the brute-force reading: ids exactly, weights within a stated tolerance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests import brute_force
from tests.strategies import layer_calls
from xshare_sglang import route_within

# The package computes weights in float32 (after casting the logits); the brute force in float64
# from the same float32 values.  The tolerance covers float32 rounding, for every input dtype.
DTYPE_TOLERANCE = [
    (torch.float32, dict(atol=2e-6, rtol=2e-5)),
    (torch.bfloat16, dict(atol=2e-6, rtol=2e-5)),
    (torch.float16, dict(atol=2e-6, rtol=2e-5)),
]


@pytest.mark.parametrize(("dtype", "tolerance"), DTYPE_TOLERANCE)
@pytest.mark.parametrize("coverage", ["substitution", "truncation"])
@given(call=layer_calls(max_tokens=120), data=st.data())
def test_matches_brute_force(dtype, tolerance, coverage: str, call: dict, data: st.DataObject) -> None:
    logits = call["logits"].to(dtype)
    num_experts = logits.shape[1]
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=num_experts, max_size=num_experts)))
    renormalize = data.draw(st.booleans())
    kwargs = dict(top_k=call["top_k"], coverage=coverage, scoring=call["scoring"], renormalize=renormalize)
    num_valid = call["num_valid_tokens"]
    ids, weights = route_within(logits, keep, num_valid_tokens=num_valid, **kwargs)
    want_ids, want_weights = brute_force.route(logits, keep.tolist(), num_valid_tokens=num_valid, **kwargs)
    assert ids.tolist() == want_ids
    torch.testing.assert_close(
        weights, torch.tensor(want_weights, dtype=torch.float32).reshape(weights.shape), **tolerance
    )


@given(call=layer_calls(max_tokens=120), data=st.data())
def test_coverage_properties(call: dict, data: st.DataObject) -> None:
    logits = call["logits"]
    num_experts, top_k = logits.shape[1], call["top_k"]
    keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=num_experts, max_size=num_experts)))
    scoring = call["scoring"]
    finite = ~(logits.isnan() | (logits == float("-inf")))

    ids, weights = route_within(logits, keep, top_k=top_k, scoring=scoring)
    for t in range(logits.shape[0]):
        chosen = [e for e in ids[t].tolist() if e >= 0]
        # every id is kept; the token gets min(k, |kept candidates|) experts; -1 slots come last
        assert all(keep[e] for e in chosen)
        assert len(chosen) == min(top_k, int((keep & finite[t]).sum()))
        assert ids[t, len(chosen) :].eq(-1).all()
        # renormalized weights sum to one when the token has any weight at all
        total = float(weights[t].sum())
        assert total == 0.0 or abs(total - 1.0) < 1e-5

    natural_ids, natural_weights = route_within(
        logits, torch.ones_like(keep), top_k=top_k, scoring=scoring, renormalize=False
    )
    trunc_ids, trunc_weights = route_within(
        logits, keep, top_k=top_k, coverage="truncation", scoring=scoring, renormalize=False
    )
    # truncation keeps the natural slots and weights, and zeroes the rest without renormalizing
    kept_slot = (natural_ids >= 0) & keep[natural_ids.clamp(min=0).long()]
    assert torch.equal(trunc_ids, torch.where(kept_slot, natural_ids, -1))
    assert torch.equal(trunc_weights, torch.where(kept_slot, natural_weights, 0.0))


def test_rejects_bad_arguments() -> None:
    logits = torch.randn(4, 8)
    keep = torch.ones(8, dtype=torch.bool)
    with pytest.raises(ValueError, match="coverage"):
        route_within(logits, keep, top_k=2, coverage="partial")
    with pytest.raises(ValueError, match="top_k"):
        route_within(logits, keep, top_k=9)
    with pytest.raises(ValueError, match="scoring"):
        route_within(logits, keep, top_k=2, scoring="tanh")
    with pytest.raises(ValueError, match="keep"):
        route_within(logits, keep[:4], top_k=2)


def test_model_routing_is_kept_rows() -> None:
    """Which rows may take the model's own routing: all picks kept, or a missing pick tied with a
    kept expert the model left out; never grouped routers, scaled outputs or non-finite rows; for
    softmax without renormalization only when every finite expert is kept."""
    from xshare_sglang.policies.call import RouterSpec
    from xshare_sglang.policies.routing import adopt_model_routing, model_routing_is_kept

    logits = torch.tensor(
        [
            [4.0, 3.0, 2.0, 1.0, 0.0, -1.0],  # picks 0, 1: both kept
            [4.0, 3.0, 2.0, 1.0, 0.0, -1.0],  # picks 0, 2 (model's order): 2 not kept, no tie
            [1.0, 3.0, 3.0, 0.0, 0.0, 0.0],  # picks 1, 2: 2 not kept, ties with kept 1? no: 1 is picked
            [5.0, 2.0, 0.0, 2.0, 0.0, 0.0],  # picks 0, 3: 3 not kept, ties with kept, unpicked 1
            [float("nan"), 3.0, 2.0, 1.0, 0.0, 0.0],  # not finite
        ]
    )
    keep = torch.tensor([True, True, False, False, True, False])
    model_ids = torch.tensor([[0, 1], [0, 2], [1, 2], [0, 3], [1, 2]])
    model_weights = torch.full((5, 2), 0.5)
    router = RouterSpec(2)
    rows = model_routing_is_kept(logits, keep, router, model_ids, model_weights)
    assert rows.tolist() == [True, False, False, True, False]
    grouped = RouterSpec(2, num_expert_group=2, topk_group=1)
    assert not model_routing_is_kept(logits, keep, grouped, model_ids, model_weights).any()
    scaled = RouterSpec(2, routed_scaling_factor=2.5)
    assert not model_routing_is_kept(logits, keep, scaled, model_ids, model_weights).any()
    raw = RouterSpec(2, renormalize=False)
    assert not model_routing_is_kept(logits, keep, raw, model_ids, model_weights).any()
    every = torch.ones(6, dtype=torch.bool)
    assert model_routing_is_kept(logits, every, raw, model_ids, model_weights).tolist() == [True] * 4 + [False]
    inf_weights = model_weights.clone()
    inf_weights[0, 0] = float("inf")
    assert not model_routing_is_kept(logits, keep, router, model_ids, inf_weights)[0]

    ids = torch.tensor([[1, 0], [0, 1], [-1, -1], [0, 1], [0, 1]], dtype=torch.int32)
    weights = torch.full((5, 2), 0.25)
    weights[2] = 0.0
    taken_rows = torch.tensor([True, False, True, True, False])
    new_ids, new_weights, taken = adopt_model_routing(ids, weights, model_ids, model_weights, taken_rows)
    assert taken.tolist() == [True, False, False, True, False]  # row 2 routes nowhere: left alone
    assert new_ids.dtype == torch.int32 and new_ids.tolist() == [[0, 1], [0, 1], [-1, -1], [0, 3], [0, 1]]
    assert new_weights[:, 0].tolist() == [0.5, 0.25, 0.0, 0.5, 0.25]
