"""Invariants every policy must keep, on random batches (DESIGN section 4 and section 5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import configs, layer_calls, make_logits
from xshare_sglang import POLICIES, PrunerConfig, route_within, select_experts_mask
from xshare_sglang.policies.greedy import warm_up
from xshare_sglang.policies.scores import sanitize_logits, valid_token_mask

PRUNING = [p for p in POLICIES if p != "none"]
WARMUP = ["oea", "xshare", "xshare-threshold", "xshare-spec", "xshare-ep"]


def _kwargs(call: dict) -> dict:
    return dict(
        top_k=call["top_k"],
        tokens_per_request=call["tokens_per_request"],
        num_valid_tokens=call["num_valid_tokens"],
        expert_to_rank=torch.tensor(call["expert_to_rank"]),
        scoring=call["scoring"],
    )


def _warm(call: dict, k0: int) -> torch.Tensor:
    logits = sanitize_logits(call["logits"])
    valid = valid_token_mask(logits.shape[0], call["num_valid_tokens"], logits.device)
    return warm_up(logits, valid, k0)


@given(call=layer_calls())
def test_none_keeps_every_expert(call: dict) -> None:
    keep = select_experts_mask(call["logits"], PrunerConfig(policy="none"), **_kwargs(call))
    assert keep.all() and keep.shape == (call["logits"].shape[1],)


@pytest.mark.parametrize("policy", WARMUP)
@given(call=layer_calls(), data=st.data())
def test_warm_up_experts_always_kept(policy: str, call: dict, data: st.DataObject) -> None:
    cfg = data.draw(configs(policy, call["top_k"], call["logits"].shape[1]))
    cfg = PrunerConfig.from_dict({**cfg.to_dict(), "max_experts": None, "min_tokens": None, "max_tokens": None})
    keep = select_experts_mask(call["logits"], cfg, **_kwargs(call))
    warm = _warm(call, cfg.k0)
    assert not (warm & ~keep).any()


@given(call=layer_calls(), data=st.data())
def test_budget_adds_at_most_budget(call: dict, data: st.DataObject) -> None:
    budget = data.draw(st.integers(0, 20))
    k0 = data.draw(st.integers(0, call["top_k"]))
    cfg = PrunerConfig(policy="xshare", k0=k0, budget=budget)
    keep = select_experts_mask(call["logits"], cfg, **_kwargs(call))
    warm = _warm(call, k0)
    assert warm.sum() <= keep.sum() <= warm.sum() + budget


@given(call=layer_calls(), data=st.data())
def test_xshare_spec_budgets(call: dict, data: st.DataObject) -> None:
    """Each request adds at most request_budget; the batch step at most budget more."""
    request_budget, budget = data.draw(st.integers(0, 5)), data.draw(st.integers(0, 5))
    cfg = PrunerConfig(policy="xshare-spec", k0=1, request_budget=request_budget, budget=budget)
    keep = select_experts_mask(call["logits"], cfg, **_kwargs(call))
    valid = valid_token_mask(call["logits"].shape[0], call["num_valid_tokens"], torch.device("cpu"))
    num_requests = -(-int(valid.sum()) // call["tokens_per_request"])
    assert keep.sum() <= _warm(call, 1).sum() + num_requests * request_budget + budget


@given(call=layer_calls(), data=st.data())
def test_moe_spec_keeps_exactly_budget(call: dict, data: st.DataObject) -> None:
    num_experts = call["logits"].shape[1]
    budget = data.draw(st.integers(1, num_experts + 3))
    cfg = PrunerConfig(policy="moe-spec", max_experts=budget)
    keep = select_experts_mask(call["logits"], cfg, **_kwargs(call))
    valid = valid_token_mask(call["logits"].shape[0], call["num_valid_tokens"], torch.device("cpu"))
    assert int(keep.sum()) == (min(budget, num_experts) if valid.any() else 0)


@given(
    num_ranks=st.sampled_from([2, 4, 8, 16]),
    rank_budget=st.integers(1, 4),
    num_tokens=st.integers(1, 64),
    seed=st.integers(0, 2**31 - 1),
)
def test_xshare_ep_balances_ranks(num_ranks: int, rank_budget: int, num_tokens: int, seed: int) -> None:
    """XShare App. A: without warm-up every round gives each rank one more expert while it has experts
    with a score > 0; rounds go on until ``rank_budget * G`` experts are kept (or none are left)."""
    from xshare_sglang.policies import RoutingCall, select

    num_experts = 64
    logits = make_logits(num_tokens, num_experts, "normal", seed)
    expert_to_rank = torch.arange(num_experts) // (num_experts // num_ranks)
    cfg = PrunerConfig(policy="xshare-ep", k0=0, rank_budget=rank_budget, score="probs")
    keep, aggregate = select(RoutingCall.of(logits, top_k=4, expert_to_rank=expert_to_rank), cfg)
    loads = torch.bincount(expert_to_rank[keep], minlength=num_ranks)
    # a rank runs out of candidates only where its experts' scores all fall below the 2**-24 grid
    scored = torch.bincount(expert_to_rank[aggregate > 0], minlength=num_ranks)
    rounds = int(loads.max())
    assert torch.equal(loads, scored.clamp(max=rounds))
    if bool((scored >= rank_budget).all()):
        assert rounds == rank_budget
    else:
        assert int(keep.sum()) >= rank_budget * num_ranks or torch.equal(loads, scored)


@given(
    num_ranks=st.sampled_from([2, 4, 8]),
    num_tokens=st.integers(1, 32),
    seed=st.integers(0, 2**31 - 1),
)
def test_xshare_ep_greedy_rounds_differ_by_at_most_one(num_ranks: int, num_tokens: int, seed: int) -> None:
    """With a warm-up, the experts added by the rounds are spread evenly: per-rank additions differ by
    at most one, except ranks that ran out of candidates."""
    num_experts = 64
    logits = make_logits(num_tokens, num_experts, "normal", seed)
    expert_to_rank = torch.arange(num_experts) // (num_experts // num_ranks)
    cfg = PrunerConfig(policy="xshare-ep", k0=1, rank_budget=3, score="probs")
    keep = select_experts_mask(logits, cfg, top_k=2, expert_to_rank=expert_to_rank)
    warm = warm_up(sanitize_logits(logits), torch.ones(num_tokens, dtype=torch.bool), 1)
    added = torch.bincount(expert_to_rank[keep & ~warm], minlength=num_ranks)
    assert added.max() - added.min() <= 1


@pytest.mark.parametrize("policy", PRUNING)
@given(call=layer_calls(max_tokens=80), data=st.data())
def test_padded_rows_change_nothing(policy: str, call: dict, data: st.DataObject) -> None:
    """Rows at or after num_valid_tokens never vote: garbage there leaves the mask unchanged."""
    logits = call["logits"]
    cfg = data.draw(configs(policy, call["top_k"], logits.shape[1]))
    num_valid = data.draw(st.integers(0, logits.shape[0]))
    kwargs = {**_kwargs(call), "num_valid_tokens": num_valid}
    garbage = logits.clone()
    garbage[num_valid:] = torch.randn_like(garbage[num_valid:]) * 50
    garbage[num_valid:, ::3] = float("nan")
    trimmed = select_experts_mask(logits[:num_valid], cfg, **{**kwargs, "num_valid_tokens": None})
    assert torch.equal(select_experts_mask(garbage, cfg, **kwargs), trimmed)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("num_experts", [60, 64, 128, 160, 256])
def test_empty_batch(policy: str, num_experts: int) -> None:
    cfg = PrunerConfig(policy=policy, max_experts=8 if policy == "moe-spec" else None)
    logits = torch.empty(0, num_experts)
    keep = select_experts_mask(logits, cfg, top_k=4, expert_to_rank=torch.arange(num_experts) % 4)
    assert keep.shape == (num_experts,)
    assert bool(keep.all()) if policy == "none" else not keep.any()
    ids, weights = route_within(logits, keep, top_k=4)
    assert ids.shape == (0, 4) and weights.shape == (0, 4)


@pytest.mark.parametrize("policy", PRUNING)
@pytest.mark.parametrize("coverage", ["substitution", "truncation"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_nonfinite_logits_give_finite_weights_and_valid_ids(policy: str, coverage: str, scoring: str) -> None:
    num_tokens, num_experts, top_k = 33, 60, 6
    logits = make_logits(num_tokens, num_experts, "nonfinite", seed=7)
    logits[1] = float("nan")
    logits[2] = float("inf")
    logits[3, :5] = float("inf")
    cfg = PrunerConfig(policy=policy, max_experts=12 if policy == "moe-spec" else None)
    keep = select_experts_mask(
        logits,
        cfg,
        top_k=top_k,
        tokens_per_request=3,
        scoring=scoring,
        expert_to_rank=torch.arange(num_experts) // 15,
    )
    ids, weights = route_within(logits, keep, top_k=top_k, coverage=coverage, scoring=scoring)
    assert torch.isfinite(weights).all()
    assert ((ids >= -1) & (ids < num_experts)).all()
    assert (weights[ids < 0] == 0).all()
    assert (ids[0] == -1).all()  # row 0 has no finite logit: nothing to route to
    assert (ids[1] == -1).all()  # all NaN is all -inf


@given(call=layer_calls(), data=st.data())
def test_token_range_controls(call: dict, data: st.DataObject) -> None:
    """Outside [min_tokens, max_tokens] real tokens the layer call is left unpruned."""
    low = data.draw(st.integers(0, 50))
    high = data.draw(st.integers(max(low, 1), 60))
    cfg = PrunerConfig(policy="oea", k0=1, min_tokens=low, max_tokens=high)
    keep = select_experts_mask(call["logits"], cfg, **_kwargs(call))
    valid = valid_token_mask(call["logits"].shape[0], call["num_valid_tokens"], torch.device("cpu"))
    if low <= int(valid.sum()) <= high:
        assert torch.equal(keep, _warm(call, 1))
    else:
        assert keep.all()
