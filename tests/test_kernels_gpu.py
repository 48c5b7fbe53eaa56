"""Fused selection kernels inside CUDA graphs (GPU only; skipped elsewhere).

Capture one pruned layer call (selection and routing) once at a fixed batch shape, replay several
times with new logits and new real-token counts, and compare every replay with the torch reference:
keep and ids exactly, weights within tolerance, metrics exactly, the workspace's counters back at 0
after every replay; no host syncs allowed (torch.cuda.set_sync_debug_mode("error")) and no
allocation per call.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

from tests.strategies import make_logits, routing_call
from xshare_sglang import PrunerConfig, select_experts_mask
from xshare_sglang.config import POLICIES as CONFIG_POLICIES
from xshare_sglang.kernels import SelectionWorkspace, prune_route, select_keep_mask
from xshare_sglang.policies.call import RouterSpec, RoutingCall
from xshare_sglang.policies.prune_route import prune_route as prune_route_reference

WEIGHT_TOLERANCE = dict(atol=2e-6, rtol=2e-5)

pytestmark = pytest.mark.gpu

# every policy that selects, the static ranking, and coverage (above one tile: pair sums added with
# atomics; with dense scores, row lists filled with atomics)
POLICIES = [p for p in CONFIG_POLICIES if p != "none"] + [
    "moe-spec-static",
    "moe-spec-coverage",
    "moe-spec-coverage-probs",
    "moe-spec-coact",
]


def _warm_up(step, repeats: int = 3) -> None:
    """Run ``step`` on a side stream first: JIT compilation and cached device copies happen here, not
    in the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(repeats):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture(step) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _replay_without_sync(graph: torch.cuda.CUDAGraph) -> None:
    """Replay with any host synchronisation an error, then wait for the device."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _config(policy: str, tmp_path, num_experts: int) -> PrunerConfig:
    if policy == "moe-spec-static":
        counts = [[float((e * 7 + layer) % 13) for e in range(num_experts)] for layer in range(3)]
        path = tmp_path / "ranking.json"
        path.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
        return PrunerConfig(policy="moe-spec", max_experts=24, ranking="static", static_ranking_path=str(path))
    if policy == "moe-spec-coact":
        # experts in pairs always picked together (redundancy 1.0), the rest partly: gains fall to zero
        pairs = [
            [[5 if i // 2 == j // 2 else (i * j + layer) % 3 for j in range(num_experts)] for i in range(num_experts)]
            for layer in range(3)
        ]
        counts = [[float(row[i]) for i, row in enumerate(layer)] for layer in pairs]
        path = tmp_path / "coactivation.json"
        doc = {"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts, "coactivation": pairs}
        path.write_text(json.dumps(doc))
        return PrunerConfig(policy="moe-spec", max_experts=24, ranking="coactivation", static_ranking_path=str(path))
    if policy == "moe-spec":
        return PrunerConfig(policy=policy, max_experts=24)
    if policy == "moe-spec-coverage":
        return PrunerConfig(policy="moe-spec", max_experts=24, ranking="coverage")
    if policy == "moe-spec-topk":
        return PrunerConfig(policy="moe-spec", max_experts=24, score="topk")
    if policy == "moe-spec-coverage-probs":
        return PrunerConfig(policy="moe-spec", max_experts=24, ranking="coverage", score="probs")
    return PrunerConfig(policy=policy, k0=1, budget=8, request_budget=2, rank_budget=3, max_experts=40)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "dtype"),
    # several programs at every shape (T=32, E=128: four programs of 8 rows)
    [(32, 128, torch.bfloat16), (128, 128, torch.bfloat16), (64, 160, torch.float32), (512, 256, torch.float16)],
)
def test_graph_capture_and_replay(policy, num_tokens, num_experts, dtype, tmp_path) -> None:
    _check_replays(_config(policy, tmp_path, num_experts), num_tokens, num_experts, dtype)


@pytest.mark.parametrize(("num_tokens", "num_experts", "dtype"), [(8, 128, torch.bfloat16), (5, 256, torch.float16)])
def test_graph_replay_of_a_split_coverage_tile(num_tokens, num_experts, dtype, tmp_path) -> None:
    """The coverage ranking on one tile of at least five rows runs as two programs (``plan_for``):
    its graph replays match the reference like every multi-program call's."""
    _check_replays(_config("moe-spec-coverage", tmp_path, num_experts), num_tokens, num_experts, dtype)


@pytest.mark.parametrize("warp_picks", [True, False], ids=["warp_picks", "block_picks"])
@pytest.mark.parametrize(
    ("policy", "num_tokens", "num_experts", "dtype"),
    [
        ("moe-spec-coact", 1, 128, torch.bfloat16),  # one program
        ("moe-spec-coact", 8, 256, torch.float16),
        ("moe-spec-coact", 64, 128, torch.bfloat16),  # the last of several programs
        ("moe-spec-coverage", 8, 128, torch.bfloat16),  # pair sums
        ("moe-spec-coverage", 64, 256, torch.float16),
    ],
)
def test_graph_replay_of_the_calibrated_picks(
    policy, num_tokens, num_experts, dtype, warp_picks, tmp_path, monkeypatch
) -> None:
    """The calibrated rankings' greedy picks, each warp on its own copy of the gains (warp-wide maxima
    only) or block-wide (above ``plan.WARP_PICKS_MAX_EXPERTS``, lowered here to reach the block-wide
    code on E=128 too): graph replays match the reference."""
    if not warp_picks:
        monkeypatch.setattr(importlib.import_module("xshare_sglang.kernels.plan"), "WARP_PICKS_MAX_EXPERTS", 0)
    _check_replays(_config(policy, tmp_path, num_experts), num_tokens, num_experts, dtype)


@pytest.mark.parametrize(
    ("policy", "num_tokens", "num_experts", "dtype"),
    [
        ("oea", 1, 128, torch.bfloat16),  # a light rule on one warp
        ("moe-spec-static", 2, 128, torch.float16),  # on two
        ("moe-spec-coact", 1, 128, torch.bfloat16),
        ("oea", 4, 64, torch.float32),  # on four: as many as a tile's
        ("moe-spec-static", 3, 60, torch.float16),
        ("moe-spec-coverage", 1, 128, torch.bfloat16),  # one row: the top-count, no order
        ("moe-spec-topk", 2, 128, torch.float32),  # T x top_k = 16 <= 24: no order
    ],
)
def test_graph_replay_of_one_program_on_a_warp_per_row(policy, num_tokens, num_experts, dtype, tmp_path) -> None:
    """``oea``, static moe-spec and the co-activation ranking on at most 128 experts run one-program
    calls of up to four rows on one warp per row: graph replays match the reference."""
    cfg = _config(policy, tmp_path, num_experts)
    if policy == "oea":
        cfg = dataclasses.replace(cfg, max_experts=None)  # a cap would order the experts: not a light rule
    _check_replays(cfg, num_tokens, num_experts, dtype)


@pytest.mark.parametrize(
    ("policy", "num_tokens", "dtype"),
    [
        ("none", 1, torch.float32),
        ("none", 1, torch.bfloat16),
        ("oea", 1, torch.float16),
        ("xshare", 1, torch.bfloat16),
        ("moe-spec", 1, torch.float32),
        ("moe-spec-coact", 1, torch.bfloat16),
        ("lynx", 1, torch.bfloat16),
        ("xshare-spec", 1, torch.float32),
        # above one program, and none or static moe-spec of 2 to 8 rows: the routing kernel, a program per row
        ("none", 3, torch.float32),
        ("none", 8, torch.bfloat16),
        ("moe-spec-static", 3, torch.float32),
        ("moe-spec-static", 8, torch.bfloat16),
        ("none", 40, torch.bfloat16),
        ("xshare", 40, torch.float32),
        ("lynx", 64, torch.bfloat16),
        ("xshare-spec", 40, torch.bfloat16),
        ("moe-spec", 256, torch.float16),  # the most rows that take a program each
        ("oea", 257, torch.bfloat16),  # tiles of 8 rows
    ],
)
def test_graph_replay_of_rows_on_a_warp_per_group(policy, num_tokens, dtype, tmp_path):
    """Rows of DeepSeek-V3's router (biased, 8 groups of 32 experts) route with a warp per group, in a
    one-row call and in the routing kernel above one program up to 256 rows: graph replays match the
    reference."""
    _check_replays(_config(policy, tmp_path, 256), num_tokens, 256, dtype)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="programmatic dependent launch needs compute capability 9.0+",
)
@pytest.mark.parametrize("policy", ["none", "xshare", "moe-spec", "lynx", "xshare-spec"])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "dtype"),
    # one program; the routing kernel after the selection; LYNX's picks between them
    [(1, 128, torch.bfloat16), (32, 128, torch.bfloat16), (512, 256, torch.float32)],
)
def test_dependent_launches_replay_like_the_reference(policy, num_tokens, num_experts, dtype, tmp_path) -> None:
    """``enable_pdl``: every kernel waits for the one before it on the device, and the selection lets
    the routing launch early; two calls back to back in one graph, every replay the reference's."""
    _check_replays(_config(policy, tmp_path, num_experts), num_tokens, num_experts, dtype, enable_pdl=True)


@pytest.mark.parametrize("policy", ["oea", "xshare", "moe-spec-static", "lynx", "xshare-spec"])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "dtype"),
    # one program; the routing kernel after the selection (its retained mass for oea and LYNX, alone
    # for static moe-spec); tiles of rows on DeepSeek-V3's E
    [(1, 128, torch.bfloat16), (32, 128, torch.bfloat16), (512, 256, torch.float32)],
)
def test_gated_metrics_replay_like_the_reference(policy, num_tokens, num_experts, dtype, tmp_path) -> None:
    """A metrics gate refilled before each replay (open, closed, in turn, as the server samples one
    forward in a few): every replay's mask and routing are the reference's, its metrics the
    reference's with the same gate (nothing while closed), the counters and visit words back at 0;
    launched as programmatic dependents where the GPU has them, as the server launches."""
    pdl = torch.cuda.get_device_capability()[0] >= 9
    _check_replays(_config(policy, tmp_path, num_experts), num_tokens, num_experts, dtype, pdl, gated=True)


def _check_replays(
    cfg: PrunerConfig, num_tokens: int, num_experts: int, dtype, enable_pdl: bool = False, gated: bool = False
) -> None:
    """Capture a layer call once (twice in a row with ``enable_pdl``: the second call's launches
    depend on the first's), replay with new logits and real-token counts, compare with the reference.
    ``gated``: the metrics row comes with a gate, open on even replays and closed on odd ones."""
    top_k, d = 8, 4
    ranks = (torch.arange(num_experts) // (-(-num_experts // 8))).cuda()
    logits = torch.empty(num_tokens, num_experts, device="cuda", dtype=dtype)
    bias = torch.randn(num_experts, device="cuda")
    num_valid = torch.tensor([num_tokens], device="cuda", dtype=torch.int32)
    keep = torch.empty(num_experts, dtype=torch.bool, device="cuda")
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device="cuda")
    weights = torch.empty(num_tokens, top_k, device="cuda")
    metrics = torch.zeros(4, dtype=torch.int64, device="cuda")
    gate = torch.ones(1, dtype=torch.int32, device="cuda") if gated else None
    workspace = SelectionWorkspace(num_experts, "cuda")
    router = RouterSpec(top_k, "sigmoid", True, 8, 4, 2.5)

    fields = dict(correction_bias=bias, tokens_per_request=d, expert_to_rank=ranks, layer_id=1)
    call = RoutingCall(logits, router, num_valid_tokens=num_valid, **fields)

    def step() -> None:
        for _ in range(2 if enable_pdl else 1):
            metrics.zero_()
            prune_route(
                call,
                cfg,
                keep_out=keep,
                ids_out=ids,
                weights_out=weights,
                metrics_row=metrics,
                metrics_gate=gate,
                workspace=workspace,
                enable_pdl=enable_pdl,
            )

    logits.copy_(make_logits(num_tokens, num_experts, "normal", seed=0).to(dtype))
    _warm_up(step)
    allocated = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated, "an eager call allocated memory"

    graph = _capture(step)

    for replay, real in enumerate([num_tokens, 1, 0, num_tokens // 2 + 3, num_tokens - 1]):
        fresh = make_logits(num_tokens, num_experts, ["normal", "integers", "nonfinite"][replay % 3], seed=replay + 1)
        logits.copy_(fresh.to(dtype))
        num_valid.fill_(real)
        metrics.zero_()
        if gate is not None:
            gate.fill_(1 - replay % 2)
        _replay_without_sync(graph)
        want_metrics = torch.zeros(4, dtype=torch.int64)
        want = prune_route_reference(
            routing_call(logits, router, device="cpu", num_valid_tokens=real, **fields),
            cfg,
            metrics_row=want_metrics,
            metrics_gate=None if gate is None else gate.cpu(),
        )
        label = f"replay {replay} ({real} real tokens)"
        assert keep.cpu().tolist() == want.keep.tolist(), label
        assert torch.equal(ids.cpu(), want.topk_ids), label
        torch.testing.assert_close(weights.cpu(), want.topk_weights, **WEIGHT_TOLERANCE)
        assert metrics.cpu().tolist() == want_metrics.tolist(), label
        # no call resets the counters first: each kernel's last program left them at 0 for the next
        left = workspace.counters.cpu()
        assert not left.any(), (label, left.nonzero().flatten().tolist()[:8])
        assert not workspace.visits.cpu().any(), label


@pytest.mark.parametrize("policy", POLICIES)
def test_eager_calls_never_sync(policy, tmp_path) -> None:
    num_tokens, num_experts = 96, 128
    cfg = _config(policy, tmp_path, num_experts)
    logits = make_logits(num_tokens, num_experts, "nonfinite", seed=4).cuda()
    ranks = (torch.arange(num_experts) // 16).cuda()
    num_valid = torch.tensor([90], device="cuda")
    kwargs = dict(top_k=8, tokens_per_request=3, num_valid_tokens=num_valid, expert_to_rank=ranks, layer_id=0)
    out = torch.empty(num_experts, dtype=torch.bool, device="cuda")
    select_keep_mask(RoutingCall.of(logits, **kwargs), cfg, out=out)  # compile, cache
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        select_keep_mask(RoutingCall.of(logits, **kwargs), cfg, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = select_experts_mask(logits.cpu(), cfg, **{**kwargs, "num_valid_tokens": 90, "expert_to_rank": ranks.cpu()})
    assert out.cpu().tolist() == want.tolist()


@pytest.mark.parametrize(
    "cfg",
    [
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=2, budget=2, depth_decay=0.6),
        PrunerConfig(policy="moe-spec", max_experts=16, scope="request", depth_decay=0.8),
        PrunerConfig(policy="xshare", k0=1, budget=8, depth_decay=0.5),
    ],
    ids=lambda c: f"{c.policy}-{c.scope}",
)
def test_verify_votes_replay_in_a_cuda_graph(cfg) -> None:
    """The plugin's verify path inside one captured graph: depths from static positions, vote weights
    from a static acceptable-node buffer, selection and routing rewrite; each replay gets new
    positions, cut nodes, logits and real-request counts, and is compared with the reference."""
    from xshare_sglang.spec import draft_depths, vote_weights

    bs, d, num_experts, top_k = 16, 8, 128, 8
    num_tokens = bs * d
    logits = torch.zeros(num_tokens, num_experts, device="cuda")
    positions = torch.zeros(num_tokens, dtype=torch.int64, device="cuda")
    acceptable = torch.ones(num_tokens, dtype=torch.bool, device="cuda")
    num_valid = torch.tensor([num_tokens], dtype=torch.int32, device="cuda")
    keep = torch.empty(num_experts, dtype=torch.bool, device="cuda")
    ids = torch.zeros(num_tokens, top_k, dtype=torch.int32, device="cuda")
    topk_weights = torch.zeros(num_tokens, top_k, device="cuda")
    workspace = SelectionWorkspace(num_experts, "cuda")
    router = RouterSpec(top_k)

    def step():
        weights = vote_weights(draft_depths(positions, d), cfg.depth_decay, acceptable)
        call = RoutingCall(logits, router, tokens_per_request=d, num_valid_tokens=num_valid, token_weights=weights)
        prune_route(call, cfg, keep_out=keep, ids_out=ids, weights_out=topk_weights, workspace=workspace)

    _warm_up(step)
    graph = _capture(step)
    gen = torch.Generator().manual_seed(0)
    for replay, real_bs in enumerate([16, 9, 3, 1, 12]):
        new_logits = make_logits(num_tokens, num_experts, "normal", seed=replay)
        depth = torch.randint(0, d, (bs, d), generator=gen)
        depth[:, 0] = 0
        new_positions = (torch.randint(5, 500, (bs, 1), generator=gen) + depth).reshape(-1)
        new_acceptable = torch.rand(num_tokens, generator=gen) > 0.2
        logits.copy_(new_logits)
        positions.copy_(new_positions)
        acceptable.copy_(new_acceptable)
        num_valid.fill_(real_bs * d)
        _replay_without_sync(graph)
        want_weights = vote_weights(draft_depths(new_positions, d), cfg.depth_decay, new_acceptable)
        want = prune_route_reference(
            RoutingCall(
                new_logits, router, tokens_per_request=d, num_valid_tokens=real_bs * d, token_weights=want_weights
            ),
            cfg,
        )
        assert keep.cpu().tolist() == want.keep.tolist(), f"replay {replay} ({real_bs} real requests)"
        assert torch.equal(ids.cpu(), want.topk_ids)
        torch.testing.assert_close(topk_weights.cpu(), want.topk_weights, **WEIGHT_TOLERANCE)
        assert (ids[real_bs * d :] == -1).all()


@pytest.mark.parametrize("spelling", ["cuda", "cuda:0", torch.device("cuda")])
def test_every_spelling_of_the_device_serves_cuda0_tensors(spelling) -> None:
    """A workspace made for "cuda", "cuda:0" or torch.device("cuda") serves logits on cuda:0 (the first
    GPU run failed every benchmark row on this)."""
    logits = make_logits(40, 128, "normal", seed=3).cuda()
    cfg = PrunerConfig(policy="xshare", k0=1, budget=8)
    got = prune_route(routing_call(logits, 8), cfg, workspace=SelectionWorkspace(128, spelling))
    want = prune_route_reference(routing_call(logits.cpu(), 8), cfg)
    assert torch.equal(got.keep.cpu(), want.keep) and torch.equal(got.topk_ids.cpu(), want.topk_ids)


def test_two_streams_get_two_workspaces() -> None:
    """Calls issued on two streams at once use two workspaces, so neither can take the other's tickets;
    both give the reference's answer."""
    from xshare_sglang.kernels.plan import default_workspace

    cfg = PrunerConfig(policy="xshare", k0=1, budget=8)
    side = torch.cuda.Stream()
    main_ws = default_workspace(128, "cuda")
    with torch.cuda.stream(side):
        side_ws = default_workspace(128, "cuda")
    assert side_ws is not main_ws
    inputs = [make_logits(256, 128, "normal", seed=s).cuda() for s in (4, 5)]
    torch.cuda.synchronize()
    results = []
    for _ in range(20):  # both streams busy with multi-program calls at the same time
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            on_side = prune_route(routing_call(inputs[1], 8), cfg)
        on_main = prune_route(routing_call(inputs[0], 8), cfg)
        torch.cuda.current_stream().wait_stream(side)
        results.append((on_main, on_side))
    torch.cuda.synchronize()
    for logits, index in ((inputs[0], 0), (inputs[1], 1)):
        want = prune_route_reference(routing_call(logits.cpu(), 8), cfg)
        for pair in results:
            assert torch.equal(pair[index].keep.cpu(), want.keep)
            assert torch.equal(pair[index].topk_ids.cpu(), want.topk_ids)
