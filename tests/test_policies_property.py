"""Every policy against the brute-force reading of DESIGN section 4: masks must match exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests import brute_force
from tests.strategies import configs, layer_calls, vote_weights
from xshare_sglang import POLICIES, select_experts_mask


@pytest.mark.parametrize("policy", POLICIES)
@given(data=st.data())
def test_mask_matches_brute_force(policy: str, data: st.DataObject) -> None:
    call = data.draw(layer_calls(), label="call")
    logits = call["logits"]
    cfg = data.draw(configs(policy, call["top_k"], logits.shape[1]), label="cfg")
    kwargs = dict(
        top_k=call["top_k"],
        tokens_per_request=call["tokens_per_request"],
        num_valid_tokens=call["num_valid_tokens"],
        scoring=call["scoring"],
    )
    expected = brute_force.select(logits, cfg, expert_to_rank=call["expert_to_rank"], **kwargs)
    keep = select_experts_mask(logits, cfg, expert_to_rank=torch.tensor(call["expert_to_rank"]), **kwargs)
    assert keep.dtype == torch.bool and keep.shape == (logits.shape[1],)
    assert keep.tolist() == expected


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
@given(call=layer_calls(max_tokens=64), data=st.data())
def test_device_count_equals_int_count(policy: str, call: dict, data: st.DataObject) -> None:
    """A real-token count held in a tensor gives the same mask as the same count as an int."""
    logits = call["logits"]
    cfg = data.draw(configs(policy, call["top_k"], logits.shape[1]))
    num_valid = data.draw(st.integers(0, logits.shape[0]))
    kwargs = dict(
        top_k=call["top_k"],
        tokens_per_request=call["tokens_per_request"],
        expert_to_rank=torch.tensor(call["expert_to_rank"]),
        scoring=call["scoring"],
    )
    as_int = select_experts_mask(logits, cfg, num_valid_tokens=num_valid, **kwargs)
    as_tensor = select_experts_mask(logits, cfg, num_valid_tokens=torch.tensor([num_valid]), **kwargs)
    assert torch.equal(as_int, as_tensor)


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"] + ["moe-spec/request"])
@given(data=st.data())
def test_weighted_votes_match_brute_force(policy: str, data: st.DataObject) -> None:
    """Speculative verify: vote weights (and moe-spec's per-request scope) by the letter of the rule."""
    call = data.draw(layer_calls(max_tokens=120), label="call")
    logits = call["logits"]
    policy, _, scope = policy.partition("/")
    cfg = data.draw(configs(policy, call["top_k"], logits.shape[1]), label="cfg")
    if scope:
        cfg = dataclasses.replace(cfg, scope=scope)
    # float32, as the server passes them; the brute force reads the same values as Python floats
    weights = torch.tensor(data.draw(vote_weights(logits.shape[0]), label="weights"), dtype=torch.float32)
    kwargs = dict(
        top_k=call["top_k"],
        tokens_per_request=call["tokens_per_request"],
        num_valid_tokens=call["num_valid_tokens"],
        scoring=call["scoring"],
    )
    expected = brute_force.select(logits, cfg, expert_to_rank=call["expert_to_rank"], token_weights=weights, **kwargs)
    keep = select_experts_mask(
        logits,
        cfg,
        expert_to_rank=torch.tensor(call["expert_to_rank"]),
        token_weights=weights,
        **kwargs,
    )
    assert keep.tolist() == expected
