"""The fused selection kernels against the torch reference: ids and masks exactly, weights within a
stated tolerance, metrics exactly.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py); on a GPU natively.  Inputs come
from fixed seeds: every policy on every token count T in {0, 1, 7, 64, 255, 4097} and expert count E
in {60, 64, 128, 160, 256}, top_k in {1, 2, 4, 8}, softmax / sigmoid / grouped / biased routing,
odd shapes, T = 0, every token padded, NaN/inf rows, ties, and all three input dtypes.

A T=4097 call takes the interpreter 10-60 s, so on CPU each T=4097 case runs at 65 rows (257 where
LYNX's order needs base-n digits) with the plan's T-dependent limits lowered (``SMALL_LIMITS``): the
same kernels and constexprs over several programs of several tiles with a partial last one, as at 4097
(``test_small_calls_take_the_paths_of_4097_rows`` checks each case); a GPU runs T=4097 itself, and one
interpreted call of 4097 rows keeps the production limits.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import logging
import math
import random

import pytest
import torch
import triton
import triton.language as tl

from tests.strategies import make_logits, routing_call
from xshare_sglang import PrunerConfig, select_experts_mask
from xshare_sglang.kernels import (
    SelectionWorkspace,
    jit,
    plan_for,
    plan_launch,
    prune_route,
    select_keep_mask,
)
from xshare_sglang.kernels.bundles import flat_constexprs
from xshare_sglang.kernels.jit import numerics
from xshare_sglang.kernels.plan import (
    COVERAGE_SPLIT_ROWS,
    MAX_TILE_ROWS,
    PRODUCTION_LIMITS,
    TILE_ELEMENTS,
    LaunchPlan,
    PlanLimits,
    set_rule,
)
from xshare_sglang.policies.api import select
from xshare_sglang.policies.call import RouterSpec
from xshare_sglang.policies.prune_route import prune_route as prune_route_reference
from xshare_sglang.policies.rewrite import selection_metrics
from xshare_sglang.policies.scores import exp32, sigmoid32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POLICIES = ["oea", "xshare", "xshare-threshold", "xshare-spec", "xshare-ep", "moe-spec", "lynx"]
STYLES = ["normal", "integers", "nonfinite", "repeated_rows", "few_finite"]
TOKEN_COUNTS = [0, 1, 7, 64, 255, 4097]
EXPERT_COUNTS = [60, 64, 128, 160, 256]
TOP_KS = [1, 2, 4, 8]
ROUTINGS = ["softmax", "sigmoid", "grouped", "biased"]
#: Routing weights are float32 sums and quotients of float32 exponentials: the kernels' ``exp``
#: (one hardware instruction on a GPU) and torch's differ by a few ulp.
WEIGHT_TOLERANCE = dict(atol=2e-6, rtol=2e-5)
#: The interpreter's stand-in for a T=4097 call (the module docstring): SMALL_T rows, and SMALL_LIMITS
#: split them over at most 4 programs of several tiles (65 = 24 + 24 + 17 rows at E <= 256, as 4097 =
#: 102 x 40 + 17); 65 and 4097 leave the same remainder by 3 and by every power of two up to 64 (tiles,
#: requests of D rows); a co-activation keys' limit of 64 leaves 65 rows without keys, as 4095 leaves 4097.
LARGE_T, SMALL_T = 4097, 65
SMALL_LIMITS = PlanLimits(max_parts=4, max_keyed_coact_tokens=64)


def _lynx_digits(beta: int, voters: int) -> bool:
    """Whether LYNX's batch order over ``voters`` voting rows takes base-n digits (``n ** (beta + 1)``
    from 2**61) rather than one int64 per expert."""
    return (beta + 1) * math.log2(max(voters, 1)) >= 61


def _small_shape(cfg: PrunerConfig) -> tuple[int, PlanLimits]:
    """The rows and limits a T=4097 case of ``cfg`` runs at under the interpreter: SMALL_T rows, or 257
    (= 4097 mod 192, as 65) where LYNX's order of 4097 voters takes base-n digits, which 65 cannot."""
    if cfg.policy == "lynx" and _lynx_digits(cfg.beta, LARGE_T):
        return 257, SMALL_LIMITS
    return SMALL_T, SMALL_LIMITS


def _interpreted(num_tokens: int, cfg: PrunerConfig, small: bool = DEVICE == "cpu") -> tuple[int, PlanLimits]:
    """The rows and limits a case of ``num_tokens`` runs at: :func:`_small_shape` for T=4097 when
    ``small`` (under the interpreter), else ``num_tokens`` under the production limits."""
    return _small_shape(cfg) if small and num_tokens == LARGE_T else (num_tokens, PRODUCTION_LIMITS)


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


def _router(routing: str, top_k: int, num_experts: int, seed: int) -> tuple[RouterSpec, torch.Tensor | None]:
    """A router of the given kind, and its correction bias (biased routing only)."""
    rng = random.Random(seed)
    groups = 4 if num_experts % 8 else 8
    topk_group = max(2, -(-top_k // (num_experts // groups)))
    if routing == "softmax":
        return RouterSpec(top_k, "softmax", renormalize=rng.random() < 0.5), None
    if routing == "sigmoid":
        return RouterSpec(top_k, "sigmoid", renormalize=rng.random() < 0.5), None
    if routing == "grouped":
        return RouterSpec(top_k, "softmax", True, groups, topk_group), None
    bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(seed)) * 0.5
    return RouterSpec(top_k, "sigmoid", True, groups, topk_group, 2.5), bias


def _coverage_cases() -> list[tuple]:
    """Every policy on every (T, E); top_k and routing cycle so every value meets every policy."""
    cases = []
    shapes = list(itertools.product(TOKEN_COUNTS, EXPERT_COUNTS))
    for p, policy in enumerate(POLICIES):
        for i, (num_tokens, num_experts) in enumerate(shapes):
            if num_tokens == LARGE_T and num_experts != [64, 160][p % 2]:
                continue  # one E per policy at T=4097
            top_k = TOP_KS[(i + p) % len(TOP_KS)]
            routing = ROUTINGS[(i // len(TOP_KS) + p) % len(ROUTINGS)]
            cases.append((policy, num_tokens, num_experts, top_k, routing))
    return cases


def _compare_routing(
    logits, cfg, router, *, bias=None, as_tensor=True, fill_dropped=False, limits=PRODUCTION_LIMITS, **fields
) -> None:
    """Kernel against reference: keep and ids exactly, weights within tolerance, metrics exactly."""
    want_metrics = torch.zeros(4, dtype=torch.int64)
    want = prune_route_reference(
        routing_call(logits, router, correction_bias=bias, **fields),
        cfg,
        fill_dropped=fill_dropped,
        metrics_row=want_metrics,
    )
    metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    got = prune_route(
        routing_call(logits, router, device=DEVICE, correction_bias=bias, as_tensor=as_tensor, **fields),
        cfg,
        fill_dropped=fill_dropped,
        metrics_row=metrics,
        limits=limits,
    )
    label = f"{cfg.summary()} {router} T={logits.shape[0]} E={logits.shape[1]} {fields.get('tokens_per_request')}"
    assert got.keep.cpu().tolist() == want.keep.tolist(), label
    assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label
    torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, **WEIGHT_TOLERANCE, msg=label)
    assert metrics.cpu().tolist() == want_metrics.tolist(), label


def _prune_route_inputs(policy, num_tokens, num_experts, top_k, routing, small: bool = DEVICE == "cpu") -> dict:
    """A case of :func:`test_prune_route_matches_reference`: logits, cfg and router, and the keyword
    arguments of :func:`_compare_routing` (the limits among them); drawn from the seed of
    ``num_tokens``, on the rows :func:`_interpreted` gives."""
    seed = num_tokens * 7 + num_experts * 13 + top_k
    rows, limits = _interpreted(num_tokens, _random_case(policy, num_tokens, num_experts, seed)["cfg"], small)
    case = _random_case(policy, rows, num_experts, seed)  # the same draws; the real-token count relative to rows
    router, bias = _router(routing, top_k, num_experts, seed)
    cfg = dataclasses.replace(
        case["cfg"], k0=min(case["cfg"].k0, top_k), coverage=random.Random(seed).choice(["substitution", "truncation"])
    )
    return dict(
        logits=make_logits(rows, num_experts, case["style"] if num_tokens < LARGE_T else "normal", seed),
        cfg=cfg,
        router=router,
        bias=bias,
        as_tensor=seed % 2 == 0,
        tokens_per_request=min(case["tokens_per_request"], 64),
        num_valid_tokens=case["num_valid"],
        expert_to_rank=case["expert_to_rank"],
        fill_dropped=seed % 3 == 0,
        limits=limits,
    )


@pytest.mark.fused_selection
@pytest.mark.parametrize(("policy", "num_tokens", "num_experts", "top_k", "routing"), _coverage_cases())
def test_prune_route_matches_reference(policy, num_tokens, num_experts, top_k, routing) -> None:
    _compare_routing(**_prune_route_inputs(policy, num_tokens, num_experts, top_k, routing))


@pytest.mark.fused_selection
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("num_tokens", "num_experts"), [(0, 60), (7, 160), (64, 128), (255, 64)])
def test_select_keep_mask_matches_reference(policy: str, num_tokens: int, num_experts: int) -> None:
    """The keep-only launch (the masked path) agrees with the reference, stats included."""
    case = _random_case(policy, num_tokens, num_experts, num_tokens + num_experts)
    fields = dict(
        tokens_per_request=case["tokens_per_request"],
        scoring=case["scoring"],
        num_valid_tokens=case["num_valid"],
        expert_to_rank=case["expert_to_rank"],
    )
    logits = make_logits(num_tokens, num_experts, case["style"], num_tokens)
    keep, aggregate = select(routing_call(logits, case["top_k"], **fields), case["cfg"])
    stats = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    metrics = torch.full((4,), 3, dtype=torch.int64, device=DEVICE)  # added to, never overwritten
    got = select_keep_mask(
        routing_call(logits, case["top_k"], device=DEVICE, **fields), case["cfg"], stats_out=stats, metrics_row=metrics
    )
    assert got.cpu().tolist() == keep.tolist(), case
    assert stats.cpu().tolist() == [int(aggregate[keep].sum()), int(aggregate.sum())]
    # kept experts, retained mass and one call; the activated experts are the routing's to add
    want = selection_metrics(keep, aggregate[keep].sum(), aggregate.sum()) + 3
    assert metrics.cpu().tolist() == want.tolist(), case
    assert want[0] == 3 and want[1] == int(keep.sum()) + 3 and want[3] == 4


@pytest.mark.fused_selection
@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    # ids and masks are compared exactly (both paths read the logits cast to float32); the weights
    # with WEIGHT_TOLERANCE, whatever the input dtype
    [(torch.float32, WEIGHT_TOLERANCE), (torch.bfloat16, WEIGHT_TOLERANCE), (torch.float16, WEIGHT_TOLERANCE)],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_kernel_dtypes(dtype: torch.dtype, tolerance: dict, policy: str) -> None:
    case = _random_case(policy, 24, 64, seed=11)
    logits = make_logits(24, 64, "normal", seed=3).to(dtype)
    router = RouterSpec(case["top_k"], case["scoring"])
    fields = dict(num_valid_tokens=20, expert_to_rank=case["expert_to_rank"])
    want = prune_route_reference(routing_call(logits, router, **fields), case["cfg"])
    got = prune_route(routing_call(logits, router, device=DEVICE, as_tensor=True, **fields), case["cfg"])
    assert got.keep.cpu().tolist() == want.keep.tolist()
    assert torch.equal(got.topk_ids.cpu(), want.topk_ids)
    torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, **tolerance)


def _sixteen_bit_cases() -> list[tuple]:
    """Both 16-bit dtypes on every logits style and router; policy, T and E cycle through the grid."""
    cases = []
    grid = itertools.product([torch.bfloat16, torch.float16], STYLES, ROUTINGS)
    for i, (dtype, style, routing) in enumerate(grid):
        cases.append((dtype, style, routing, POLICIES[i % len(POLICIES)], [1, 7, 64][i % 3], [60, 128, 256][i % 3]))
    return cases


@pytest.mark.fused_selection
@pytest.mark.parametrize(("dtype", "style", "routing", "policy", "num_tokens", "num_experts"), _sixteen_bit_cases())
def test_sixteen_bit_logits_rank_with_int32_keys_exactly(
    dtype, style, routing, policy, num_tokens, num_experts
) -> None:
    """bfloat16 and float16 logits are ranked with int32 keys (kernels/jit/keys.pack_key): masks
    and ids equal the reference's on ties, infinities, NaN and every router."""
    seed = num_tokens * 7 + num_experts
    case = _random_case(policy, num_tokens, num_experts, seed)
    router, bias = _router(routing, case["top_k"], num_experts, seed)
    logits = make_logits(num_tokens, num_experts, style, seed).to(dtype)
    fields = dict(
        num_valid_tokens=case["num_valid"],
        tokens_per_request=case["tokens_per_request"],
        expert_to_rank=case["expert_to_rank"],
    )
    _compare_routing(logits, case["cfg"], router, bias=bias, **fields)


@pytest.mark.fused_selection
@pytest.mark.parametrize(("dtype", "largest"), [(torch.bfloat16, 3.3895313892515355e38), (torch.float16, 65504.0)])
@pytest.mark.parametrize("routing", ["softmax", "grouped"])
def test_infinity_outranks_the_largest_16_bit_value(dtype, largest, routing) -> None:
    """+inf is read as float32's largest value, which a 16-bit key cannot hold: it must still rank
    above the dtype's own largest finite value (and ties among equal values go to the lower index)."""
    row = torch.full((1, 64), -3.0)
    row[0, [5, 9, 40]] = largest
    row[0, 30] = float("inf")
    row[0, 50] = -largest
    logits = torch.cat([row, row.flip(1)]).to(dtype)
    router, _ = _router(routing, 2, 64, seed=0)
    for cfg in (PrunerConfig(policy="oea", k0=2), PrunerConfig(policy="xshare", k0=1, budget=1)):
        _compare_routing(logits, cfg, router)
    ids = prune_route(routing_call(logits, router, device=DEVICE), PrunerConfig()).topk_ids.cpu()
    assert ids[0].tolist() == [30, 5] and ids[1].tolist() == [33, 23]


@triton.jit
def _exp_probe(x_ptr, exp_ptr, sig_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0)
    tl.store(exp_ptr + i, numerics.exp32(x), mask=i < n)
    tl.store(sig_ptr + i, numerics.sigmoid32(x), mask=i < n)


@pytest.mark.fused_selection
def test_exp32_kernel_is_bit_identical() -> None:
    """The kernels' exp32 and sigmoid32 give the reference's bits (the fixed-point scores rest on it)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=gen) * 30, torch.linspace(-90, 90, 5001), torch.tensor([0.0, -0.0])])
    x = x.to(DEVICE)
    got_exp, got_sig = torch.empty_like(x), torch.empty_like(x)
    _exp_probe[(-(-x.numel() // 1024),)](x, got_exp, got_sig, x.numel(), BLOCK=1024, enable_fp_fusion=False)
    assert torch.equal(got_exp.view(torch.int32), exp32(x).view(torch.int32))
    assert torch.equal(got_sig.view(torch.int32), sigmoid32(x).view(torch.int32))


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


@pytest.mark.fused_selection
@pytest.mark.parametrize(("logits", "cfg", "top_k", "expected"), EDGE_CASES)
def test_kernel_edge_cases(logits, cfg, top_k, expected) -> None:
    assert select_experts_mask(logits, cfg, top_k=top_k).tolist() == expected
    assert select_keep_mask(routing_call(logits, top_k, device=DEVICE), cfg).cpu().tolist() == expected


def test_fallback_is_logged_once_and_correct(caplog) -> None:
    importlib.import_module("xshare_sglang.kernels.launch")._reported.clear()
    cfg = PrunerConfig(policy="xshare", k0=1, budget=3)
    logits = make_logits(6, 600, "normal", seed=2)  # E > 512: outside the kernels
    with caplog.at_level(logging.WARNING, logger="xshare_sglang.kernels.launch"):
        first = select_keep_mask(routing_call(logits, 4, device=DEVICE), cfg)
        second = prune_route(routing_call(logits, 4, device=DEVICE), cfg)
    messages = [r.getMessage() for r in caplog.records if "torch reference" in r.getMessage()]
    assert messages == ["moe-pruner selection uses the torch reference: E=600 experts (the kernels support up to 512)"]
    want = select_experts_mask(logits, cfg, top_k=4)
    assert first.cpu().tolist() == want.tolist() and second.keep.cpu().tolist() == want.tolist()
    assert torch.equal(second.topk_ids.cpu(), prune_route_reference(routing_call(logits, 4), cfg).topk_ids)


@pytest.mark.parametrize("limits", [PRODUCTION_LIMITS, SMALL_LIMITS], ids=["production", "small"])
@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 32, 33, 64, 65, 255, 4097, 8192])
@pytest.mark.parametrize("num_experts", [60, 128, 384])
@pytest.mark.parametrize("tokens_per_request", [1, 3, 64])
def test_launch_plan_covers_every_row_once(spec, num_tokens, num_experts, tokens_per_request, limits) -> None:
    plan = plan_launch(num_tokens, num_experts, tokens_per_request, spec, limits=limits)
    assert 1 <= plan.num_parts <= limits.max_parts
    assert plan.block_experts >= num_experts and plan.block_experts & (plan.block_experts - 1) == 0
    assert plan.num_parts * plan.rows_per_program >= num_tokens  # every row is some program's
    assert (plan.num_parts - 1) * plan.rows_per_program < max(num_tokens, 1)  # and no program is idle
    assert plan.rows_per_program % plan.rows_per_request == 0
    if spec:
        assert plan.rows_per_request == tokens_per_request  # requests never straddle programs
    # one launch (selection and routing in one program) exactly when the call is one tile of rows, or one
    # request of a per-request policy; then the tile is no taller than the call
    base_tile = max(1, min(MAX_TILE_ROWS, TILE_ELEMENTS // plan.block_experts))
    assert plan.single == (num_tokens <= (tokens_per_request if spec else base_tile)), plan
    if plan.single:
        assert plan.route_programs == 0 and plan.route_rows <= max(1, 2 * num_tokens - 1)
    if spec:
        # a request is read in power-of-two tiles of at most D rows, rounded up
        assert plan.chunk_rows <= 1 << max(0, (tokens_per_request - 1).bit_length())
    else:
        assert plan.chunk_rows == plan.route_rows
    if not plan.single:
        assert plan.route_programs * plan.route_rows >= num_tokens > (plan.route_programs - 1) * plan.route_rows


def test_none_and_out_buffers() -> None:
    logits = make_logits(5, 60, "normal", seed=0).to(DEVICE)
    call = routing_call(logits, 2)
    out = torch.zeros(60, dtype=torch.bool, device=DEVICE)
    assert select_keep_mask(call, PrunerConfig(), out=out) is out and bool(out.all())
    cfg = PrunerConfig(policy="oea", k0=1)
    result = select_keep_mask(call, cfg, out=out, workspace=SelectionWorkspace(60, DEVICE))
    assert result is out
    assert out.cpu().tolist() == select_experts_mask(logits.cpu(), cfg, top_k=2).tolist()
    ids = torch.full((5, 2), 7, dtype=torch.int32, device=DEVICE)
    weights = torch.full((5, 2), 7.0, device=DEVICE)
    routed = prune_route(call, cfg, keep_out=out, ids_out=ids, weights_out=weights)
    assert routed.keep is out and routed.topk_ids is ids and routed.topk_weights is weights
    assert torch.equal(ids.cpu(), prune_route_reference(routing_call(logits.cpu(), 2), cfg).topk_ids)
    with pytest.raises(ValueError, match="out must be a bool tensor"):
        select_keep_mask(call, cfg, out=torch.zeros(60, device=DEVICE))
    with pytest.raises(ValueError, match="workspace is for E=64"):
        select_keep_mask(call, cfg, workspace=SelectionWorkspace(64, DEVICE))
    with pytest.raises(ValueError, match=r"metrics_row must be a torch.int64 tensor of shape \(4,\)"):
        select_keep_mask(call, cfg, metrics_row=torch.zeros(4, dtype=torch.int32, device=DEVICE))
    metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    assert bool(select_keep_mask(call, PrunerConfig(), metrics_row=metrics).all())  # none: every expert
    assert metrics.cpu().tolist() == [0, 60, 1 << 24, 1]
    with pytest.raises(ValueError, match=r"ids_out must be a torch.int32 tensor of shape \(5, 2\)"):
        prune_route(call, cfg, ids_out=torch.zeros(5, 3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="correction bias needs scoring='sigmoid'"):
        routing_call(logits, 2, correction_bias=torch.zeros(60, device=DEVICE))
    with pytest.raises(ValueError, match="num_expert_group=8 does not divide the 60 experts"):
        routing_call(logits, RouterSpec(2, num_expert_group=8, topk_group=2))
    with pytest.raises(ValueError, match="policy 'xshare-ep' needs expert_to_rank"):
        prune_route(call, PrunerConfig(policy="xshare-ep", k0=1))


@pytest.mark.fused_selection
@pytest.mark.parametrize("num_tokens", [0, 1, 7, 64, 255])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_none_routes_like_the_reference_at_every_size(num_tokens: int, routing: str) -> None:
    """Policy none above one tile is the routing kernel alone (no selection launch, no counter fill
    without metrics): the mask is full, ids, weights and metrics are the reference's, and a stale
    keep buffer is overwritten."""
    router, bias = _router(routing, 4, 128, seed=num_tokens)
    logits = make_logits(num_tokens, 128, "nonfinite" if num_tokens % 2 else "normal", seed=num_tokens)
    for num_valid in (num_tokens, max(0, num_tokens - 3)):
        _compare_routing(logits, PrunerConfig(), router, bias=bias, num_valid_tokens=num_valid)
        keep = torch.zeros(128, dtype=torch.bool, device=DEVICE)
        call = routing_call(logits, router, device=DEVICE, correction_bias=bias, num_valid_tokens=num_valid)
        assert bool(prune_route(call, PrunerConfig(), keep_out=keep).keep.all())


@pytest.mark.fused_selection
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize(
    ("num_experts", "routing", "policy"),
    [
        (384, "biased", "none"),  # Kimi-K2's shape: 384 experts, sigmoid + correction bias
        (384, "biased", "xshare"),
        (384, "sigmoid", "moe-spec"),
        (512, "softmax", "xshare"),
        (512, "grouped", "oea"),
    ],
)
def test_rows_wider_than_one_warp_route_like_the_reference(num_tokens, num_experts, routing, policy) -> None:
    """Above 256 experts a routed row spans several warps (``route_warps``), so each pick is a
    block-wide maximum and a biased pick's weight is taken with it, not in one warp."""
    router, bias = _router(routing, 8, num_experts, seed=num_experts + num_tokens)
    logits = make_logits(num_tokens, num_experts, "normal", seed=num_tokens)
    cfg = {
        "none": PrunerConfig(),
        "xshare": PrunerConfig(policy="xshare", k0=2, budget=24),
        "moe-spec": PrunerConfig(policy="moe-spec", max_experts=24),
        "oea": PrunerConfig(policy="oea", k0=2),
    }[policy]
    _compare_routing(logits, cfg, router, bias=bias, num_valid_tokens=num_tokens)


@pytest.mark.fused_selection
@pytest.mark.parametrize("num_experts", [64, 256])
def test_a_biased_group_with_a_tied_best_scores_it_twice(num_experts) -> None:
    """Biased grouped routing ranks a group by the sum of its two best values; when the best value
    is held by two experts, the second best is that same value."""
    size = num_experts // 8
    logits = torch.full((2, num_experts), -4.0)
    logits[:, 1 * size + 3] = logits[:, 1 * size + 5] = 2.0  # group 1: the best value twice
    logits[:, 5 * size] = 2.5  # group 5: a better best, a poor second
    logits[1, 1 * size + 5] = -4.0  # row 1: no tie, so group 5 wins
    router = RouterSpec(2, "sigmoid", True, 8, 1, 2.5)
    bias = torch.zeros(num_experts)
    _compare_routing(logits, PrunerConfig(), router, bias=bias, num_valid_tokens=2)
    got = prune_route(routing_call(logits, router, device=DEVICE, correction_bias=bias), PrunerConfig())
    assert got.topk_ids.cpu().tolist() == [[1 * size + 3, 1 * size + 5], [5 * size, 5 * size + 1]]


GROUP_WARP_ROUTERS = {
    "deepseek-v3": (256, RouterSpec(8, "sigmoid", True, 8, 4, 2.5)),
    "8x32-top2-unscaled": (256, RouterSpec(2, "sigmoid", False, 8, 1)),
    "8x32-every-group": (256, RouterSpec(8, "sigmoid", True, 8, 8, 2.5)),
    "4x32": (128, RouterSpec(8, "sigmoid", True, 4, 2, 2.5)),
    "2x32-top1": (64, RouterSpec(1, "sigmoid", True, 2, 1)),
}


@pytest.mark.fused_selection
@pytest.mark.parametrize(
    ("shape", "num_tokens"),
    [(shape, 1) for shape in GROUP_WARP_ROUTERS]
    + [(shape, num_tokens) for shape in ("deepseek-v3", "2x32-top1") for num_tokens in (9, 17)]
    + [("deepseek-v3", 5), ("4x32", 2)],  # none and static moe-spec of 2-8 rows: the routing kernel
)
def test_biased_groups_route_like_the_reference_on_a_warp_per_group(shape, num_tokens, tmp_path):
    """A row of biased routing in groups of 32 experts routes with a warp per group (each group's
    picks in its warp, the row's among them in every warp), in a one-row call and in the routing
    kernel above one program (a program per row), while the other rules' rows of a one-program call
    route on the tile's warps: keep, ids, weights and metrics (the activated experts counted over
    every program) equal the reference's, with ties, non-finite logits, fewer candidates than top_k,
    padding and rows of vote weight 0."""
    num_experts, router = GROUP_WARP_ROUTERS[shape]
    bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(num_experts)) * 0.5
    configs = [
        PrunerConfig(),
        PrunerConfig(policy="xshare", k0=1, budget=num_experts // 8),
        PrunerConfig(policy="oea", k0=1),
        PrunerConfig(policy="moe-spec", max_experts=12),
        _static_ranking(tmp_path, num_experts, 12),  # 2 to 8 rows: the routing kernel alone, as none
    ]
    styles = ("normal", "integers", "nonfinite", "few_finite") if num_tokens == 1 else ("normal", "few_finite")
    for seed, style in enumerate(styles):
        logits = make_logits(num_tokens, num_experts, style, seed=seed)
        num_valid = max(0, num_tokens - 3) if seed % 2 else num_tokens
        for cfg in configs:
            _compare_routing(logits, cfg, router, bias=bias, num_valid_tokens=num_valid, layer_id=1)
    weights = torch.rand(num_tokens, generator=torch.Generator().manual_seed(num_tokens))
    weights[::2] = 0.0
    for cfg in (*configs[:2], configs[-1]):
        _compare_routing(logits, cfg, router, bias=bias, num_valid_tokens=num_tokens, token_weights=weights, layer_id=2)


def _fields(constexprs: dict) -> dict:
    """A launch's constexprs with its bundles' fields by their own names (``FINISH.GATED`` as ``GATED``)."""
    return {name.rsplit(".", 1)[-1]: value for name, value in flat_constexprs(constexprs).items()}


def _launch_grids(num_tokens, num_experts, cfg, **kwargs) -> dict[str, tuple]:
    """``{kernel: (grid, num_warps, GROUP_WARPS)}`` of one call's launches, captured without launching."""
    from xshare_sglang.bench.kernel_compile import capture_launches

    router, bias = _router("biased", 8, num_experts, seed=num_tokens)
    logits = make_logits(num_tokens, num_experts, "normal", seed=num_tokens)
    call = routing_call(logits, router, as_tensor=True, correction_bias=bias, num_valid_tokens=num_tokens, layer_id=1)
    launches = capture_launches(call, cfg, metrics_row=torch.zeros(4, dtype=torch.int64), **kwargs)
    return {
        name: (tuple(grid), kw["num_warps"], kw["ROUTER"] is not None and kw["ROUTER"].GROUP_WARPS)
        for name, (grid, _, kw) in launches.items()
    }


@pytest.mark.fused_selection
def test_rows_of_biased_groups_of_32_take_a_warp_per_group_where_planned(tmp_path) -> None:
    """Which launches route with a warp per group (``group_warp_routing``): a one-row call of biased
    groups of 32 experts, whatever the policy, the routing kernel above one program up to 256 rows
    (a program per row), and 2 to 8 rows of ``none`` and static moe-spec; not a one-program call of
    several rows of another rule, truncation, filled slots, groups of another size, another top-k
    or no bias."""
    plan_module = importlib.import_module("xshare_sglang.kernels.plan")
    oea = PrunerConfig(policy="oea", k0=1)
    assert _launch_warps(1, 256, PrunerConfig()) == {"select_kernel": 8}
    assert _launch_warps(1, 256, oea) == {"select_kernel": 8}
    assert _launch_grids(1, 256, oea)["select_kernel"] == ((1,), 8, True)
    # none and static moe-spec of 2 to 8 rows: the routing kernel, a program per row (a rule's rows: one
    # program); static moe-spec without the routing's sums of the mass keeps its program
    assert _launch_grids(2, 256, PrunerConfig()) == {"route_kernel": ((2,), 8, True)}
    assert _launch_grids(8, 256, PrunerConfig()) == {"route_kernel": ((8,), 8, True)}
    static = _static_ranking(tmp_path, 256)
    assert _launch_grids(2, 256, static) == {"route_kernel": ((2,), 8, True)}
    assert _launch_grids(8, 256, static) == {"route_kernel": ((8,), 8, True)}
    # the metrics row's mass from the selection (the other side of the open switch)
    assert _launch_grids(8, 256, static, routing_sums_mass=False) == {"select_kernel": ((1,), 8, False)}
    assert _launch_grids(8, 256, oea) == {"select_kernel": ((1,), 8, False)}
    assert _launch_grids(7, 256, oea) == {"select_kernel": ((1,), 8, False)}
    assert _launch_grids(40, 256, PrunerConfig()) == {"route_kernel": ((40,), 8, True)}
    assert _launch_grids(40, 256, oea)["route_kernel"] == ((40,), 8, True)
    # up to GROUP_WARP_MAX_ROWS rows: a program per row; above, tiles of 8 rows on a warp each
    assert _launch_grids(256, 256, PrunerConfig()) == {"route_kernel": ((256,), 8, True)}
    assert _launch_grids(257, 256, PrunerConfig()) == {"route_kernel": ((33,), 8, False)}
    assert _launch_grids(512, 256, oea)["route_kernel"] == ((64,), 8, False)
    assert _launch_grids(40, 256, oea)["select_kernel"][2] is False
    assert _launch_grids(40, 256, PrunerConfig(coverage="truncation"))["route_kernel"] == ((5,), 8, False)
    assert _launch_grids(40, 256, PrunerConfig(), fill_dropped=True)["route_kernel"] == ((5,), 8, False)
    assert _launch_warps(1, 256, PrunerConfig(coverage="truncation")) == {"select_kernel": 1}
    assert _launch_warps(1, 256, PrunerConfig(), fill_dropped=True) == {"select_kernel": 1}
    assert _launch_grids(1, 128, PrunerConfig()) == {"select_kernel": ((1,), 1, False)}  # 8 groups of 16
    assert _launch_grids(40, 128, PrunerConfig()) == {"route_kernel": ((5,), 8, False)}
    split = plan_module.plan_for(PrunerConfig(), 1, 256, 1)

    def group_warps(router: RouterSpec, bias: bool = True) -> int:
        spec = plan_module.CallSpec(1, 256, router, has_bias=bias)
        return plan_module.group_warp_routing(spec, PrunerConfig(), split)

    assert group_warps(RouterSpec(8, "sigmoid", True, 8, 4, 2.5)) == 8
    assert group_warps(RouterSpec(16, "sigmoid", True, 8, 4, 2.5)) == 0
    assert group_warps(RouterSpec(8, "sigmoid", True, 8, 4, 2.5), bias=False) == 0
    # ...not with filled slots: one program, a warp per row
    assert _launch_grids(4, 256, PrunerConfig(), fill_dropped=True) == {"select_kernel": ((1,), 4, False)}


def _kept_count(logits, router, cfg, **fields) -> int:
    keep, _ = select(routing_call(logits, router, **fields), cfg)
    return int(keep.sum())


@pytest.mark.fused_selection
@pytest.mark.parametrize(("num_tokens", "num_experts"), [(3, 64), (3, 256), (40, 128)])
@pytest.mark.parametrize("rule", ["budget", "rank_budget", "max_experts"])
def test_every_candidate_taken_or_ranked_at_the_boundary(num_tokens, num_experts, rule) -> None:
    """The set rules skip the [E, E] order when every candidate is taken anyway: the budget at
    least T x top_k (the most experts top-k scores can reach), the rounds' target not passed, the
    cap not binding.  Budgets one below, at and one above each of those points, and at the number
    of candidates, must keep exactly what the reference keeps."""
    router = RouterSpec(4, "softmax")
    logits = make_logits(num_tokens, num_experts, "normal", seed=num_tokens + num_experts)
    fields = dict(num_valid_tokens=num_tokens, expert_to_rank=torch.zeros(num_experts, dtype=torch.int64))
    warm = _kept_count(logits, router, PrunerConfig(policy="oea", k0=1), **fields)
    everything = _kept_count(logits, router, PrunerConfig(policy="xshare", k0=1, budget=num_experts), **fields)
    candidates = everything - warm
    assert 2 <= candidates < num_experts - warm, "the case must leave experts out of reach"
    if rule == "budget":  # xshare: the best `budget` candidates besides the warm-up set
        reach = num_tokens * 4  # T x top_k
        budgets = (0, candidates - 1, candidates, candidates + 1, reach - 1, reach, reach + 1)
        configs = [PrunerConfig(policy="xshare", k0=1, budget=b) for b in budgets]
        wanted = [warm + min(b, candidates) for b in budgets]
    elif rule == "rank_budget":  # xshare-ep on one rank: rounds until warm + added reaches the target
        configs = [PrunerConfig(policy="xshare-ep", k0=1, rank_budget=everything + d) for d in (-1, 0, 1)]
        wanted = [everything - 1, everything, everything]
    else:  # the cap over xshare's own set
        configs = [
            PrunerConfig(policy="xshare", k0=1, budget=num_experts, max_experts=everything + d) for d in (-1, 0, 1)
        ]
        wanted = [everything - 1, everything, everything]
    for cfg, kept in zip(configs, wanted, strict=True):
        assert _kept_count(logits, router, cfg, **fields) == kept, cfg.summary()
        _compare_routing(logits, cfg, router, **fields)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "budget", "max_experts", "order", "warps"),
    [
        (1, 128, 16, None, False, 1),  # T x top_k = 8 <= 16: every candidate, one warp per row
        (2, 128, 16, None, False, 2),
        (3, 128, 16, None, True, 4),  # 24 > 16: the order may be needed, a tile's four warps
        (1, 128, 16, 20, False, 4),  # a cap keeps its own order: four warps
        (1, 256, 32, None, False, 8),  # E=256 keeps its eight warps (one would hold 8 experts a lane)
        (64, 128, 0, None, False, 4),  # budget 0 above one tile: no order, a tile's warps
        (64, 128, 600, None, True, 4),  # 64 x 8 > 129 (the budget is clamped to E + 1)
    ],
)
def test_a_budget_that_takes_every_candidate_launches_no_order(
    num_tokens, num_experts, budget, max_experts, order, warps
) -> None:
    """The wrapper compiles the greedy budget's [E, E] order out (``ORDER=False``) when top-k scores
    cannot reach more experts than the budget, and then runs a one-program xshare call of at most 128
    experts on one warp per row, as it does ``none``."""
    from xshare_sglang.bench.kernel_compile import capture_launches

    logits = make_logits(num_tokens, num_experts, "normal", seed=num_tokens)
    cfg = PrunerConfig(policy="xshare", k0=1, budget=budget, max_experts=max_experts)
    launches = capture_launches(routing_call(logits, RouterSpec(8, "softmax")), cfg)
    _, _, kwargs = launches["select_kernel"]
    assert (kwargs["RULE_CONFIG"].ORDER, kwargs["num_warps"]) == (order, warps)


def test_moe_spec_static_routing(tmp_path) -> None:
    import json

    num_experts = 160
    counts = [[float((e * 37 + layer * 11) % 17) for e in range(num_experts)] for layer in range(3)]
    path = tmp_path / "ranking.json"
    path.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
    cfg = PrunerConfig(policy="moe-spec", max_experts=20, ranking="static", static_ranking_path=str(path))
    logits = make_logits(40, num_experts, "normal", seed=1)
    for layer in range(3):
        for num_valid in (40, 9, 0):
            _compare_routing(logits, cfg, RouterSpec(4), layer_id=layer, num_valid_tokens=num_valid)


@pytest.mark.fused_selection
@pytest.mark.parametrize("routing_sums_mass", [True, False], ids=["routing_mass", "select_mass"])
@pytest.mark.parametrize("with_metrics", [True, False], ids=["metrics", "no_metrics"])
def test_static_moe_spec_routes_alone_above_one_program(with_metrics, routing_sums_mass, tmp_path):
    """Static moe-spec above one program launches the routing kernel alone: every routing program
    derives the calibrated mask (the token range included), program 0 stores it and adds the kept
    count and the call.  With a metrics row only where the routing sums the retained mass
    (``routing_sums_mass``); otherwise the selection runs first, as before.  Keep, ids, weights and
    metrics equal the reference's for real-token counts inside, above and below the range, and 0;
    the counters are back at 0 after every call."""
    from xshare_sglang.bench.kernel_compile import capture_launches

    num_tokens, num_experts = 40, 64
    cfg = dataclasses.replace(_static_ranking(tmp_path, num_experts, 11), min_tokens=2, max_tokens=30)
    router = RouterSpec(4, "softmax", renormalize=True)
    alone = with_metrics <= routing_sums_mass  # without metrics always; with them, if the routing sums the mass
    workspace = SelectionWorkspace(num_experts, DEVICE)
    logits = make_logits(num_tokens, num_experts, "normal", seed=4)
    for layer, num_valid in ((0, 20), (1, 40), (2, 1), (0, 0)):
        fields = dict(num_valid_tokens=num_valid, layer_id=layer)
        call = routing_call(logits, router, device=DEVICE, as_tensor=True, **fields)
        metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE) if with_metrics else None
        launches = capture_launches(
            call, cfg, metrics_row=None if metrics is None else metrics.cpu(), routing_sums_mass=routing_sums_mass
        )
        assert list(launches) == (["route_kernel"] if alone else ["select_kernel", "route_kernel"]), num_valid
        want_metrics = torch.zeros(4, dtype=torch.int64)
        want = prune_route_reference(routing_call(logits, router, **fields), cfg, metrics_row=want_metrics)
        got = prune_route(call, cfg, workspace=workspace, metrics_row=metrics, routing_sums_mass=routing_sums_mass)
        # the range matters: inside it the 11 calibrated experts are kept, outside it every one
        assert int(want.keep.sum()) == (11 if 2 <= num_valid <= 30 else num_experts), num_valid
        assert got.keep.cpu().tolist() == want.keep.tolist(), num_valid
        assert torch.equal(got.topk_ids.cpu(), want.topk_ids), num_valid
        torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, **WEIGHT_TOLERANCE)
        if with_metrics:
            assert metrics.cpu().tolist() == want_metrics.tolist(), num_valid
        assert not workspace.counters.cpu().any(), num_valid


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
VOTE_SHAPES = [(0, 60), (1, 64), (7, 160), (255, 128), (33, 256), (LARGE_T, 64)]


def _vote_inputs(policy, scope, num_tokens, num_experts, small: bool = DEVICE == "cpu") -> dict:
    """A case of :func:`test_kernel_vote_weights_and_request_scope`: logits, cfg, router, the call's
    fields and the limits, drawn from the seed of ``num_tokens``, on the rows :func:`_interpreted` gives."""
    seed = num_tokens * 31 + num_experts
    rows, limits = _interpreted(num_tokens, _random_case(policy, num_tokens, num_experts, seed)["cfg"], small)
    case = _random_case(policy, rows, num_experts, seed)
    cfg = case["cfg"]
    if policy == "moe-spec":
        cfg = dataclasses.replace(cfg, scope=scope)
    fields = dict(
        tokens_per_request=case["tokens_per_request"],
        expert_to_rank=case["expert_to_rank"],
        num_valid_tokens=max(0, rows - 3),
        token_weights=_vote_weights(rows, seed),
    )
    logits = make_logits(rows, num_experts, case["style"], seed)
    return dict(logits=logits, cfg=cfg, router=RouterSpec(case["top_k"], case["scoring"]), fields=fields, limits=limits)


@pytest.mark.fused_selection
@pytest.mark.parametrize(("policy", "scope"), VOTE_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize(("num_tokens", "num_experts"), VOTE_SHAPES)
def test_kernel_vote_weights_and_request_scope(policy, scope, num_tokens, num_experts) -> None:
    """Speculative verify: weighted votes (and moe-spec's per-request budgets) agree exactly with the
    reference, masks, routing and the (kept, total) aggregate."""
    inputs = _vote_inputs(policy, scope, num_tokens, num_experts)
    logits, cfg, router, fields, limits = (inputs[k] for k in ("logits", "cfg", "router", "fields", "limits"))
    _compare_routing(logits, cfg, router, limits=limits, **fields)
    keep, aggregate = select(routing_call(logits, router, **fields), cfg)
    stats = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    call = routing_call(logits, router, device=DEVICE, as_tensor=True, **fields)
    got = select_keep_mask(call, cfg, stats_out=stats, limits=limits)
    assert got.cpu().tolist() == keep.tolist(), f"{cfg.summary()} T={logits.shape[0]}"
    if policy != "lynx":
        assert stats.cpu().tolist() == [int(aggregate[keep].sum()), int(aggregate.sum())]


@pytest.mark.fused_selection
@pytest.mark.parametrize("policy", ["none", *POLICIES])
def test_one_layer_call_launches_the_planned_kernels(policy, monkeypatch) -> None:
    """Count every Triton launch of one pruned layer call (by wrapping the launcher of the kernel
    class): one for calls of one tile (or one request), two otherwise (lynx: three, its per-row picks
    in a launch of their own; none: one, the routing alone); metrics add none."""
    launches = []
    launcher = type(jit.select_kernel)
    original_run = launcher.run

    def counting_run(self, *args, **kwargs):
        launches.append(self.__name__ if hasattr(self, "__name__") else str(self))
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(launcher, "run", counting_run)
    for num_tokens, tokens_per_request in [(1, 1), (7, 1), (32, 4), (64, 4), (255, 1)]:
        case = _random_case(policy if policy != "none" else "oea", num_tokens, 128, seed=num_tokens)
        cfg = PrunerConfig() if policy == "none" else dataclasses.replace(case["cfg"], max_experts=24)
        router, bias = _router("biased", 8, 128, seed=num_tokens)
        logits = make_logits(num_tokens, 128, "normal", seed=num_tokens).to(DEVICE)
        launches.clear()
        call = routing_call(
            logits,
            router,
            device=DEVICE,
            as_tensor=True,
            correction_bias=bias,
            tokens_per_request=tokens_per_request,
            num_valid_tokens=num_tokens,
            expert_to_rank=case["expert_to_rank"],
        )
        prune_route(call, cfg, metrics_row=torch.zeros(4, dtype=torch.int64, device=DEVICE))
        plan = plan_launch(num_tokens, 128, tokens_per_request, policy == "xshare-spec")
        want = 1 if plan.single else {"none": 1, "lynx": 3}.get(policy, 2)
        assert len(launches) == want, (num_tokens, launches)


def _launch_warps(num_tokens, num_experts, cfg, **kwargs) -> dict[str, int]:
    """``{kernel: num_warps}`` of one call's launches, captured without launching."""
    from xshare_sglang.bench.kernel_compile import capture_launches

    router, bias = _router("biased", 8, num_experts, seed=num_tokens)
    logits = make_logits(num_tokens, num_experts, "normal", seed=num_tokens).to(torch.bfloat16)
    call = routing_call(logits, router, as_tensor=True, correction_bias=bias, num_valid_tokens=num_tokens, layer_id=1)
    launches = capture_launches(call, cfg, metrics_row=torch.zeros(4, dtype=torch.int64), **kwargs)
    return {name: launch_kwargs["num_warps"] for name, (_, _, launch_kwargs) in launches.items()}


def _static_ranking(tmp_path, num_experts: int, max_experts: int = 20, coactivation: bool = False) -> PrunerConfig:
    """Static moe-spec (or, with ``coactivation``, the co-activation ranking) on a calibration file of
    three layers; in the co-activation file experts pair up (always picked together) and the rest
    co-occur partly, so gains fall to zero before the budget is spent."""
    import json

    counts = [[float((e * 37 + layer * 11) % 17) for e in range(num_experts)] for layer in range(3)]
    doc = {"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}
    if coactivation:
        pairs = [
            [[5 if i // 2 == j // 2 else (i * j + layer) % 3 for j in range(num_experts)] for i in range(num_experts)]
            for layer in range(3)
        ]
        doc = doc | {
            "counts": [[float(row[i]) for i, row in enumerate(layer)] for layer in pairs],
            "coactivation": pairs,
        }
    path = tmp_path / f"ranking-{num_experts}-{coactivation}.json"
    path.write_text(json.dumps(doc))
    ranking = "coactivation" if coactivation else "static"
    return PrunerConfig(policy="moe-spec", max_experts=max_experts, ranking=ranking, static_ranking_path=str(path))


def test_one_program_calls_take_a_warp_per_row_where_planned(tmp_path) -> None:
    """On at most 128 experts the light rules (``oea``, static moe-spec, the co-activation ranking,
    xshare whose budget takes every candidate, a top count that ``T x top_k`` fits) run one-program
    calls of up to four rows on one warp per row.  A one-program call of 5 to 8 rows runs any rule on a
    tile's four warps.  A rule with an order or a cap, several programs and E=256 are not concerned."""
    xshare, oea = PrunerConfig(policy="xshare", k0=1, budget=16), PrunerConfig(policy="oea", k0=1)
    static = _static_ranking(tmp_path, 128)
    assert _launch_warps(8, 128, xshare) == {"select_kernel": 4}
    assert _launch_warps(5, 64, oea) == {"select_kernel": 4}
    assert _launch_warps(7, 60, PrunerConfig(policy="moe-spec", max_experts=16)) == {"select_kernel": 4}
    assert _launch_warps(8, 128, PrunerConfig()) == {"select_kernel": 8}  # none: a warp per row
    # light rules up to four rows
    assert _launch_warps(1, 128, oea) == {"select_kernel": 1}
    assert _launch_warps(2, 128, static) == {"select_kernel": 2}
    coact = _static_ranking(tmp_path, 128, coactivation=True)
    assert _launch_warps(1, 128, coact) == {"select_kernel": 1}
    assert _launch_warps(3, 128, oea) == {"select_kernel": 4}  # a tile of 4 rows: four warps, one per row
    assert _launch_warps(1, 128, PrunerConfig(policy="xshare", k0=1, budget=16)) == {"select_kernel": 1}
    # the router ranking's top-count on top-k scores when T x top_k fits it (and the coverage
    # ranking's one row, the same rule): no order, a light rule
    top_count = PrunerConfig(policy="moe-spec", max_experts=16, score="topk")
    assert _launch_warps(1, 128, top_count) == {"select_kernel": 1}
    assert _launch_warps(2, 128, top_count) == {"select_kernel": 2}
    coverage = PrunerConfig(policy="moe-spec", max_experts=16, ranking="coverage")
    assert _launch_warps(1, 128, coverage) == {"select_kernel": 1}
    # an order or a cap: a tile's warps
    assert _launch_warps(4, 128, top_count) == {"select_kernel": 4}
    assert _launch_warps(1, 128, dataclasses.replace(top_count, max_experts=4)) == {"select_kernel": 4}
    assert _launch_warps(1, 128, PrunerConfig(policy="moe-spec", max_experts=16)) == {"select_kernel": 4}  # probs
    assert _launch_warps(1, 128, PrunerConfig(policy="oea", k0=1, max_experts=12)) == {"select_kernel": 4}
    assert _launch_warps(1, 128, PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9)) == {"select_kernel": 4}
    assert _launch_warps(8, 256, xshare) == {"select_kernel": 8}
    assert _launch_warps(1, 256, oea) == {"select_kernel": 8}
    assert _launch_warps(32, 128, xshare) == {"select_kernel": 4, "route_kernel": 8}


@pytest.mark.fused_selection
@pytest.mark.parametrize("routing", ["biased", "softmax"])
@pytest.mark.parametrize("policy", ["oea", "xshare", "xshare-threshold", "xshare-ep", "moe-spec", "lynx"])
def test_one_program_of_seven_rows_matches_the_reference(policy, routing):
    """A one-program call of 7 rows on a tile's four warps (float32 keys and biased rows route through
    separate code): keep, ids, weights and metrics equal the reference's."""
    seed = 70 + len(policy)
    case = _random_case(policy, 7, 128, seed)
    router, bias = _router(routing, 8, 128, seed)
    logits = make_logits(7, 128, "normal", seed)
    assert plan_for(case["cfg"], 7, 128, 1).single
    _compare_routing(logits, case["cfg"], router, bias=bias, num_valid_tokens=7, expert_to_rank=case["expert_to_rank"])


@pytest.mark.fused_selection
@pytest.mark.parametrize("routing", ["biased", "softmax", "grouped"])
@pytest.mark.parametrize(("num_tokens", "num_experts"), [(1, 128), (2, 60), (1, 64)])
@pytest.mark.parametrize("policy", ["oea", "moe-spec-static", "moe-spec-coact", "moe-spec"])
def test_light_rules_of_a_few_rows_match_the_reference_on_a_warp_per_row(
    policy, num_tokens, num_experts, routing, tmp_path
):
    """``oea``, static moe-spec, the co-activation ranking and the router ranking's top-count on one
    warp per row (up to four rows): keep, ids, weights and metrics equal the reference's, padding rows
    and layers included."""
    seed = num_tokens * 31 + num_experts
    router, bias = _router(routing, 6, num_experts, seed)
    cfg = {
        "oea": PrunerConfig(policy="oea", k0=2),
        "moe-spec-static": _static_ranking(tmp_path, num_experts, 9),
        "moe-spec-coact": _static_ranking(tmp_path, num_experts, 12, coactivation=True),
        # the router ranking's top-count on top-k scores, the rest of the count in index order:
        # T x top_k <= 9 compiles no order (T=1); at T=2 the order is compiled, taken with 2 valid
        # rows and skipped with 1 (n_valid x top_k <= 9)
        "moe-spec": PrunerConfig(policy="moe-spec", max_experts=9, score="topk"),
    }[policy]
    logits = make_logits(num_tokens, num_experts, "normal", seed)
    for layer, num_valid in ((0, num_tokens), (2, num_tokens - 1)):
        _compare_routing(logits, cfg, router, bias=bias, layer_id=layer, num_valid_tokens=num_valid)


def test_launch_plan_gives_each_request_its_program_up_to_128() -> None:
    """Up to 128 requests (or 128 tiles of rows) take a program each: at T=512 the per-request
    policies' 128 requests of 4 rows no longer run two to a program, and 1024 rows run one 8-row tile
    per program; past that, programs take several."""
    plan = plan_launch(512, 128, 4, True)
    assert (plan.num_parts, plan.rows_per_program, plan.rows_per_request) == (128, 4, 4)
    plan = plan_launch(1024, 128, 1, False)
    assert (plan.num_parts, plan.rows_per_program, plan.chunk_rows) == (128, 8, 8)
    plan = plan_launch(1028, 128, 4, True)
    assert (plan.num_parts, plan.rows_per_program) == (86, 12)  # 257 requests, three to a program


COVERAGE_TOPK = dict(policy="moe-spec", ranking="coverage", score="topk")


@pytest.mark.parametrize("num_experts", [60, 128, 160, 256, 384])
def test_coverage_ranking_plans_two_programs_for_a_tall_tile(num_experts) -> None:
    """The coverage ranking on top-k scores runs a call of one tile but at least COVERAGE_SPLIT_ROWS
    rows as two programs of equal power-of-two tiles (the pair-sum greedy); every other call, and the
    same ranking on dense scores, keeps plan_launch's plan."""
    coverage = PrunerConfig(**COVERAGE_TOPK, max_experts=16)
    others = [
        PrunerConfig(policy="moe-spec", ranking="coverage", score="probs", max_experts=16),
        PrunerConfig(policy="xshare-spec", k0=1, budget=8, request_budget=2),
        PrunerConfig(policy="moe-spec", max_experts=16),
        PrunerConfig(policy="xshare", k0=1, budget=8),
    ]
    # T = 5 to 8 read one 8-row tile on up to 256 experts: that tile is split
    assert COVERAGE_SPLIT_ROWS == 5
    if num_experts <= 256:
        assert [plan_for(coverage, t, num_experts, 1).num_parts for t in range(1, 10)] == [1, 1, 1, 1, 2, 2, 2, 2, 2]
    for num_tokens in range(0, 20):
        plain = plan_launch(num_tokens, num_experts, 1, False)
        for cfg in others:
            per_request = cfg.policy == "xshare-spec"
            assert plan_for(cfg, num_tokens, num_experts, 1) == plan_launch(num_tokens, num_experts, 1, per_request)
        plan = plan_for(coverage, num_tokens, num_experts, 1)
        if not plain.single or num_tokens < COVERAGE_SPLIT_ROWS:
            assert plan == plain, num_tokens
            continue
        assert plan.num_parts == 2 and plan.route_programs == 2, plan
        tile = plan.rows_per_program
        assert tile & (tile - 1) == 0 and tile < num_tokens <= 2 * tile, plan
        assert plan.chunk_rows == plan.route_rows == plan.rows_per_request == tile, plan


@pytest.mark.fused_selection
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "routing"),
    [(4, 128, "softmax"), (5, 60, "biased"), (8, 128, "softmax"), (8, 256, "grouped")],
)
def test_coverage_ranking_on_a_split_tile_matches_reference(num_tokens, num_experts, routing, monkeypatch) -> None:
    """Coverage calls of one tile from COVERAGE_SPLIT_ROWS rows launch the selection over two programs
    and the routing (the pair sums zeroed before them), T=4 one program; ids, keep mask and metrics
    equal the reference's, weights within tolerance, on two calls in a row on one workspace (the pair
    sums start from 0 each time), with padding rows and filled slots."""
    launches = []
    launcher = type(jit.select_kernel)
    original_run = launcher.run

    def counting_run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(launcher, "run", counting_run)
    top_k = 8
    cfg = PrunerConfig(**COVERAGE_TOPK, max_experts=num_experts // 4)
    router, bias = _router(routing, top_k, num_experts, seed=num_tokens)
    workspace = SelectionWorkspace(num_experts, DEVICE)
    split = num_tokens >= 5
    for seed in range(2):
        logits = make_logits(num_tokens, num_experts, ["normal", "integers"][seed], seed=seed + num_tokens)
        fields = dict(num_valid_tokens=num_tokens - seed, correction_bias=bias)
        want_metrics = torch.zeros(4, dtype=torch.int64)
        want = prune_route_reference(
            routing_call(logits, router, **fields), cfg, fill_dropped=True, metrics_row=want_metrics
        )
        metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        launches.clear()
        got = prune_route(
            routing_call(logits, router, device=DEVICE, as_tensor=True, **fields),
            cfg,
            fill_dropped=True,
            metrics_row=metrics,
            workspace=workspace,
        )
        label = f"T={num_tokens} E={num_experts} {routing} call {seed}"
        assert launches == (["select_kernel", "route_kernel"] if split else ["select_kernel"]), (
            label,
            launches,
        )
        assert got.keep.cpu().tolist() == want.keep.tolist(), label
        assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label
        torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, **WEIGHT_TOLERANCE, msg=label)
        assert metrics.cpu().tolist() == want_metrics.tolist(), label


# ------------------------------------------------------------------ tickets, workspaces, devices


#: Multi-program calls that use every counter of the workspace between them: warm-up and aggregate
#: (xshare), per-request marks (xshare-spec), LYNX bin counts, picks and aggregate, the coverage
#: ranking's column sums and pair sums (top-k scores) or row lists (dense scores).
CLEAN_CASES = {
    "xshare": dict(policy="xshare", k0=1, budget=8),
    "xshare-spec": dict(policy="xshare-spec", k0=1, budget=8, request_budget=3),
    "lynx": dict(policy="lynx", beta=3, max_experts=20),
    "coverage-topk": dict(policy="moe-spec", ranking="coverage", score="topk", max_experts=16),
    "coverage-probs": dict(policy="moe-spec", ranking="coverage", score="probs", max_experts=16),
    "threshold-capped": dict(policy="xshare-threshold", tau=0.8, max_experts=12),
}


@pytest.mark.fused_selection
@pytest.mark.parametrize("case", sorted(CLEAN_CASES))
def test_calls_leave_the_counters_at_zero(case) -> None:
    """Above one program no launch resets the counters: the last program of each kernel clears what
    its kernel accumulated.  After every kind of multi-program call (routing with metrics, routing alone, the keep mask alone) the tickets, accumulators and marks are all 0
    again, and two calls in a row on one workspace both give the reference's answer."""
    num_tokens, num_experts, top_k = 64, 128, 8
    cfg = PrunerConfig(**CLEAN_CASES[case])
    assert not plan_launch(num_tokens, num_experts, 4, cfg.policy == "xshare-spec").single
    workspace = SelectionWorkspace(num_experts, DEVICE)
    for seed, entry in enumerate(["metrics", "route", "keep_mask", "metrics"]):
        logits = make_logits(num_tokens, num_experts, "normal", seed=seed)
        call = routing_call(logits, top_k, device=DEVICE, num_valid_tokens=60, as_tensor=True, tokens_per_request=4)
        want_metrics = torch.zeros(4, dtype=torch.int64)
        want = prune_route_reference(
            routing_call(logits, top_k, num_valid_tokens=60, tokens_per_request=4), cfg, metrics_row=want_metrics
        )
        if entry == "keep_mask":
            keep = select_keep_mask(call, cfg, workspace=workspace)
            assert keep.cpu().tolist() == want.keep.tolist(), entry
        else:
            metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE) if "metrics" in entry else None
            got = prune_route(call, cfg, workspace=workspace, metrics_row=metrics)
            assert got.keep.cpu().tolist() == want.keep.tolist(), entry
            assert torch.equal(got.topk_ids.cpu(), want.topk_ids), entry
            if metrics is not None:
                assert metrics.cpu().tolist() == want_metrics.tolist(), entry
        left = workspace.counters.cpu()
        assert not left.any(), (entry, left.nonzero().flatten().tolist()[:8])


@pytest.mark.fused_selection
@pytest.mark.parametrize("policy", ["none", "oea"])
def test_activated_experts_counted_by_whichever_program_routes_them(policy) -> None:
    """Above one tile the routing kernel counts an expert as activated in the program whose atomic add
    completes the expert's visits (the last program here, where programs run in order).  One expert is
    picked only by a row of the last routing program, one only by a row of the first, several by
    none: the activated count equals the reference's, and the visit words are back at 0."""
    num_tokens, num_experts, top_k = 40, 64, 2
    plan = plan_launch(num_tokens, num_experts, 1, False)
    assert plan.route_programs >= 3 and (num_tokens - 1) // plan.route_rows == plan.route_programs - 1
    logits = make_logits(num_tokens, num_experts, "normal", seed=5)
    logits[:, :6] = -20.0  # experts 0-5: picked by no row, except below
    logits[num_tokens - 1, 0] = 20.0  # expert 0: the last row only (the last routing program)
    logits[0, 1] = 20.0  # expert 1: the first row only (the first routing program)
    cfg = PrunerConfig(policy=policy, k0=1)
    want_metrics = torch.zeros(4, dtype=torch.int64)
    want = prune_route_reference(routing_call(logits, top_k), cfg, metrics_row=want_metrics)
    assert {0, 1} <= set(want.topk_ids.flatten().tolist()) and not {2, 3, 4, 5} & set(want.topk_ids.flatten().tolist())
    workspace = SelectionWorkspace(num_experts, DEVICE)
    for _ in range(2):  # a second call on the same words
        metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        got = prune_route(routing_call(logits, top_k, device=DEVICE), cfg, workspace=workspace, metrics_row=metrics)
        assert torch.equal(got.topk_ids.cpu(), want.topk_ids)
        assert metrics.cpu().tolist() == want_metrics.tolist()
        assert not workspace.visits.cpu().any()


@pytest.mark.fused_selection
def test_activated_experts_counted_per_call_across_interleaved_layers() -> None:
    """Every layer on a workspace shares the routing kernel's visit words: two layers taking turns on one
    workspace, calling again with the same and with other logits, each count every expert they route
    to on every call (the words left by the other layer's call, or by the same layer's last call, are
    back at 0), and one-program calls, select-only calls and calls without metrics leave them at 0."""
    num_tokens, num_experts, top_k = 40, 64, 4
    workspace = SelectionWorkspace(num_experts, DEVICE)
    layers = [PrunerConfig(policy="xshare", k0=1, budget=24), PrunerConfig(policy="moe-spec", max_experts=20)]
    logits = [make_logits(num_tokens, num_experts, "normal", seed=seed) for seed in (11, 12)]
    rows = [torch.zeros(4, dtype=torch.int64, device=DEVICE) for _ in layers]
    want_rows = [torch.zeros(4, dtype=torch.int64) for _ in layers]
    for step in range(3):
        for layer, cfg in enumerate(layers):
            x = logits[(step + layer) % 2] if step < 2 else logits[layer]
            prune_route_reference(routing_call(x, top_k), cfg, metrics_row=want_rows[layer])
            prune_route(routing_call(x, top_k, device=DEVICE), cfg, workspace=workspace, metrics_row=rows[layer])
            assert rows[layer].cpu().tolist() == want_rows[layer].tolist(), (step, layer)
            assert not workspace.visits.cpu().any(), (step, layer)
    prune_route(routing_call(logits[0][:1], top_k, device=DEVICE), layers[0], workspace=workspace, metrics_row=rows[0])
    prune_route(routing_call(logits[0], top_k, device=DEVICE), layers[0], workspace=workspace)
    select_keep_mask(routing_call(logits[0], top_k, device=DEVICE), layers[0], workspace=workspace)
    assert not workspace.visits.cpu().any()


ROUTE_MASS_RULES = ("oea", "oea-probs", "moe-spec-static", "lynx")
ROUTE_MASS_SHAPES = ((64, 60, False), (255, 160, True), (40, 256, True))  # T, E, vote weights
# every rule meets every router kind once, and every shape does too
ROUTE_MASS_CASES = [
    (rule, *shape, ("softmax", "sigmoid", "biased")[(r + s) % 3])
    for r, rule in enumerate(ROUTE_MASS_RULES)
    for s, shape in enumerate(ROUTE_MASS_SHAPES)
]


@pytest.mark.fused_selection
@pytest.mark.parametrize(("rule", "num_tokens", "num_experts", "votes", "routing"), ROUTE_MASS_CASES)
def test_retained_mass_of_rules_without_scores_is_summed_by_the_routing(
    rule, num_tokens, num_experts, votes, routing, tmp_path
) -> None:
    """Above one program, a rule that needs no scores (``oea``, static moe-spec, LYNX without a cap)
    computes none in the selection: the routing kernel's programs sum their rows' kept and total score
    mass and its last program adds the retained share.  The metrics row equals the reference's (padding
    rows, vote weights, top-k and dense scores, every router kind), two calls in a row on one
    workspace, and the workspace's counters are all 0 after each."""
    from xshare_sglang.bench.kernel_compile import capture_launches
    from xshare_sglang.kernels.plan import plan_for

    cfg = {
        "oea": PrunerConfig(policy="oea", k0=2),
        "oea-probs": PrunerConfig(policy="oea", k0=1, score="probs"),
        "moe-spec-static": _static_ranking(tmp_path, num_experts, 17),
        "lynx": PrunerConfig(policy="lynx", beta=3),
    }[rule]
    seed = num_tokens + num_experts
    router, bias = _router(routing, 6, num_experts, seed)
    assert not plan_for(cfg, num_tokens, num_experts, 1).single
    fields = dict(correction_bias=bias, num_valid_tokens=num_tokens - 3, layer_id=1)
    if votes:
        fields["token_weights"] = torch.rand(num_tokens, generator=torch.Generator().manual_seed(seed))
        fields["token_weights"][::5] = 0.0  # rows that do not vote
    workspace = SelectionWorkspace(num_experts, DEVICE)
    for call_seed in (seed, seed + 1):
        logits = make_logits(num_tokens, num_experts, "normal", seed=call_seed)
        call = routing_call(logits, router, device=DEVICE, as_tensor=True, **fields)
        launches = capture_launches(call, cfg, metrics_row=torch.zeros(4, dtype=torch.int64))
        assert launches["route_kernel"][2]["MASS"] is not None
        if rule == "moe-spec-static":  # the calibrated set: no selection launch at all
            assert set(launches) == {"route_kernel"} and launches["route_kernel"][2]["MASK"].STATIC_KEEP
        else:
            assert not launches["select_kernel"][2]["SCORES"].NEED_SCORES
        want_metrics = torch.zeros(4, dtype=torch.int64)
        want = prune_route_reference(routing_call(logits, router, **fields), cfg, metrics_row=want_metrics)
        metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        got = prune_route(call, cfg, workspace=workspace, metrics_row=metrics)
        assert got.keep.cpu().tolist() == want.keep.tolist()
        assert 0 < want_metrics[2] < 1 << 24  # a share strictly between none and all of the mass
        assert metrics.cpu().tolist() == want_metrics.tolist()
        assert not workspace.counters.cpu().any()


# (policy, T, E, routing, launch): every kind of launch a gate reaches.  One program: the rules whose
# scores only the retained mass wants (oea, static moe-spec, LYNX), a rule that scores anyway, none.
# Above one: the routing's retained mass, static moe-spec's routing kernel alone, LYNX's three kernels, the per-request selection, none's routing
# alone, and a select-only call.
GATE_CASES = [
    ("oea", 1, 128, "softmax", "route"),
    ("moe-spec-static", 4, 64, "softmax", "route"),
    ("lynx", 5, 60, "sigmoid", "route"),
    ("xshare", 7, 160, "biased", "route"),
    ("none", 1, 256, "biased", "route"),
    ("oea", 64, 160, "biased", "route"),
    ("oea", 40, 64, "softmax", "route"),
    ("moe-spec-static", 40, 256, "biased", "route"),
    ("lynx", 64, 128, "softmax", "route"),
    ("xshare-spec", 48, 64, "sigmoid", "route"),
    ("none", 64, 128, "grouped", "route"),
    ("xshare", 64, 60, "softmax", "select"),
]


@pytest.mark.fused_selection
@pytest.mark.parametrize(("rule", "num_tokens", "num_experts", "routing", "launch"), GATE_CASES)
def test_a_metrics_gate_of_zero_adds_nothing_and_leaves_the_counters_clean(
    rule, num_tokens, num_experts, routing, launch, tmp_path
) -> None:
    """With a metrics gate, a call adds its metrics only while the gate holds a nonzero value: three
    calls on one workspace with the gate refilled in place (0, 1, 0, as a server samples one forward
    in a few) leave the metrics row at the reference's sums after each (0 after the first; the
    second's exact metrics after the third), the mask and ids equal the reference's every time, and every counter of the workspace, the routing's visit
    words included, is back at 0 after each call."""
    from xshare_sglang.bench.kernel_compile import capture_launches

    cfg = {
        "oea": PrunerConfig(policy="oea", k0=2),
        "moe-spec-static": _static_ranking(tmp_path, num_experts, 17),
        "lynx": PrunerConfig(policy="lynx", beta=3),
        "xshare": PrunerConfig(policy="xshare", k0=1, budget=12),
        "xshare-spec": PrunerConfig(policy="xshare-spec", k0=1, request_budget=2, budget=6),
        "none": PrunerConfig(policy="none"),
    }[rule]
    seed = 3 * num_tokens + num_experts
    router, bias = _router(routing, 4, num_experts, seed)
    fields = dict(correction_bias=bias, num_valid_tokens=num_tokens - (num_tokens > 4), layer_id=1)
    if rule == "xshare-spec":
        fields["tokens_per_request"] = 4
    workspace = SelectionWorkspace(num_experts, DEVICE)
    gate = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    want_metrics = torch.zeros(4, dtype=torch.int64)
    for step, value in enumerate((0, 1, 0)):
        gate.fill_(value)
        logits = make_logits(num_tokens, num_experts, "normal", seed=seed + step)
        call = routing_call(logits, router, device=DEVICE, as_tensor=True, **fields)
        reference_call = routing_call(logits, router, **fields)
        if launch == "select":
            want = select(reference_call, cfg)[0]
            reference_metrics = torch.zeros(4, dtype=torch.int64)
            prune_route_reference(reference_call, cfg, metrics_row=reference_metrics)
            reference_metrics[0] = 0  # select-only: the activated experts are the router's to add
            want_metrics += reference_metrics * value
            got = select_keep_mask(call, cfg, metrics_row=metrics, metrics_gate=gate, workspace=workspace)
            assert got.cpu().tolist() == want.tolist(), step
        else:
            want = prune_route_reference(
                reference_call, cfg, metrics_row=want_metrics, metrics_gate=torch.tensor([value], dtype=torch.int32)
            )
            got = prune_route(call, cfg, metrics_row=metrics, metrics_gate=gate, workspace=workspace)
            assert got.keep.cpu().tolist() == want.keep.tolist(), step
            assert got.topk_ids.cpu().tolist() == want.topk_ids.tolist(), step
        assert metrics.cpu().tolist() == want_metrics.tolist(), step
        assert not workspace.counters.cpu().any(), step
        assert not workspace.visits.cpu().any(), step
    assert want_metrics[3] == 1 and want_metrics[1] > 0  # the one call with the gate open counted
    # every kernel of the call reads the gate
    launches = (
        capture_launches(
            routing_call(logits, router, as_tensor=True, **fields),
            cfg,
            metrics_row=torch.zeros(4, dtype=torch.int64),
            metrics_gate=torch.ones(1, dtype=torch.int32),
        )
        if launch != "select"
        else {}
    )
    gated = {name: _fields(kwargs).get("GATED") for name, (_, _, kwargs) in launches.items() if name != "fill_kernel"}
    assert all(gated.values()) and len(gated) == len([name for name in launches if name != "fill_kernel"])
    if "select_kernel" in launches:
        # scores that only the retained mass wants are computed in the calls that add metrics alone
        metric_scores = rule in ("oea", "moe-spec-static", "lynx") and launches["select_kernel"][0] == (1,)
        assert metric_scores == launches["select_kernel"][2]["SCORES"].METRIC_SCORES


def test_a_metrics_gate_needs_its_row_and_a_one_word_int32() -> None:
    """A gate without the row it gates, or of another shape or dtype, is refused, naming it."""
    call = routing_call(make_logits(4, 64, "normal", seed=1), 4)
    row = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="metrics_gate gates the metrics_row"):
        prune_route_reference(call, PrunerConfig(policy="oea"), metrics_gate=torch.ones(1, dtype=torch.int32))
    for bad in (torch.ones(2, dtype=torch.int32), torch.ones(1, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"metrics_gate must be a torch.int32 tensor of shape \(1,\)"):
            prune_route(call, PrunerConfig(policy="oea"), metrics_row=row, metrics_gate=bad)
        with pytest.raises(ValueError, match="metrics_gate must be"):
            select_keep_mask(call, PrunerConfig(policy="oea"), metrics_row=row, metrics_gate=bad)


@pytest.mark.fused_selection
def test_a_call_that_fails_part_way_resets_the_counters(monkeypatch) -> None:
    """LYNX's aggregate is cleared by its second kernel: when that launch fails after the selection
    kernel ran, the wrapper zeroes the counters before the error goes on, and the next call on the
    workspace gives the reference's mask and metrics.  ``reset`` does the same after a foreign write."""
    num_tokens, num_experts = 64, 128
    cfg = PrunerConfig(policy="lynx", beta=3, max_experts=20)
    workspace = SelectionWorkspace(num_experts, DEVICE)
    logits = make_logits(num_tokens, num_experts, "normal", seed=3)
    call = routing_call(logits, 8, device=DEVICE)
    want_metrics = torch.zeros(4, dtype=torch.int64)
    want = prune_route_reference(routing_call(logits, 8), cfg, metrics_row=want_metrics)

    class Refused:
        def __getitem__(self, grid):
            raise RuntimeError("launch refused")

    with monkeypatch.context() as patch:
        patch.setattr(jit, "lynx_pick_kernel", Refused())
        ran = []
        real_select = jit.select_kernel
        patch.setattr(jit, "select_kernel", _Recording(real_select, ran))
        with pytest.raises(RuntimeError, match="launch refused"):
            prune_route(call, cfg, workspace=workspace, metrics_row=torch.zeros(4, dtype=torch.int64, device=DEVICE))
        assert ran == ["select_kernel"]  # the selection did run (and left its aggregate behind)
    assert not workspace.counters.cpu().any()
    workspace.aggregate.fill_(1 << 20)  # a foreign write
    workspace.tickets.copy_(torch.tensor([3, 5, 1], dtype=torch.int32))
    workspace.reset()
    for _ in range(2):
        metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
        got = prune_route(call, cfg, workspace=workspace, metrics_row=metrics)
        assert got.keep.cpu().tolist() == want.keep.tolist()
        assert metrics.cpu().tolist() == want_metrics.tolist()
    assert not workspace.counters.cpu().any()


class _Recording:
    """A jit kernel whose launches are recorded by name and then run."""

    def __init__(self, kernel, log: list) -> None:
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append("select_kernel")
            return launch(*args, **kwargs)

        return run


def test_workspaces_are_kept_per_stream(monkeypatch) -> None:
    """The shared workspace and the runtime's are chosen by (device, E, stream): calls issued on two
    streams never share tickets or partials; calls on one stream share one workspace."""
    import xshare_sglang.devices as devices
    from xshare_sglang.sglang_plugin.runtime import PrunerRuntime

    wrapper = importlib.import_module("xshare_sglang.kernels.workspace")
    current = {"stream": 11}
    monkeypatch.setattr(devices, "stream_key", lambda device: current["stream"])
    monkeypatch.setattr(wrapper, "stream_key", lambda device: current["stream"])
    a = wrapper.default_workspace(60, "cpu")
    assert wrapper.default_workspace(60, torch.device("cpu")) is a
    current["stream"] = 12
    b = wrapper.default_workspace(60, "cpu")
    assert b is not a and b.tickets.data_ptr() != a.tickets.data_ptr()
    runtime = PrunerRuntime(settings=None, device=torch.device("cpu"), layers={}, num_valid_buffer=None, metrics=None)
    logits = torch.zeros(3, 60)
    on_12 = runtime._workspace(logits)
    current["stream"] = 11
    assert runtime._workspace(logits) is not on_12
    assert runtime._workspace(logits) is runtime._workspace(logits)


@pytest.mark.parametrize("spelling", ["cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0])
def test_cuda_without_an_index_is_the_current_device(spelling, monkeypatch) -> None:
    """ "cuda", "cuda:0", torch.device("cuda") and 0 name one device, for comparisons, cache keys and
    workspaces (a workspace made for "cuda" used to refuse the logits of cuda:0).  No GPU needed: the
    current device is patched, and the workspace's buffers are made on the meta device."""
    from xshare_sglang.devices import canonical_device, same_device

    wrapper = importlib.import_module("xshare_sglang.kernels.workspace")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(wrapper, "stream_key", lambda device: 0)
    assert canonical_device(spelling) == torch.device("cuda", 0)
    assert same_device(spelling, "cuda:0") and not same_device(spelling, "cuda:1")
    assert canonical_device("cuda:1") == torch.device("cuda", 1)
    assert canonical_device("cpu:0") == canonical_device("cpu") == torch.device("cpu")
    assert wrapper.workspace_key(60, spelling) == wrapper.workspace_key(60, torch.device("cuda", 0))
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *shape, **kw: real_zeros(*shape, **{**kw, "device": "meta"}))
    workspace = SelectionWorkspace(60, spelling)
    assert workspace.device == torch.device("cuda", 0)  # what a tensor on cuda:0 reports


LYNX_CASES = [
    (4, 40, 128),  # n**5 < 2**61: one int64 per expert
    (2, LARGE_T, 64),  # 4097**3 ~ 2**36: one int64, over programs of five tiles
    (9, 65, 64),  # 65**10 ~ 2**60.2: one int64 near its bound, over several programs
    (14, 7, 60),  # 7**15 ~ 2**42: still one int64
    (14, 40, 128),  # 40**15 ~ 2**80: base-n digits
    (8, 255, 160),  # 255**9 ~ 2**72: base-n digits over several programs
]


def _lynx_inputs(beta, num_tokens, num_experts, small: bool = DEVICE == "cpu") -> dict:
    """A case of :func:`test_lynx_ranks_exactly_with_and_without_digits`: cfg, rows and limits."""
    cfg = PrunerConfig(policy="lynx", alpha=1.0, beta=beta)
    rows, limits = _interpreted(num_tokens, cfg, small)
    return dict(cfg=cfg, rows=rows, limits=limits)


@pytest.mark.fused_selection
@pytest.mark.parametrize(("beta", "num_tokens", "num_experts"), LYNX_CASES)
def test_lynx_ranks_exactly_with_and_without_digits(beta, num_tokens, num_experts) -> None:
    """LYNX's expert order ``s = sum_t n ** bin`` is one int64 while ``n ** (beta + 1) < 2**61`` and
    base-n digits above; both give the reference's mask and routing, ties included (integer logits)."""
    inputs = _lynx_inputs(beta, num_tokens, num_experts)
    assert _lynx_digits(beta, inputs["rows"]) == _lynx_digits(beta, num_tokens)
    for kind in ("normal", "integers"):
        logits = make_logits(inputs["rows"], num_experts, kind, seed=beta * 31 + num_tokens)
        _compare_routing(logits, inputs["cfg"], 8, limits=inputs["limits"])


def test_dependent_launch_needs_hopper(monkeypatch) -> None:
    """``enable_pdl`` on a GPU older than compute capability 9.0 is refused with an error that names it;
    on 9.0 it is accepted; CPU tensors (the interpreter, the compile-only capture) have nothing to check."""
    wrapper = importlib.import_module("xshare_sglang.kernels.launch")
    monkeypatch.setattr(wrapper, "_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match=r"enable_pdl needs a GPU of compute capability 9\.0 or newer.*is 8\.0"):
        wrapper.check_pdl(torch.device("cuda", 0))
    monkeypatch.setattr(wrapper, "_capability", lambda device: (9, 0))
    wrapper.check_pdl(torch.device("cuda", 0))
    wrapper.check_pdl(torch.device("cpu"))
    # under the interpreter the flag changes nothing: the same routing as without it
    logits = make_logits(40, 64, "normal", seed=3)
    call = routing_call(logits, RouterSpec(4), device=DEVICE)
    plain = prune_route(call, PrunerConfig(policy="xshare", k0=1, budget=8))
    dependent = prune_route(call, PrunerConfig(policy="xshare", k0=1, budget=8), enable_pdl=True)
    assert torch.equal(plain.topk_ids, dependent.topk_ids) and torch.equal(plain.keep, dependent.keep)


#: Rules that keep some experts and leave others when one expert holds nearly all of every row's mass.
PAST_32_BITS = {
    "oea": PrunerConfig(policy="oea", k0=2),
    "xshare": PrunerConfig(policy="xshare", k0=1, budget=8),
    "xshare-capped": PrunerConfig(policy="xshare", k0=2, budget=8, max_experts=5),
    "xshare-threshold": PrunerConfig(policy="xshare-threshold", k0=1, tau=0.999, score="probs"),
    "xshare-spec": PrunerConfig(policy="xshare-spec", k0=1, request_budget=2, budget=4),
    "xshare-ep": PrunerConfig(policy="xshare-ep", k0=1, rank_budget=2),
    "moe-spec": PrunerConfig(policy="moe-spec", max_experts=9),
    "moe-spec-topk": PrunerConfig(policy="moe-spec", max_experts=9, score="topk"),
    "lynx": PrunerConfig(policy="lynx", beta=3, max_experts=6),
}


@pytest.mark.fused_selection
@pytest.mark.parametrize("rule", sorted(PAST_32_BITS))
def test_aggregates_past_32_bits_are_exact(rule) -> None:
    """A large batch's aggregates pass 2**32 (at 4097 rows the total is about 2**36), which the
    stand-ins of T=4097 do not reach: at 257 rows under SMALL_LIMITS (programs of several tiles, the
    last partial, as 257 = 4097 mod 192) with expert 3 holding 99.8% of every row's mass, its
    aggregate and the total pass 2**32 while the other experts' stay apart, and the keep mask (of
    every policy, a cap included), the (kept, total) stats and the metrics row equal the reference's."""
    num_tokens, num_experts = 257, 64
    cfg = PAST_32_BITS[rule]
    logits = make_logits(num_tokens, num_experts, "normal", seed=4)
    logits[:, 3] = 11.0
    ranks = torch.arange(num_experts) % 4
    fields = dict(tokens_per_request=4, expert_to_rank=ranks)
    keep, aggregate = select(routing_call(logits, 4, **fields), cfg)
    assert aggregate[3] > 2**32 and aggregate.sum() > 2**32
    assert 1 < int(keep.sum()) < num_experts or rule == "oea", int(keep.sum())
    stats = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    call = routing_call(logits, 4, device=DEVICE, **fields)
    got = select_keep_mask(call, cfg, stats_out=stats, metrics_row=metrics, limits=SMALL_LIMITS)
    assert got.cpu().tolist() == keep.tolist()
    assert stats.cpu().tolist() == [int(aggregate[keep].sum()), int(aggregate.sum())]
    assert metrics.cpu().tolist() == selection_metrics(keep, aggregate[keep].sum(), aggregate.sum()).tolist()


@pytest.mark.fused_selection
def test_a_call_of_4097_rows_selects_under_the_production_limits() -> None:
    """One call of 4097 rows under the production limits, under the interpreter too (where the other
    T=4097 cases run as stand-ins): the keep mask alone, over 103 programs of five tiles and a last of
    17 rows, with the aggregates near 2**36 (expert 3 far ahead on half the rows); mask, stats and
    metrics row equal the reference's."""
    cfg = PrunerConfig(policy="oea", k0=2)
    logits = make_logits(LARGE_T, 64, "normal", seed=LARGE_T)
    logits[::2, 3] = 15.0
    call = routing_call(logits, 4, num_valid_tokens=LARGE_T - 2)
    keep, aggregate = select(call, cfg)
    assert aggregate[3] > 2**34 and aggregate.sum() > 2**35
    stats = torch.full((2,), -1, dtype=torch.int64, device=DEVICE)
    metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    device_call = routing_call(logits, 4, device=DEVICE, as_tensor=True, num_valid_tokens=LARGE_T - 2)
    got = select_keep_mask(device_call, cfg, stats_out=stats, metrics_row=metrics)
    assert got.cpu().tolist() == keep.tolist()
    assert stats.cpu().tolist() == [int(aggregate[keep].sum()), int(aggregate.sum())]
    assert metrics.cpu().tolist() == selection_metrics(keep, aggregate[keep].sum(), aggregate.sum()).tolist()


# ------------------------------------------------------------------ the stand-ins of T=4097


def _path(logits, cfg, router, *, entry="route", bias=None, as_tensor=True, limits=PRODUCTION_LIMITS, **fields) -> dict:
    """The path one call of :func:`_compare_routing` (``entry="route"``) or of the keep mask with the
    score totals (``"select"``) takes through the kernels, recorded without running them: each launch's
    kernel, warps, options and constexprs (not its grid); how the selection's programs and the routing's
    lay out the rows; and the branches the kernels take on the real-token count."""
    from xshare_sglang.kernels.launch import planned_launches

    fill_dropped = fields.pop("fill_dropped", False)
    call = routing_call(logits, router, correction_bias=bias, as_tensor=as_tensor, **fields)
    if entry == "route":
        metrics = torch.zeros(4, dtype=torch.int64)
        planned = planned_launches(call, cfg, fill_dropped=fill_dropped, metrics_row=metrics, limits=limits)
    else:
        stats = torch.zeros(2, dtype=torch.int64)
        planned = planned_launches(call, cfg, entry="select", stats_out=stats, limits=limits)
    num_tokens, num_experts = logits.shape
    split = plan_for(cfg, num_tokens, num_experts, call.tokens_per_request, limits=limits)
    # a program's step: a tile of rows, or one request of a per-request policy
    step = split.rows_per_request if split.rows_per_request < split.rows_per_program else split.chunk_rows
    last = num_tokens - (split.num_parts - 1) * split.rows_per_program  # the last program's rows
    num_valid = call.num_valid_tokens
    num_valid = num_tokens if num_valid is None else int(num_valid if isinstance(num_valid, int) else num_valid[0])
    real = min(max(num_valid, 0), num_tokens)
    low, high = cfg.min_tokens or 0, cfg.max_tokens if cfg.max_tokens is not None else math.inf
    return dict(
        launches=[(launch.kernel, dict(launch.kwargs)) for launch in planned],
        layout=dict(
            programs=min(split.num_parts, 3),  # 3: a first, a middle and a last program
            steps=min(split.rows_per_program // step, 2),  # 2: several tiles (or requests) a program
            last_steps=min(-(-last // step), 2),
            last_partial=last < split.rows_per_program,
            last_step_partial=last % step != 0,
            routing_programs=min(split.route_programs, 3),
            last_routing_tile_partial=num_tokens % split.route_rows != 0,
        ),
        branches=dict(
            real_rows="none" if real == 0 else "some" if real < num_tokens else "all",
            in_range=low <= real <= high,
            lynx_digits=cfg.policy == "lynx" and _lynx_digits(cfg.beta, real),
            candidates_past_count=real * call.top_k > set_rule(cfg, num_tokens, num_experts, call.top_k, None).count,
        ),
    )


def _large_cases() -> list[tuple[str, tuple]]:
    """Every T=4097 case that runs as a stand-in under the interpreter: (test, its parameters)."""
    return (
        [("prune_route", case) for case in _coverage_cases() if case[1] == LARGE_T]
        + [("votes", (*case, *shape)) for case in VOTE_CASES for shape in VOTE_SHAPES if shape[0] == LARGE_T]
        + [("lynx", case) for case in LYNX_CASES if case[1] == LARGE_T]
    )


def _large_case_paths(test: str, params: tuple, small: bool) -> list[dict]:
    """The paths of one case of ``test`` (every call it makes but the reference's), as
    :func:`_interpreted` runs it with ``small`` or at T=4097 under the production limits."""
    if test == "prune_route":
        return [_path(**_prune_route_inputs(*params, small=small))]
    if test == "votes":
        inputs = _vote_inputs(*params, small=small)
        args = (inputs["logits"], inputs["cfg"], inputs["router"])
        return [_path(*args, entry=entry, limits=inputs["limits"], **inputs["fields"]) for entry in ("route", "select")]
    beta, num_tokens, num_experts = params
    inputs = _lynx_inputs(*params, small=small)
    logits = make_logits(inputs["rows"], num_experts, "normal", seed=beta * 31 + num_tokens)
    return [_path(logits, inputs["cfg"], RouterSpec(8), limits=inputs["limits"])]


@pytest.mark.parametrize(
    ("test", "params"), _large_cases(), ids=["-".join(map(str, (test, *params))) for test, params in _large_cases()]
)
def test_small_calls_take_the_paths_of_4097_rows(test, params) -> None:
    """Each T=4097 case the interpreter runs as a stand-in (SMALL_LIMITS on 65 or 257 rows) takes the
    path of the real call under the production limits, recorded without running a kernel: the same
    kernels with the same warps, options and constexprs; several programs (a first, a middle and a last)
    of several tiles or requests, a partial last program of several; the routing over several programs,
    its last tile partial; and the same branches on the real-token count (padding rows, the token
    range, LYNX's digits, more candidates than the count).  The real call's plan is such a path."""
    large = _large_case_paths(test, params, small=False)
    assert _large_case_paths(test, params, small=True) == large
    for path in large:
        assert path["layout"] == dict(
            programs=3,
            steps=2,
            last_steps=2,
            last_partial=True,
            last_step_partial=True,
            routing_programs=3,
            last_routing_tile_partial=True,
        ), path["layout"]


def test_the_stand_in_of_4097_rows_splits_as_they_do() -> None:
    """The production limits split 4097 rows of E=64 into 102 programs of 40 rows (five 8-row tiles) and
    a last of 17 (8 + 8 + 1), routed by 513 programs; SMALL_LIMITS split 65 rows into 24 + 24 + 17,
    routed by 9.  Per request (D=3, E=160): 124 programs of 11 requests and a last of 1 request and 2
    rows; 3 of 6 and a last of 3 requests and 2 rows.  The limits may be lowered, never raised."""
    assert (PRODUCTION_LIMITS.max_parts, PRODUCTION_LIMITS.max_keyed_coact_tokens) == (128, 4095)
    assert plan_launch(LARGE_T, 64, 1, False) == LaunchPlan(103, 40, 40, 8, 64, 8, 513)
    assert plan_launch(SMALL_T, 64, 1, False, limits=SMALL_LIMITS) == LaunchPlan(3, 24, 24, 8, 64, 8, 9)
    assert plan_launch(LARGE_T, 160, 3, True) == LaunchPlan(125, 33, 3, 4, 256, 8, 513)
    assert plan_launch(SMALL_T, 160, 3, True, limits=SMALL_LIMITS) == LaunchPlan(4, 18, 3, 4, 256, 8, 9)
    for bad in (
        dict(max_parts=1),
        dict(max_parts=129),
        dict(max_keyed_coact_tokens=4097),
        dict(max_keyed_coact_tokens=-1),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PlanLimits(**bad)
