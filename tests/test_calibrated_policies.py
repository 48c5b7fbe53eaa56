"""``moe-spec`` beyond the paper: calibrated per-layer budgets, the coverage ranking and the
co-activation ranking.

The statistics (:mod:`xshare_sglang.serving.calibration.routing_stats`) on hand-built calls; the budget
allocation against brute force; the two greedy rankings against hand-worked cases and against plain
top-B where they must agree with it; the kernel against the reference; the file format, the config
errors and ``xshare-sglang calibrate --from-trace`` as a user runs it.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import subprocess
import sys

import pytest
import torch

from tests.strategies import make_logits, routing_call
from xshare_sglang import PrunerConfig
from xshare_sglang.calibration_file import REDUNDANCY_BITS, allocate_layer_budgets
from xshare_sglang.kernels import prune_route
from xshare_sglang.kernels.plan import MAX_KEYED_COACT_TOKENS, PRODUCTION_LIMITS, CallSpec, PlanLimits, plan_call
from xshare_sglang.policies.call import RouterSpec
from xshare_sglang.policies.greedy import coactivation_add, coverage_add
from xshare_sglang.policies.prune_route import prune_route as prune_route_reference
from xshare_sglang.replay.trace import LayerCall, Trace, TraceMeta
from xshare_sglang.serving.calibration.recorder_dump import ExpertCounts, read_dump, write_static_ranking
from xshare_sglang.serving.calibration.routing_stats import RoutingStats, stats_from_trace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONE = 1 << REDUNDANCY_BITS


def _calibration_file(tmp_path, num_layers: int = 3, num_experts: int = 64, top_k: int = 4, seed: int = 0):
    """A calibration file from random routing whose layers differ in how concentrated they are."""
    generator = torch.Generator().manual_seed(seed)
    stats = RoutingStats.empty(num_layers, num_experts)
    for layer in range(num_layers):
        for _ in range(12):
            popularity = torch.linspace(1.5, 0.0, num_experts) * layer  # layer 0 uniform, later ones skewed
            logits = torch.randn(16, num_experts, generator=generator) + popularity
            stats.add(layer, logits.topk(top_k).indices)
    counts = ExpertCounts(counts=stats.counts(), forward_passes=12, files=(), kinds=(), stats=stats)
    path = tmp_path / "calibration.json"
    write_static_ranking(counts, path)
    return path


# ------------------------------------------------------------------------------ statistics


def test_routing_stats_count_pairs_and_curves() -> None:
    stats = RoutingStats.empty(2, 5)
    # layer 0: token picks {0, 1}, {0, 2}, {0, 1}; one group
    stats.add(0, torch.tensor([[0, 1], [2, 0], [1, 0]]))
    # layer 1: two groups (requests 7 and 9), a missing pick (-1)
    stats.add(1, torch.tensor([[3, -1], [3, 4], [4, 4]]), group_ids=torch.tensor([7, 9, 9]))
    pairs = stats.coactivation.long()
    assert pairs[0].tolist() == [[3, 2, 1, 0, 0], [2, 2, 0, 0, 0], [1, 0, 1, 0, 0], [0] * 5, [0] * 5]
    assert stats.counts().tolist() == [[3, 2, 1, 0, 0], [0, 0, 0, 2, 2]]
    curves = stats.budget_curves()
    # layer 0: picks 3, 2, 1 of 6 -> 1/2, 5/6, 1
    torch.testing.assert_close(curves[0], torch.tensor([0, 0.5, 5 / 6, 1, 1, 1], dtype=torch.float64))
    # layer 1: request 7 picks {3}: 1 with one expert; request 9's tokens pick {3, 4} and {4} (a token
    # counts an expert once): 2 of 3 with one expert, 1 with two -> mean 5/6, then 1
    torch.testing.assert_close(curves[1], torch.tensor([0, 5 / 6, 1, 1, 1, 1], dtype=torch.float64))
    assert stats.groups.tolist() == [1, 2]


def test_stats_from_trace_group_verify_rows_by_request() -> None:
    meta = TraceMeta(model="m", num_layers=1, num_experts=4, top_k=1, expert_bytes=(1,))
    logits = torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0], [0, 5.0, 0, 0], [0, 5.0, 0, 0]])
    rows = torch.tensor([0, 0, 1, 1])
    decode = Trace(meta, [LayerCall(0, 0, "decode", rows, logits=logits)])
    verify = Trace(meta, [LayerCall(0, 0, "verify", rows, logits=logits)])
    # one group of 4 picks (3 on expert 1): 3/4 with one expert
    assert stats_from_trace(decode).budget_curves()[0, 1].item() == pytest.approx(0.75)
    # requests {0, 1} -> 1/2 and {1, 1} -> 1: mean 3/4 with one expert as well, but 1 with two
    per_request = stats_from_trace(verify).budget_curves()[0]
    assert per_request[1].item() == pytest.approx(0.75) and per_request[2].item() == pytest.approx(1.0)
    assert stats_from_trace(decode).budget_curves()[0, 2].item() == pytest.approx(1.0)


# ------------------------------------------------------------------------------ budget allocation


@pytest.mark.parametrize("seed", range(6))
def test_allocation_maximizes_covered_picks(seed: int) -> None:
    """Greedy water-filling equals the best of every allocation with the same total (concave curves)."""
    generator = torch.Generator().manual_seed(seed)
    num_layers, num_experts, mean = 3, 6, 2 + seed % 3
    curves = []
    for _ in range(num_layers):
        steps = torch.sort(torch.rand(num_experts, generator=generator), descending=True).values
        curves.append([0.0, *(torch.cumsum(steps, 0) / steps.sum()).tolist()])
    budgets = allocate_layer_budgets(curves, mean)
    assert sum(budgets) == num_layers * mean and all(1 <= b <= num_experts for b in budgets)
    best = max(
        sum(curves[layer][b] for layer, b in enumerate(choice))
        for choice in itertools.product(range(1, num_experts + 1), repeat=num_layers)
        if sum(choice) == num_layers * mean
    )
    assert sum(curves[layer][b] for layer, b in enumerate(budgets)) == pytest.approx(best)


def test_allocation_skips_layers_calibration_never_reached() -> None:
    flat = [0.0, 0.25, 0.5, 0.75, 1.0]
    steep = [0.0, 0.9, 0.95, 1.0, 1.0]
    dense = [0.0] * 5
    # 2 active layers x mean 2 = 4 experts: the steep layer needs 1, the flat one gets 3
    assert allocate_layer_budgets([steep, dense, flat], 2) == (1, 2, 3)
    assert allocate_layer_budgets([steep, flat], 4) == (4, 4)  # the whole pool in each


def test_allocation_spreads_ties_evenly() -> None:
    """Equal marginal gains go to the layer with fewer experts so far: three linear curves share
    what the saturated layer does not need, instead of the first linear layer taking it all."""
    linear = [b / 32 for b in range(33)]
    saturated = [0.0, 0.99, *(min(1.0, 0.99 + 0.005 * b) for b in range(1, 32))]
    assert allocate_layer_budgets([saturated, linear, linear, linear], 3) == (1, 4, 4, 3)
    assert allocate_layer_budgets([linear] * 3, 5) == (5, 5, 5)


# ------------------------------------------------------------------------------ co-activation greedy


def test_coactivation_greedy_passes_over_redundant_experts() -> None:
    agg = torch.tensor([100, 90, 80, 10], dtype=torch.int64)
    redundancy = torch.eye(4, dtype=torch.int32) * ONE
    redundancy[0, 1] = redundancy[1, 0] = ONE * 3 // 4  # 0 and 1 nearly always picked together
    active = torch.tensor(True)
    # gains after 0: 90 * 1/4 = 22.5 for expert 1, 80 for expert 2 -> {0, 2}
    assert coactivation_add(agg, redundancy, 2, active).tolist() == [True, False, True, False]
    # third pick: 1 (22.5) beats 3 (10)
    assert coactivation_add(agg, redundancy, 3, active).tolist() == [True, True, True, False]
    assert not coactivation_add(agg, redundancy, 3, torch.tensor(False)).any()


def test_coactivation_without_pairs_is_router_top_b(tmp_path) -> None:
    """A file whose experts never co-activate ranks exactly as moe-spec's router ranking."""
    num_experts = 24
    doc = {
        "format": "xshare-sglang.static-ranking",
        "version": 1,
        "counts": [[1.0] * num_experts],
        "coactivation": torch.diag(torch.full((num_experts,), 5)).unsqueeze(0).tolist(),
    }
    path = tmp_path / "no_pairs.json"
    path.write_text(json.dumps(doc))
    coact = PrunerConfig(policy="moe-spec", max_experts=7, ranking="coactivation", static_ranking_path=str(path))
    router = PrunerConfig(policy="moe-spec", max_experts=7)
    for seed, num_valid in itertools.product(range(4), (9, 3, 0)):
        logits = make_logits(9, num_experts, "integers" if seed % 2 else "normal", seed)
        a = prune_route_reference(routing_call(logits, 2, num_valid_tokens=num_valid), coact)
        b = prune_route_reference(routing_call(logits, 2, num_valid_tokens=num_valid), router)
        assert torch.equal(a.keep, b.keep) and torch.equal(a.topk_ids, b.topk_ids)


def test_calibrated_budgets_change_each_layer_and_keep_the_mean(tmp_path) -> None:
    path = _calibration_file(tmp_path, num_layers=3, num_experts=64)
    cfg = PrunerConfig(policy="moe-spec", max_experts=12, budget_allocation="calibrated", static_ranking_path=str(path))
    budgets = [cfg.layer_budget(layer) for layer in range(3)]
    assert sum(budgets) == 36 and len(set(budgets)) > 1
    assert budgets == list(cfg.static_ranking.layer_budgets(12))
    logits = make_logits(32, 64, "normal", 3)
    for layer in range(3):
        keep = prune_route_reference(routing_call(logits, 4, layer_id=layer), cfg).keep
        assert int(keep.sum()) == budgets[layer]


# ------------------------------------------------------------------------------ coverage greedy


def test_coverage_greedy_serves_the_tokens_the_kept_experts_miss() -> None:
    half = 1 << 23  # 0.5 in fixed point
    # tokens 0-2 split their mass over experts 0 and 1; token 3 puts all of it on expert 2
    scores = torch.tensor(
        [[half, half, 0, 0], [half, half, 0, 0], [half, half, 0, 0], [0, 0, 2 * half, 0]], dtype=torch.int64
    )
    agg = scores.sum(0)  # 1.5, 1.5, 1.0, 0: the aggregate ranks 0, 1, then 2
    active = torch.tensor(True)
    # first pick 0 (ties with 1 on gain and aggregate -> lower index); then 1 gains 3 * 0.5 * 0.5 = 0.75
    # while 2 gains 1.0 (token 3 is not covered at all) -> {0, 2}
    assert coverage_add(scores, agg, 2, active).tolist() == [True, False, True, False]
    assert coverage_add(scores, agg, 3, active).tolist() == [True, True, True, False]
    # every token covered: the rest of the budget goes by aggregate, then index
    assert coverage_add(scores, agg, 4, active).tolist() == [True, True, True, True]
    assert not coverage_add(scores, agg, 2, torch.tensor(False)).any()


def test_coverage_equals_router_top_b_when_each_token_picks_one_expert() -> None:
    """With top-1 routing a token is covered by its one expert: gains are the aggregates of the
    experts not yet kept, so the greedy is plain top-B by aggregate."""
    cover = PrunerConfig(policy="moe-spec", max_experts=5, ranking="coverage")
    router = PrunerConfig(policy="moe-spec", max_experts=5, score="topk")
    for seed in range(5):
        logits = make_logits(40, 32, "normal", seed)
        a = prune_route_reference(routing_call(logits, 1, num_valid_tokens=40 - seed), cover)
        b = prune_route_reference(routing_call(logits, 1, num_valid_tokens=40 - seed), router)
        assert torch.equal(a.keep, b.keep)


def test_coverage_of_one_row_is_the_top_count_by_aggregate() -> None:
    """With one row every gain is that row's coarse score times its one uncovered share, so the
    greedy takes the experts in the order (score desc, index asc), then the rest by aggregate, the
    same order: the kernels run a one-row call as the router ranking's top-count.  Scores with ties
    (equal, and equal on the greedy's coarser grid), below its grid, and rows summing past 1 (the
    clamp binds)."""
    from xshare_sglang.policies.scores import SCORE_ONE

    generator = torch.Generator().manual_seed(3)
    for trial in range(200):
        num_experts = [8, 60, 128][trial % 3]
        kind = trial % 4
        if kind == 0:  # integers: exact ties
            scores = torch.randint(0, 6, (1, num_experts), generator=generator) * (SCORE_ONE // 8)
        elif kind == 1:  # equal on the grid c = q >> 8, apart in q
            scores = torch.randint(0, 4, (1, num_experts), generator=generator) * 256 + torch.randint(
                0, 256, (1, num_experts), generator=generator
            )
        elif kind == 2:  # a softmax row
            scores = (torch.randn(1, num_experts, generator=generator).softmax(-1) * SCORE_ONE).long()
        else:  # sigmoid scores: the row sums past 1
            scores = (torch.randn(1, num_experts, generator=generator).sigmoid() * SCORE_ONE).long()
        agg = scores[0]
        order = sorted(range(num_experts), key=lambda e: (-int(agg[e]), e))
        for count in (0, 1, 2, 5, num_experts // 2, num_experts, num_experts + 3):
            want = torch.zeros(num_experts, dtype=torch.bool)
            want[order[: min(count, num_experts)]] = True
            got = coverage_add(scores, agg, count, torch.tensor(True))
            assert got.tolist() == want.tolist(), (trial, count)


def test_coverage_reads_the_topk_score_unless_told() -> None:
    assert PrunerConfig(policy="moe-spec", max_experts=4, ranking="coverage").effective_score == "topk"
    assert PrunerConfig(policy="moe-spec", max_experts=4, ranking="coverage", score="probs").effective_score == "probs"
    assert PrunerConfig(policy="moe-spec", max_experts=4).effective_score == "probs"


# ------------------------------------------------------------------------------ kernel = reference


@pytest.mark.fused_selection
@pytest.mark.parametrize(("num_tokens", "num_experts"), [(0, 60), (1, 64), (7, 128), (64, 160), (255, 256)])
@pytest.mark.parametrize(
    "variant", ["coverage", "coverage-probs", "coactivation", "calibrated", "both", "calibrated-request"]
)
def test_kernel_matches_reference(tmp_path, variant: str, num_tokens: int, num_experts: int) -> None:
    path = _calibration_file(tmp_path, num_layers=3, num_experts=num_experts, seed=num_tokens)
    kwargs = dict(policy="moe-spec", max_experts=min(16, num_experts), static_ranking_path=str(path))
    if variant in ("coactivation", "both"):
        kwargs["ranking"] = "coactivation"
    if variant.startswith("coverage"):
        kwargs["ranking"] = "coverage"
        kwargs["score"] = "probs" if variant == "coverage-probs" else None
    if variant in ("calibrated", "both", "calibrated-request", "coverage"):
        kwargs["budget_allocation"] = "calibrated"
    if variant == "coverage-probs":
        del kwargs["static_ranking_path"]
    per_request = 1
    if variant == "calibrated-request":
        kwargs.update(scope="request", max_experts=4)
        per_request = 4
    cfg = PrunerConfig(**kwargs)
    router = RouterSpec(8, renormalize=True) if variant != "coverage-probs" else RouterSpec(4, "sigmoid", True)
    for layer in range(3):
        logits = make_logits(num_tokens, num_experts, ["integers", "normal", "nonfinite"][layer], num_tokens + layer)
        num_valid = max(0, num_tokens - 3) if layer == 2 else None
        votes = torch.rand(num_tokens, generator=torch.Generator().manual_seed(layer)) if layer == 1 else None
        fields = dict(layer_id=layer, tokens_per_request=per_request, num_valid_tokens=num_valid, token_weights=votes)
        want = prune_route_reference(routing_call(logits, router, **fields), cfg)
        got = prune_route(routing_call(logits, router, device=DEVICE, as_tensor=True, **fields), cfg)
        label = f"{variant} T={num_tokens} E={num_experts} layer={layer}"
        assert got.keep.cpu().tolist() == want.keep.tolist(), label
        assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label
        torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, atol=2e-6, rtol=2e-5, msg=label)


@pytest.mark.fused_selection
@pytest.mark.parametrize("num_experts", [60, 128, 256])
def test_kernel_runs_a_one_row_coverage_call_as_the_router_ranking(num_experts: int) -> None:
    """A call of one row takes the router ranking's top-count in the kernel (no serial pick): keep,
    ids, weights and metrics equal the coverage reference's, over top-k and dense scores, four
    routers, ties, non-finite logits, a non-voting row, no real row, and budgets from 1 to past E."""
    from xshare_sglang.kernels import jit

    routers = {
        "softmax": (RouterSpec(8, renormalize=True), None),
        "sigmoid": (RouterSpec(4, "sigmoid", False), None),
        "grouped": (RouterSpec(8, "sigmoid", True, 4 if num_experts % 8 else 8, 2, 2.5), None),
        "biased": (RouterSpec(8, "sigmoid", True, 4 if num_experts % 8 else 8, 2, 2.5), "bias"),
    }
    modes = []
    original_run = type(jit.select_kernel).run

    def recording_run(self, *args, **kwargs):
        modes.append(getattr(kwargs.get("RULE"), "__name__", None))
        return original_run(self, *args, **kwargs)

    type(jit.select_kernel).run = recording_run
    try:
        for case in range(12):
            name = list(routers)[case % 4]
            router, bias = routers[name]
            if bias is not None:
                bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(case)) * 0.5
            cfg = PrunerConfig(
                policy="moe-spec",
                ranking="coverage",
                score=["topk", "probs"][case % 2],
                max_experts=[1, 3, 8, num_experts + 1][case % 4],
            )
            logits = make_logits(1, num_experts, ["integers", "normal", "nonfinite", "repeated_rows"][case % 4], case)
            fields = dict(
                correction_bias=bias,
                num_valid_tokens=[None, 1, 0][case % 3],
                token_weights=torch.tensor([[0.7], [0.0], [1.0]][case % 3]) if case % 5 else None,
            )
            want_metrics = torch.zeros(4, dtype=torch.int64)
            want = prune_route_reference(routing_call(logits, router, **fields), cfg, metrics_row=want_metrics)
            metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
            modes.clear()
            got = prune_route(
                routing_call(logits, router, device=DEVICE, as_tensor=True, **fields), cfg, metrics_row=metrics
            )
            label = f"E={num_experts} case={case} {name} {cfg.summary()}"
            assert modes == ["top_aggregate_rule"], (label, modes)
            assert got.keep.cpu().tolist() == want.keep.tolist(), label
            assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label
            torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, atol=2e-6, rtol=2e-5, msg=label)
            assert metrics.cpu().tolist() == want_metrics.tolist(), label
    finally:
        type(jit.select_kernel).run = original_run


@contextlib.contextmanager
def _selection_launches(warp_picks: bool, monkeypatch):
    """Record the keyword arguments of every selection-kernel launch (the routing kernel's are left
    out), with the calibrated rankings' picks in every warp or, ``warp_picks=False``, block-wide (the
    path above :data:`~xshare_sglang.kernels.plan.split.WARP_PICKS_MAX_EXPERTS` experts, forced here)."""
    from xshare_sglang.kernels import jit

    if not warp_picks:
        monkeypatch.setattr(importlib.import_module("xshare_sglang.kernels.plan.split"), "WARP_PICKS_MAX_EXPERTS", 0)
    launches = []
    original_run = type(jit.select_kernel).run

    def recording_run(self, *args, **kwargs):
        if "RULE" in kwargs:  # every JIT function shares this run: keep the selection's
            launches.append(kwargs)
        return original_run(self, *args, **kwargs)

    type(jit.select_kernel).run = recording_run
    try:
        yield launches
    finally:
        type(jit.select_kernel).run = original_run


def _assert_kernel_is_reference(logits, router, cfg: PrunerConfig, fields: dict, label: str) -> None:
    """Keep mask, routing and metrics row of the kernel equal the reference's (weights within tolerance)."""
    want_metrics = torch.zeros(4, dtype=torch.int64)
    want = prune_route_reference(routing_call(logits, router, **fields), cfg, metrics_row=want_metrics)
    metrics = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    got = prune_route(routing_call(logits, router, device=DEVICE, as_tensor=True, **fields), cfg, metrics_row=metrics)
    assert got.keep.cpu().tolist() == want.keep.tolist(), label
    assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label
    torch.testing.assert_close(got.topk_weights.cpu(), want.topk_weights, atol=2e-6, rtol=2e-5, msg=label)
    assert metrics.cpu().tolist() == want_metrics.tolist(), label


def _edge_fields(num_tokens: int, case: int) -> dict:
    """Padding rows, no real row, and vote weights, in turn."""
    weights = torch.rand(num_tokens, generator=torch.Generator().manual_seed(case)) if case % 4 == 1 else None
    return dict(num_valid_tokens=[None, max(0, num_tokens - 2), 0][case % 3], token_weights=weights)


@pytest.mark.fused_selection
@pytest.mark.parametrize("warp_picks", [True, False], ids=["warp_picks", "block_picks"])
@pytest.mark.parametrize("num_experts", [60, 128, 160, 256])
def test_kernel_coverage_pair_picks_until_no_gain_then_by_aggregate(
    num_experts: int, warp_picks: bool, monkeypatch
) -> None:
    """The coverage greedy from pair sums, each warp picking on its own copy of the gains or
    block-wide (both sides of the A/B), equals the reference when the gaining experts run out with
    budget left, so the rest go by (aggregate desc, index asc): integer logits give tied aggregates;
    padding, vote weights, budgets from 1 to past E.  The calls run the pair-sum path, in every warp
    up to 128 experts (two halves of 64 int64 pair sums)."""
    with _selection_launches(warp_picks, monkeypatch) as launches:
        for case, (num_tokens, budget) in enumerate(
            itertools.product([5, 8, 33], [1, 7, num_experts // 2, num_experts + 3])
        ):
            cfg = PrunerConfig(policy="moe-spec", max_experts=budget, ranking="coverage")
            router = [RouterSpec(2, renormalize=True), RouterSpec(4, "sigmoid", True)][case % 2]
            logits = make_logits(num_tokens, num_experts, ["integers", "repeated_rows", "nonfinite"][case % 3], case)
            label = f"E={num_experts} T={num_tokens} case={case} {cfg.summary()}"
            launches.clear()
            _assert_kernel_is_reference(logits, router, cfg, _edge_fields(num_tokens, case), label)
            assert [(k["RULE_CONFIG"].PAIRS, k["RULE_CONFIG"].WARP_PICKS) for k in launches] == [
                (True, warp_picks and launches[0]["BLOCK_E"] <= 128)
            ], label


def _redundant_groups_file(tmp_path, num_experts: int, seed: int):
    """Co-activation counts where experts come in groups of four always picked together (redundancy
    1.0 inside a group), one expert in seven never picked (redundancy 0 with every other), and partial
    pairs elsewhere: the greedy's gains reach zero while budget is left."""
    generator = torch.Generator().manual_seed(seed)
    group = torch.arange(num_experts) // 4
    together = group[:, None] == group[None, :]
    partial = torch.randint(0, 4, (num_experts, num_experts), generator=generator)
    pairs = torch.where(together, 5, torch.minimum(partial, partial.T))
    never = torch.arange(num_experts) % 7 == 3
    pairs = torch.where(never[:, None] | never[None, :], 0, pairs)
    doc = {
        "format": "xshare-sglang.static-ranking",
        "version": 1,
        "counts": [pairs.diagonal().double().tolist()],
        "coactivation": pairs.unsqueeze(0).tolist(),
    }
    path = tmp_path / f"groups_{num_experts}_{seed}.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.fused_selection
@pytest.mark.parametrize("warp_picks", [True, False], ids=["warp_picks", "block_picks"])
@pytest.mark.parametrize("num_experts", [60, 128, 160, 256])
def test_kernel_coactivation_picks_until_no_gain_then_index_order(
    tmp_path, num_experts: int, warp_picks: bool, monkeypatch
) -> None:
    """The kernel's co-activation greedy, each warp picking on its own copy of the gains or
    block-wide (both sides of the A/B), equals the reference when whole groups of candidates fall to
    a gain of zero with budget left (the rest in index order), with ties, non-finite logits,
    padding, vote weights, budgets from 1 to past E, and top-k and dense scores; the calls run the
    co-activation mode, its picks in every warp up to 128 experts."""

    with _selection_launches(warp_picks, monkeypatch) as launches:
        for case, (num_tokens, budget) in enumerate(
            itertools.product([1, 7, 33], [1, 5, num_experts // 2, num_experts + 3])
        ):
            path = _redundant_groups_file(tmp_path, num_experts, case)
            cfg = PrunerConfig(
                policy="moe-spec",
                max_experts=budget,
                ranking="coactivation",
                score=["topk", "probs"][case % 2],
                static_ranking_path=str(path),
            )
            router = [RouterSpec(8, renormalize=True), RouterSpec(4, "sigmoid", True)][case // 2 % 2]
            logits = make_logits(num_tokens, num_experts, ["integers", "normal", "nonfinite"][case % 3], case)
            label = f"E={num_experts} T={num_tokens} case={case} {cfg.summary()}"
            launches.clear()
            _assert_kernel_is_reference(logits, router, cfg, _edge_fields(num_tokens, case), label)
            assert [(k["RULE"].__name__, k["RULE_CONFIG"].WARP_PICKS) for k in launches] == [
                ("coactivation_rule", warp_picks and launches[0]["BLOCK_E"] <= 128)
            ], label


#: The co-activation keys' limit lowered to 64 tokens, over programs of several tiles: calls of 64 and
#: 65 rows take the paths of 4095 and 4097 rows under the production limits (programs of 16 + 16 +
#: 16 + 16 and 24 + 24 + 17 rows, as 128 x 32 and 102 x 40 + 17).
KEY_LIMITS = PlanLimits(max_parts=4, max_keyed_coact_tokens=64)


def test_coactivation_keys_end_at_4095_tokens(tmp_path) -> None:
    """The co-activation greedy takes each pick as the maximum of one packed key, gain << 10 | (1023 - e),
    in calls of up to 4095 tokens, where a gain (an aggregate of at most T * 2**24 times a factor of
    at most 2**16) is below 2**52 and the key below the 2**62 the warp maxima take (at 4096 tokens it
    would reach 2**62: one expert holding every row's mass was dropped there); above, as the gain and
    its index apart.  The plan switches the co-activation rule's ``KEYS`` off from the production limit + 1,
    or from a lowered limit + 1; the other rankings' rules have no such knob."""
    assert MAX_KEYED_COACT_TOKENS == PRODUCTION_LIMITS.max_keyed_coact_tokens == 4095
    assert (
        ((MAX_KEYED_COACT_TOKENS << 24 << REDUNDANCY_BITS) << 10 | 1023)
        < 2**62
        <= ((MAX_KEYED_COACT_TOKENS + 1) << 24 << REDUNDANCY_BITS) << 10
    )
    path = _calibration_file(tmp_path, num_layers=1, num_experts=128, seed=5)
    coact = PrunerConfig(policy="moe-spec", max_experts=24, ranking="coactivation", static_ranking_path=str(path))
    router_ranking = PrunerConfig(policy="moe-spec", max_experts=24)

    def keys(cfg, num_tokens, limits=PRODUCTION_LIMITS) -> bool:
        spec = CallSpec(num_tokens, 128, RouterSpec(8, renormalize=True), layer_id=0, limits=limits)
        (selection,) = [launch for launch in plan_call(cfg, spec).launches if launch.kernel == "select_kernel"]
        return selection.constexprs["RULE_CONFIG"]

    assert [keys(coact, t).KEYS for t in (1, 4095, 4096, 4097, 8192)] == [True, True, False, False, False]
    assert [keys(coact, t, KEY_LIMITS).KEYS for t in (1, 64, 65, 4097)] == [True, True, False, False]
    assert not hasattr(keys(router_ranking, 4097), "KEYS") and not hasattr(keys(router_ranking, 65, KEY_LIMITS), "KEYS")


@pytest.mark.fused_selection
@pytest.mark.parametrize("warp_picks", [True, False], ids=["warp_picks", "block_picks"])
@pytest.mark.parametrize("num_tokens", [64, 65])
def test_coactivation_keys_up_to_the_limit_and_not_above(tmp_path, num_tokens: int, warp_picks: bool, monkeypatch):
    """Up to the limit of ``max_keyed_coact_tokens`` tokens the co-activation greedy takes each pick as
    the maximum of one packed key, above it the gain and its index apart; at the limit (64 here, 4095 in
    production: the boundary and the keys' magnitude there are test_coactivation_keys_end_at_4095_tokens
    and test_kernel_primitives.py's test_coactivation_picks_hold_at_the_largest_aggregates) and one
    above, over several programs, the picks in every warp or block-wide, both equal the reference: one
    expert's probability close to 1 on every row, ties from integer logits, keep and routing."""

    num_experts = 128
    path = _calibration_file(tmp_path, num_layers=2, num_experts=num_experts, seed=5)
    cfg = PrunerConfig(policy="moe-spec", max_experts=24, ranking="coactivation", static_ranking_path=str(path))
    router = RouterSpec(8, renormalize=True)
    with _selection_launches(warp_picks, monkeypatch) as launches:
        for layer, style in enumerate(["normal", "integers"]):
            logits = make_logits(num_tokens, num_experts, style, num_tokens + layer)
            # every other row's mass on one expert, the rest's spread, so that redundancy decides the
            # picks after it; expert 93: a wrong pick is not hidden by the rest going to the lowest indices
            logits[::2, 3 + 90 * layer] = 40.0
            want = prune_route_reference(routing_call(logits, router, layer_id=layer), cfg)
            assert int(want.keep.sum()) == 24
            launches.clear()
            got = prune_route(routing_call(logits, router, device=DEVICE, layer_id=layer), cfg, limits=KEY_LIMITS)
            label = (num_tokens, style)
            config = [
                (k["RULE"].__name__, k["SINGLE"], k["RULE_CONFIG"].KEYS, k["RULE_CONFIG"].WARP_PICKS) for k in launches
            ]
            assert config == [("coactivation_rule", False, num_tokens <= 64, warp_picks)], label
            assert got.keep.cpu().tolist() == want.keep.tolist(), label
            assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label


@pytest.mark.fused_selection
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "budget", "top_k", "score", "style"),
    [
        (17, 128, 8, 8, None, "integers"),  # just above one register tile: the pair sums
        (33, 60, 60, 4, None, "repeated_rows"),  # the budget keeps every expert
        (48, 64, 12, 2, None, "few_finite"),  # short lists, rows that score nothing
        (200, 256, 40, 8, "probs", "normal"),  # dense scores: every row on nearly every list
        (1024, 128, 32, 8, None, "normal"),  # the kernels' largest T for coverage
        (96, 128, 24, 8, None, "repeated_rows"),  # popular experts: many rows add the same pairs
    ],
)
def test_coverage_above_one_tile_matches_reference(num_tokens, num_experts, budget, top_k, score, style) -> None:
    """Above one tile the coverage greedy keeps its gains up to date instead of recounting every row
    per pick: from the batch's pair sums with top-k scores, from per-expert row lists with dense
    scores.  The picks equal the reference's full recount."""
    cfg = PrunerConfig(policy="moe-spec", max_experts=budget, ranking="coverage", score=score)
    router = RouterSpec(top_k, renormalize=True)
    for layer in range(2):
        logits = make_logits(num_tokens, num_experts, style, num_tokens + layer)
        fields = dict(layer_id=layer, num_valid_tokens=num_tokens - 5 if layer else None)
        if layer:
            fields["token_weights"] = torch.rand(num_tokens, generator=torch.Generator().manual_seed(layer))
        want = prune_route_reference(routing_call(logits, router, **fields), cfg)
        got = prune_route(routing_call(logits, router, device=DEVICE, as_tensor=True, **fields), cfg)
        label = f"T={num_tokens} E={num_experts} budget={budget} layer={layer}"
        assert int(want.keep.sum()) == budget, label  # every pick taken
        assert got.keep.cpu().tolist() == want.keep.tolist(), label
        assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label


# ------------------------------------------------------------------------------ files and config errors


def test_file_round_trip_and_old_files_still_load(tmp_path) -> None:
    path = _calibration_file(tmp_path, num_layers=2, num_experts=16)
    doc = json.loads(path.read_text())
    assert len(doc["coactivation"]) == 2 and len(doc["coactivation"][0]) == 16
    assert len(doc["budget_curves"][1]) == 17 and doc["budget_curves"][1][-1] == pytest.approx(1.0)
    old = {k: doc[k] for k in ("format", "version", "counts")}
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(old))
    PrunerConfig(policy="moe-spec", max_experts=4, ranking="static", static_ranking_path=str(old_path))
    with pytest.raises(ValueError, match=r"budget_allocation='calibrated' needs a file with budget curves"):
        PrunerConfig(
            policy="moe-spec", max_experts=4, budget_allocation="calibrated", static_ranking_path=str(old_path)
        )
    with pytest.raises(ValueError, match=r"ranking='coactivation' needs a file with co-activation counts"):
        PrunerConfig(policy="moe-spec", max_experts=4, ranking="coactivation", static_ranking_path=str(old_path))
    bad = dict(doc, budget_curves=[[0.5] * 3] * 2)
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r'"budget_curves" must be a \[2\]\[17\] table'):
        PrunerConfig(policy="moe-spec", max_experts=4, ranking="static", static_ranking_path=str(bad_path))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(policy="xshare", budget_allocation="calibrated"), "only policy 'moe-spec' takes budget_allocation"),
        (dict(policy="moe-spec", max_experts=4, ranking="coactivation"), "static_ranking_path=None"),
        (dict(policy="moe-spec", max_experts=4, budget_allocation="calibrated"), "needs the calibration file"),
        (dict(policy="moe-spec", max_experts=4, budget_allocation="even"), "choose one of uniform, calibrated"),
        (dict(policy="moe-spec", max_experts=4, ranking="coactivation", scope="request"), "scope='request' needs"),
        (dict(policy="moe-spec", max_experts=4, ranking="coverage", scope="request"), "scope='request' needs"),
        (dict(policy="lynx", ranking="coverage"), "only policy 'moe-spec' takes ranking='coverage'"),
    ],
)
def test_config_errors_name_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        PrunerConfig(**kwargs)


def test_calibrated_budget_needs_the_layer(tmp_path) -> None:
    path = _calibration_file(tmp_path, num_layers=2, num_experts=16)
    cfg = PrunerConfig(policy="moe-spec", max_experts=4, budget_allocation="calibrated", static_ranking_path=str(path))
    with pytest.raises(ValueError, match="needs layer_id"):
        cfg.layer_budget(None)
    with pytest.raises(ValueError, match="outside the calibration file's 2 layers"):
        cfg.layer_budget(5)


def test_per_token_dump_gives_the_statistics(tmp_path) -> None:
    """SGLang's per_token records keep each pass's top-k ids (physical); replicas fold onto logical ids."""
    mapping = torch.tensor([[0, 1, 2, 3, 0], [0, 1, 2, 3, 3]])  # physical slot 4 replicates 0, then 3
    topk = torch.tensor([[[4, 1], [0, 2]], [[4, 1], [-1, -1]]])  # [layers, T, k]
    record = {"global_physical_count": torch.zeros(2, 5, dtype=torch.int64), "topk_ids_of_layer": topk}
    record["global_physical_count"][0, 4] = 1
    path = tmp_path / "expert_distribution_recorder_1700000000.0_0.pt"
    torch.save({"records": [record], "last_physical_to_logical_map": mapping}, path)
    counts = read_dump([path])
    assert counts.stats is not None
    pairs = counts.stats.coactivation.long()
    assert pairs[0, 0, 1] == 1 and pairs[0, 0, 2] == 1 and pairs[0, 0, 0] == 2
    assert pairs[1, 3, 1] == 1 and pairs[1].sum() == 4  # (3, 3), (1, 1), (3, 1), (1, 3)


def test_calibrate_from_trace_cli(tmp_path) -> None:
    """``xshare-sglang calibrate --from-trace`` writes a file both new settings load, and says how to use it."""
    meta = TraceMeta(model="tiny", num_layers=2, num_experts=16, top_k=2, expert_bytes=(1, 1))
    generator = torch.Generator().manual_seed(0)
    calls = [
        LayerCall(step, layer, "decode", torch.arange(8), logits=torch.randn(8, 16, generator=generator))
        for step in range(5)
        for layer in range(2)
    ]
    trace_path = Trace(meta, calls).save(tmp_path / "calls.pt")
    out = tmp_path / "calibration.json"
    done = subprocess.run(
        [sys.executable, "-m", "xshare_sglang", "calibrate", "--from-trace", str(trace_path), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "--moe-pruner-budget-allocation calibrated" in done.stdout
    cfg = PrunerConfig(
        policy="moe-spec",
        max_experts=4,
        ranking="coactivation",
        budget_allocation="calibrated",
        static_ranking_path=str(out),
    )
    assert sum(cfg.layer_budget(layer) for layer in range(2)) == 8
    assert cfg.static_ranking.counts[0] == tuple(float(c) for c in cfg.static_ranking.coactivation[0].diagonal())
    missing = subprocess.run(
        [sys.executable, "-m", "xshare_sglang", "calibrate", "--from-trace", str(tmp_path / "nope.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.fused_selection
@pytest.mark.parametrize("variant", ["coverage", "coactivation", "calibrated"])
def test_new_rankings_keep_the_launch_count(tmp_path, variant: str, monkeypatch) -> None:
    """One launch when the batch is one tile of rows (8 at E=128), two above, as for every other policy;
    the coverage ranking (top-k scores) takes two from five rows of a tile (``plan_for``)."""
    from xshare_sglang.kernels import jit

    path = str(_calibration_file(tmp_path, num_layers=2, num_experts=128))
    settings = {
        "coverage": {"ranking": "coverage"},
        "coactivation": {"ranking": "coactivation", "static_ranking_path": path},
        "calibrated": {"budget_allocation": "calibrated", "static_ranking_path": path},
    }[variant]
    cfg = PrunerConfig(policy="moe-spec", max_experts=24, **settings)
    launches = []
    launcher = type(jit.select_kernel)
    original_run = launcher.run

    def counting_run(self, *args, **kwargs):
        launches.append(getattr(self, "__name__", str(self)))
        return original_run(self, *args, **kwargs)

    monkeypatch.setattr(launcher, "run", counting_run)
    for num_tokens, expected in [(1, 1), (4, 1), (8, 2 if variant == "coverage" else 1), (9, 2), (32, 2), (255, 2)]:
        launches.clear()
        logits = make_logits(num_tokens, 128, "normal", seed=num_tokens).to(DEVICE)
        call = routing_call(logits, RouterSpec(8), layer_id=1)
        prune_route(call, cfg, metrics_row=torch.zeros(4, dtype=torch.int64, device=DEVICE))
        assert len(launches) == expected, (num_tokens, launches)
