"""Hypothesis strategies for router-logit batches and pruner configs."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from xshare_sglang import PrunerConfig
from xshare_sglang.policies.call import RouterSpec, RoutingCall

EXPERT_COUNTS = [1, 2, 3, 5, 8, 13, 60, 64, 160, 256]
STYLES = ["normal", "integers", "repeated_rows", "nonfinite", "few_finite"]


def make_logits(num_tokens: int, num_experts: int, style: str, seed: int) -> torch.Tensor:
    """Router logits of a given style; reproducible from the seed."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_experts)
    if style == "normal":
        scale = [0.1, 1.0, 4.0][seed % 3]
        return torch.randn(shape, generator=gen) * scale
    if style == "integers":  # many exact ties within and across tokens
        return torch.randint(-3, 4, shape, generator=gen).float()
    if style == "repeated_rows":  # tokens repeat a few rows, some permuted: equal aggregates
        pool = torch.randint(-2, 3, (3, num_experts), generator=gen).float()
        rows = []
        for _ in range(num_tokens):
            row = pool[int(torch.randint(0, 3, (1,), generator=gen))]
            if torch.rand((), generator=gen) < 0.5:
                row = row[torch.randperm(num_experts, generator=gen)]
            rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(shape)
    if style == "nonfinite":
        logits = torch.randn(shape, generator=gen)
        pick = torch.rand(shape, generator=gen)
        logits[pick < 0.04] = float("nan")
        logits[(pick >= 0.04) & (pick < 0.08)] = float("-inf")
        logits[(pick >= 0.08) & (pick < 0.10)] = float("inf")
        if num_tokens:
            logits[0] = float("-inf")  # a token with no candidate at all
        return logits
    if style == "few_finite":  # like a top-k-only trace: few scored experts per token
        logits = torch.full(shape, float("-inf"))
        width = max(1, min(num_experts, 1 + seed % 4))
        for t in range(num_tokens):
            chosen = torch.randperm(num_experts, generator=gen)[:width]
            logits[t, chosen] = torch.randn(width, generator=gen)
        return logits
    raise AssertionError(style)


@st.composite
def layer_calls(draw, max_tokens: int = 300, expert_counts=EXPERT_COUNTS):
    """A layer call: logits, top_k, valid-token count, D and an expert-to-rank map."""
    num_experts = draw(st.sampled_from(expert_counts))
    num_tokens = draw(st.integers(0, max_tokens))
    style = draw(st.sampled_from(STYLES))
    seed = draw(st.integers(0, 2**31 - 1))
    top_k = draw(st.integers(1, min(num_experts, 16)))
    num_valid = draw(st.one_of(st.none(), st.integers(0, num_tokens + 2)))
    tokens_per_request = draw(st.integers(1, 8))
    num_ranks = draw(st.integers(1, min(num_experts, 16)))
    layout = draw(st.sampled_from(["contiguous", "random"]))
    if layout == "contiguous":
        per_rank = -(-num_experts // num_ranks)
        expert_to_rank = [min(e // per_rank, num_ranks - 1) for e in range(num_experts)]
    else:
        gen = torch.Generator().manual_seed(seed + 1)
        expert_to_rank = torch.randint(0, num_ranks, (num_experts,), generator=gen).tolist()
    return {
        "logits": make_logits(num_tokens, num_experts, style, seed),
        "top_k": top_k,
        "num_valid_tokens": num_valid,
        "tokens_per_request": tokens_per_request,
        "expert_to_rank": expert_to_rank,
        "scoring": draw(st.sampled_from(["softmax", "sigmoid"])),
    }


@st.composite
def configs(draw, policy: str, top_k: int, num_experts: int):
    """A valid PrunerConfig for ``policy`` on a model with this top_k and E."""
    kwargs = {
        "policy": policy,
        "k0": draw(st.integers(0, top_k)),
        "budget": draw(st.integers(0, num_experts + 2)),
        "request_budget": draw(st.integers(0, 6)),
        "rank_budget": draw(st.integers(0, 6)),
        "tau": draw(st.one_of(st.sampled_from([0.25, 0.5, 0.75, 1.0]), st.floats(0.01, 1.0))),
        "score": draw(st.sampled_from([None, "topk", "probs"])),
        "alpha": draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 8.0])),
        "beta": draw(st.integers(1, 8)),
        "max_experts": draw(st.one_of(st.none(), st.integers(1, num_experts + 2))),
    }
    if policy == "moe-spec" and kwargs["max_experts"] is None:
        kwargs["max_experts"] = draw(st.integers(1, num_experts + 2))
    if draw(st.booleans()):
        low = draw(st.integers(0, 40))
        kwargs["min_tokens"] = low
        kwargs["max_tokens"] = draw(st.integers(max(low, 1), 300))
    return PrunerConfig(**kwargs)


@st.composite
def vote_weights(draw, num_tokens: int):
    """Per-row vote weights of a verify batch: 1, 0 (never accepted), depth-decay powers, arbitrary
    values, and values the selection must clean (NaN, < 0, > 1)."""
    value = st.one_of(
        st.sampled_from([1.0, 0.0, 0.5, 0.25, 0.125, 0.7**3, float("nan"), -1.0, 2.0]),
        st.floats(0.0, 1.0, width=32),
    )
    return draw(st.lists(value, min_size=num_tokens, max_size=num_tokens))


def routing_call(logits: torch.Tensor, router, *, device=None, **fields) -> RoutingCall:
    """A :class:`RoutingCall` with every tensor (the logits included) moved to ``device``; ``router``
    is a :class:`RouterSpec` or a top-k (a plain softmax router); an int ``num_valid_tokens`` stays an
    int unless ``as_tensor=True``."""
    as_tensor = fields.pop("as_tensor", False)
    if not isinstance(router, RouterSpec):
        router = RouterSpec(router, fields.pop("scoring", "softmax"))
    if as_tensor and isinstance(fields.get("num_valid_tokens"), int):
        fields["num_valid_tokens"] = torch.tensor([fields["num_valid_tokens"]], dtype=torch.int32)
    moved = {k: (v.to(device) if isinstance(v, torch.Tensor) and device is not None else v) for k, v in fields.items()}
    return RoutingCall(logits.to(device) if device is not None else logits, router, **moved)
