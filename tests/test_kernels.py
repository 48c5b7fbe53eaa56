"""Triton kernels against the torch reference: masks must be equal.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py); on a GPU natively.  Inputs come
from fixed seeds: odd expert counts, odd token counts, T = 0, every token padded, NaN/inf rows, ties,
and all three input dtypes.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import pytest
import torch

from tests.strategies import make_logits
from xshare_sglang import PrunerConfig, select_experts_mask
from xshare_sglang.kernels import SelectionWorkspace, apply_keep_mask, plan_launch, select_keep_mask
from xshare_sglang.kernels import selection as selection_module
from xshare_sglang.policies.apply import MASKED_LOGIT, mask_router_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POLICIES = ["oea", "xshare", "xshare-threshold", "xshare-spec", "xshare-ep", "moe-spec", "lynx"]
SHAPES = [(0, 60), (1, 64), (7, 160), (33, 128), (255, 64), (40, 256), (19, 384)]
STYLES = ["normal", "integers", "nonfinite", "repeated_rows", "few_finite"]


def _random_case(policy: str, num_tokens: int, num_experts: int, seed: int) -> dict:
    rng = random.Random(seed)
    top_k = rng.randint(1, min(16, num_experts))
    kwargs = {
        "policy": policy,
        "k0": rng.randint(0, top_k),
        "budget": rng.choice([0, 1, 4, 12, num_experts]),
        "request_budget": rng.randint(0, 5),
        "rank_budget": rng.randint(0, 6),
        "tau": rng.choice([0.5, 0.8, 0.9, 1.0, rng.random() or 0.5]),
        "score": rng.choice([None, "topk", "probs"]),
        "alpha": rng.choice([0.5, 1.0, 2.0, 4.0]),
        "beta": rng.randint(1, 8),
        "max_experts": rng.choice([None, None, 1, 8, num_experts])
        if policy != "moe-spec"
        else rng.randint(1, num_experts + 1),
    }
    if rng.random() < 0.2:
        kwargs["min_tokens"], kwargs["max_tokens"] = 2, rng.randint(2, 300)
    num_ranks = rng.choice([1, 2, 4, 8, 64])
    return {
        "cfg": PrunerConfig(**kwargs),
        "top_k": top_k,
        "tokens_per_request": rng.choice([1, 2, 3, 4, 6, 64]),
        "num_valid": rng.choice([None, num_tokens, max(0, num_tokens - 5), 0, num_tokens + 3]),
        "expert_to_rank": torch.randint(0, num_ranks, (num_experts,), generator=torch.Generator().manual_seed(seed)),
        "scoring": rng.choice(["softmax", "sigmoid"]),
        "style": STYLES[seed % len(STYLES)],
    }


def _compare(logits: torch.Tensor, case: dict, as_tensor: bool) -> None:
    kwargs = dict(
        top_k=case["top_k"],
        tokens_per_request=case["tokens_per_request"],
        expert_to_rank=case["expert_to_rank"],
        scoring=case["scoring"],
    )
    want = select_experts_mask(logits, case["cfg"], num_valid_tokens=case["num_valid"], **kwargs)
    num_valid = case["num_valid"]
    if as_tensor and num_valid is not None:
        num_valid = torch.tensor([num_valid], device=DEVICE)
    kwargs["expert_to_rank"] = case["expert_to_rank"].to(DEVICE)
    got = select_keep_mask(logits.to(DEVICE), case["cfg"], num_valid_tokens=num_valid, **kwargs)
    assert got.dtype == torch.bool and got.shape == want.shape
    assert got.cpu().tolist() == want.tolist(), f"{case['cfg'].summary()} top_k={case['top_k']} case={case}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("num_tokens", "num_experts"), SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_matches_reference(policy: str, num_tokens: int, num_experts: int, seed: int) -> None:
    case = _random_case(policy, num_tokens, num_experts, seed * 7919 + num_tokens)
    logits = make_logits(num_tokens, num_experts, case["style"], seed)
    _compare(logits, case, as_tensor=seed % 2 == 0)


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    # masks are compared exactly: both paths read the logits cast to float32
    [(torch.float32, 0), (torch.bfloat16, 0), (torch.float16, 0)],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_kernel_dtypes(dtype: torch.dtype, tolerance: int, policy: str) -> None:
    case = _random_case(policy, 24, 64, seed=11)
    case["num_valid"] = 20
    logits = make_logits(24, 64, "normal", seed=3).to(dtype)
    _compare(logits, case, as_tensor=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_kernel_large_batch(policy: str) -> None:
    """T = 4097: more tokens than the token pass has programs, and a second tile size."""
    case = _random_case(policy, 4097, 64, seed=5)
    case["num_valid"] = 4000
    case["tokens_per_request"] = 7
    _compare(make_logits(4097, 64, "normal", seed=9), case, as_tensor=True)


# Hand-built edge cases (see test_worked_examples.py for the reasoning): the threshold reached exactly,
# scores just above and far below the 2**-24 grid, LYNX digit carries, ties everywhere.
EDGE_CASES = [
    (torch.tensor([[1.0, 1.0, -5.0]]), PrunerConfig(policy="xshare-threshold", k0=1, tau=0.5), 2, [True, False, False]),
    (
        torch.tensor([[1.0, 1.0, -5.0]]),
        PrunerConfig(policy="xshare-threshold", k0=1, tau=0.5000001),
        2,
        [True, True, False],
    ),
    (
        torch.tensor([[0.0, -12.0, -40.0]]),
        PrunerConfig(policy="xshare", k0=1, budget=2, score="probs"),
        1,
        [True, True, False],
    ),
    (
        torch.tensor([[5.0, 0.0, 4.5], [5.0, 0.0, 0.0]]),
        PrunerConfig(policy="lynx", alpha=1.0, beta=1),
        2,
        [True, False, True],
    ),
    (torch.zeros(3, 6), PrunerConfig(policy="moe-spec", max_experts=4), 2, [True] * 4 + [False] * 2),
    (torch.zeros(3, 6), PrunerConfig(policy="xshare", k0=0, budget=3, score="probs"), 2, [True] * 3 + [False] * 3),
]


@pytest.mark.parametrize(("logits", "cfg", "top_k", "expected"), EDGE_CASES)
def test_kernel_edge_cases(logits, cfg, top_k, expected) -> None:
    assert select_experts_mask(logits, cfg, top_k=top_k).tolist() == expected
    assert select_keep_mask(logits.to(DEVICE), cfg, top_k=top_k).cpu().tolist() == expected


def test_moe_spec_static(tmp_path) -> None:
    import json

    num_experts = 160
    counts = [[float((e * 37 + layer * 11) % 17) for e in range(num_experts)] for layer in range(3)]
    path = tmp_path / "ranking.json"
    path.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
    cfg = PrunerConfig(policy="moe-spec", max_experts=20, ranking="static", static_ranking_path=str(path))
    logits = make_logits(9, num_experts, "normal", seed=1)
    for layer in range(3):
        for num_valid in (9, 0):
            want = select_experts_mask(logits, cfg, top_k=4, num_valid_tokens=num_valid, layer_id=layer)
            got = select_keep_mask(logits.to(DEVICE), cfg, top_k=4, num_valid_tokens=num_valid, layer_id=layer)
            assert got.cpu().tolist() == want.tolist()


def test_none_and_out_buffer() -> None:
    logits = make_logits(5, 60, "normal", seed=0).to(DEVICE)
    out = torch.zeros(60, dtype=torch.bool, device=DEVICE)
    assert select_keep_mask(logits, PrunerConfig(), top_k=2, out=out) is out and bool(out.all())
    cfg = PrunerConfig(policy="oea", k0=1)
    result = select_keep_mask(logits, cfg, top_k=2, out=out, workspace=SelectionWorkspace(60, DEVICE))
    assert result is out
    assert out.cpu().tolist() == select_experts_mask(logits.cpu(), cfg, top_k=2).tolist()
    with pytest.raises(ValueError, match="out must be a bool tensor"):
        select_keep_mask(logits, cfg, top_k=2, out=torch.zeros(60, device=DEVICE))
    with pytest.raises(ValueError, match="workspace is for E=64"):
        select_keep_mask(logits, cfg, top_k=2, workspace=SelectionWorkspace(64, DEVICE))


def test_fallback_is_logged_once_and_correct(caplog) -> None:
    selection_module._reported.clear()
    cfg = PrunerConfig(policy="xshare", k0=1, budget=3)
    logits = make_logits(6, 600, "normal", seed=2)  # E > 512: outside the kernels
    with caplog.at_level(logging.WARNING, logger="xshare_sglang.kernels.selection"):
        first = select_keep_mask(logits.to(DEVICE), cfg, top_k=4)
        second = select_keep_mask(logits.to(DEVICE), cfg, top_k=4)
    messages = [r.getMessage() for r in caplog.records if "torch reference" in r.getMessage()]
    assert messages == ["moe-pruner selection uses the torch reference: E=600 experts (the kernels support up to 512)"]
    want = select_experts_mask(logits, cfg, top_k=4)
    assert first.cpu().tolist() == want.tolist() and second.cpu().tolist() == want.tolist()


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 255, 4097, 8192])
@pytest.mark.parametrize("num_experts", [60, 128, 384])
@pytest.mark.parametrize("tokens_per_request", [1, 3, 64])
def test_launch_plan_covers_every_row_once(spec, num_tokens, num_experts, tokens_per_request) -> None:
    plan = plan_launch(num_tokens, num_experts, tokens_per_request, spec)
    assert 1 <= plan.num_parts <= 64
    assert plan.block_experts >= num_experts and plan.block_experts & (plan.block_experts - 1) == 0
    rows = plan.rows_per_request * plan.requests_per_program
    assert plan.num_parts * rows >= num_tokens  # every row is some program's
    assert (plan.num_parts - 1) * rows < max(num_tokens, 1)  # and no program is idle
    if spec:
        assert plan.rows_per_request == tokens_per_request  # requests never straddle programs


@pytest.mark.parametrize(
    ("dtype", "bias_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
)
@pytest.mark.parametrize(("num_tokens", "num_experts"), [(0, 60), (1, 64), (33, 160), (17, 384)])
def test_apply_matches_reference(dtype, bias_dtype, num_tokens, num_experts) -> None:
    gen = torch.Generator().manual_seed(num_tokens + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(dtype)
    keep = torch.rand(num_experts, generator=gen) < 0.3
    bias = torch.randn(num_experts, generator=gen).to(bias_dtype)
    want, want_bias = mask_router_inputs(logits, keep, bias=bias)
    got, got_bias = apply_keep_mask(logits.to(DEVICE), keep.to(DEVICE), bias=bias.to(DEVICE))
    assert torch.equal(got.cpu(), want) and torch.equal(got_bias.cpu(), want_bias)
    assert (want[:, ~keep] == MASKED_LOGIT).all() and torch.equal(want[:, keep], logits[:, keep])
    # in place, into the inputs themselves
    inplace, inplace_bias = logits.to(DEVICE), bias.to(DEVICE)
    apply_keep_mask(inplace, keep.to(DEVICE), bias=inplace_bias, out=inplace, bias_out=inplace_bias)
    assert torch.equal(inplace.cpu(), want) and torch.equal(inplace_bias.cpu(), want_bias)


@pytest.mark.parametrize("policy", POLICIES)
def test_stats_out_matches_reference(policy: str) -> None:
    """stats_out holds (aggregate of kept experts, aggregate of all experts) as the reference computes."""
    from xshare_sglang.policies.api import select_with_aggregate

    case = _random_case(policy, 40, 64, seed=21)
    case["num_valid"] = 33
    logits = make_logits(40, 64, "normal", seed=8)
    kwargs = dict(
        top_k=case["top_k"],
        tokens_per_request=case["tokens_per_request"],
        expert_to_rank=case["expert_to_rank"],
        scoring=case["scoring"],
        num_valid_tokens=33,
    )
    keep, aggregate = select_with_aggregate(logits, case["cfg"], **kwargs)
    stats = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    kwargs["expert_to_rank"] = kwargs["expert_to_rank"].to(DEVICE)
    got = select_keep_mask(logits.to(DEVICE), case["cfg"], stats_out=stats, **kwargs)
    assert got.cpu().tolist() == keep.tolist()
    assert stats.cpu().tolist() == [int(aggregate[keep].sum()), int(aggregate.sum())]
    assert stats[1] > 0 and 0 <= stats[0] <= stats[1]


def _vote_weights(num_tokens: int, seed: int) -> torch.Tensor:
    """Weights of every kind the selection must handle: 1, 0 (never accepted), powers of a decay,
    arbitrary values in (0, 1), and out-of-range values (NaN and < 0 count as 0, > 1 as 1)."""
    g = torch.Generator().manual_seed(seed)
    kinds = torch.randint(0, 6, (num_tokens,), generator=g)
    depth_decay = 0.5 ** torch.randint(0, 8, (num_tokens,), generator=g).float()
    choices = torch.stack(
        [
            torch.ones(num_tokens),
            torch.zeros(num_tokens),
            depth_decay,
            torch.rand(num_tokens, generator=g),
            torch.full((num_tokens,), float("nan")),
            torch.randn(num_tokens, generator=g) * 3,
        ],
        dim=1,
    )
    return choices.gather(1, kinds[:, None])[:, 0]


VOTE_CASES = [(policy, "batch") for policy in POLICIES] + [("moe-spec", "request")]


@pytest.mark.parametrize(("policy", "scope"), VOTE_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize(("num_tokens", "num_experts"), [(0, 60), (1, 64), (7, 160), (255, 128), (33, 256), (4097, 64)])
def test_kernel_vote_weights_and_request_scope(policy, scope, num_tokens, num_experts) -> None:
    """Speculative verify: weighted votes (and moe-spec's per-request budgets) agree exactly with the
    reference, masks and the (kept, total) aggregate both."""
    from xshare_sglang.policies.api import select_with_aggregate

    seed = num_tokens * 31 + num_experts
    case = _random_case(policy, num_tokens, num_experts, seed)
    cfg = case["cfg"]
    if policy == "moe-spec":
        cfg = dataclasses.replace(cfg, scope=scope)
    weights = _vote_weights(num_tokens, seed)
    num_valid = max(0, num_tokens - 3)
    kwargs = dict(
        top_k=case["top_k"],
        tokens_per_request=case["tokens_per_request"],
        expert_to_rank=case["expert_to_rank"],
        scoring=case["scoring"],
        num_valid_tokens=num_valid,
    )
    logits = make_logits(num_tokens, num_experts, case["style"], seed)
    keep, aggregate = select_with_aggregate(logits, cfg, token_weights=weights, **kwargs)
    kwargs["expert_to_rank"] = kwargs["expert_to_rank"].to(DEVICE)
    kwargs["num_valid_tokens"] = torch.tensor([num_valid], device=DEVICE)
    stats = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    got = select_keep_mask(logits.to(DEVICE), cfg, token_weights=weights.to(DEVICE), stats_out=stats, **kwargs)
    assert got.cpu().tolist() == keep.tolist(), f"{cfg.summary()} case={case}"
    if policy != "lynx":
        assert stats.cpu().tolist() == [int(aggregate[keep].sum()), int(aggregate.sum())]
