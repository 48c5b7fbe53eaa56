"""No host synchronisation and no host-to-device copy on any path a server runs per step, checked on
the CPU with :class:`~xshare_sglang.testing.host_sync.HostSyncDetector`.

The detector is checked first (each kind of operation it must flag, and the graph-safe operations it
must not), then run around every policy's torch reference (the CPU path, and the GPU fallback of the
kernels), the plugin runtime's eager per-layer path (fused and masked) and an ECHO scheduling step.
On a GPU the same paths run under ``torch.cuda.set_sync_debug_mode("error")`` and CUDA-graph
capture (``tests/test_gpu_reference.py``, ``tests/test_echo_gpu.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.strategies import make_logits
from xshare_sglang import POLICIES, PrunerConfig
from xshare_sglang.policies.api import select
from xshare_sglang.policies.apply import mask_router_inputs
from xshare_sglang.policies.call import RouterSpec, RoutingCall
from xshare_sglang.policies.moe_spec import layer_redundancy, static_positions
from xshare_sglang.policies.prune_route import prune_route
from xshare_sglang.policies.rewrite import rewrite_routing
from xshare_sglang.testing.host_sync import HostSyncDetector, HostSyncError

NUM_TOKENS, NUM_EXPERTS, TOP_K, D = 12, 64, 8, 4


# ----------------------------------------------------------------------------------- the detector


@pytest.mark.parametrize(
    ("expected", "step"),
    [
        ("Tensor.item", lambda x: x[0].item()),
        ("Tensor.tolist", lambda x: x.tolist()),
        ("bool(tensor)", lambda x: bool(x[0] > 0)),
        ("int(tensor)", lambda x: int(x[1])),
        ("float(tensor)", lambda x: float(x[1])),
        ("tensor used as a Python index", lambda x: range(x[2])),
        ("torch.as_tensor of host data", lambda x: torch.as_tensor(3, device=x.device)),
        ("torch.tensor of host data", lambda x: torch.tensor([1, 2])),
        ("a Python value written into a tensor by indexing", lambda x: x.clone().__setitem__(-1, 1)),
        ("boolean-mask indexing (read)", lambda x: x[x > 1]),
        ("boolean-mask indexing (write)", lambda x: x.clone().__setitem__(x > 1, x[0])),
        ("aten.nonzero", lambda x: x.nonzero()),
        ("torch.where with one argument", lambda x: torch.where(x > 1)),
        ("aten._unique2", lambda x: torch.unique(x)),
        ("repeat_interleave with tensor repeats and no output_size", lambda x: torch.repeat_interleave(x, x)),
        ("torch.equal", lambda x: torch.equal(x, x)),
        ("Tensor.cpu", lambda x: x.cpu()),
    ],
)
def test_detector_flags_each_kind_of_sync(expected, step) -> None:
    x = torch.arange(5)
    with HostSyncDetector() as detector:
        step(x)
    assert detector.findings, f"{expected} was not flagged"
    assert detector.findings[0].operation == expected, detector.report()
    assert "test_host_sync.py" in detector.findings[0].where


def test_detector_passes_graph_safe_operations() -> None:
    x = torch.arange(6, dtype=torch.float32)
    mask = x > 2
    with HostSyncDetector() as detector:
        y = torch.where(mask, x, 0.0)
        y = y.masked_fill(~mask, -1.0)
        y.fill_(0.5)
        z = torch.full((3,), 7, dtype=torch.int64)
        z = z.index_select(0, torch.arange(2))
        torch.zeros(4).scatter_(0, torch.tensor([1]) if False else torch.arange(2), 1.0)
        x.clone()[torch.arange(2)] = x[:2]  # integer-tensor indexing with a tensor value
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.int64), output_size=6)
        x.argmax(), x.sum(), x.topk(2)
    assert not detector.findings, detector.report()


def test_detector_can_raise_at_the_first_finding() -> None:
    with pytest.raises(HostSyncError, match=r"Tensor\.item"), HostSyncDetector(raise_on_first=True):
        torch.ones(1).item()


def test_one_finding_per_operation_and_place() -> None:
    x = torch.arange(3)
    with HostSyncDetector() as detector:
        for _ in range(3):
            x[0].item()  # one place, three times: one finding, no aten-level repeat
    assert [f.operation for f in detector.findings] == ["Tensor.item"]
    assert detector.flags == 3


# ---------------------------------------------------------------------------- the policies' path


def _ranking_file(tmp_path) -> str:
    path = tmp_path / "ranking.json"
    counts = [[float((e * 7 + layer) % 13) for e in range(NUM_EXPERTS)] for layer in range(3)]
    pairs = [
        [[9.0 if i == j else float((i * j + layer) % 5) for j in range(NUM_EXPERTS)] for i in range(NUM_EXPERTS)]
        for layer in range(3)
    ]
    path.write_text(
        json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts, "coactivation": pairs})
    )
    return str(path)


def _configs(tmp_path) -> dict[str, PrunerConfig]:
    ranking = _ranking_file(tmp_path)
    configs = {
        policy: PrunerConfig(policy=policy, k0=1, budget=8, request_budget=2, rank_budget=3, max_experts=40)
        for policy in POLICIES
        if policy != "moe-spec"
    }
    configs["moe-spec"] = PrunerConfig(policy="moe-spec", max_experts=24)
    configs["moe-spec-request"] = PrunerConfig(policy="moe-spec", max_experts=4, scope="request")
    configs["moe-spec-coverage"] = PrunerConfig(policy="moe-spec", max_experts=16, ranking="coverage")
    for ranking_name in ("static", "coactivation"):
        configs[f"moe-spec-{ranking_name}"] = PrunerConfig(
            policy="moe-spec", max_experts=16, ranking=ranking_name, static_ranking_path=ranking
        )
    configs["xshare-token-range"] = PrunerConfig(policy="xshare", k0=1, budget=8, min_tokens=2, max_tokens=50)
    configs["xshare-truncation"] = PrunerConfig(policy="xshare", k0=1, budget=8, coverage="truncation")
    return configs


ROUTERS = {
    "softmax": RouterSpec(TOP_K, "softmax"),
    "grouped-sigmoid-biased": RouterSpec(TOP_K, "sigmoid", True, 8, 4, 2.5),
}
CONFIG_NAMES = [
    *[p for p in POLICIES if p != "moe-spec"],
    "moe-spec",
    "moe-spec-request",
    "moe-spec-coverage",
    "moe-spec-static",
    "moe-spec-coactivation",
    "xshare-token-range",
    "xshare-truncation",
]


def _warm(cfg: PrunerConfig, device) -> None:
    """What the runtime does once before serving: calibration tables copied to the device."""
    if cfg.policy == "moe-spec" and cfg.ranking in ("static", "coactivation"):
        static_positions(cfg, 1, device)
        if cfg.ranking == "coactivation":
            layer_redundancy(cfg, 1, device)


@pytest.mark.parametrize("router_name", list(ROUTERS))
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_policy_reference_path_never_synchronises(name, router_name, tmp_path) -> None:
    """Selection, routing, the metrics rewrite and the logit mask of one layer call, as a CUDA graph
    replays them: real-token count and vote weights on the device, expert ranks, a correction bias."""
    cfg = _configs(tmp_path)[name]
    router = ROUTERS[router_name]
    logits = make_logits(NUM_TOKENS, NUM_EXPERTS, "nonfinite", seed=3)
    num_valid = torch.tensor([NUM_TOKENS - 3], dtype=torch.int32)
    bias = torch.randn(NUM_EXPERTS) if router.scoring == "sigmoid" else None
    weights = torch.rand(NUM_TOKENS)
    ranks = torch.arange(NUM_EXPERTS) // 8
    _warm(cfg, logits.device)
    with HostSyncDetector() as detector:
        call = RoutingCall(
            logits,
            router,
            tokens_per_request=D,
            num_valid_tokens=num_valid,
            expert_to_rank=ranks,
            layer_id=1,
            token_weights=weights,
            correction_bias=bias,
        )
        routed = prune_route(call, cfg, metrics_row=torch.zeros(4, dtype=torch.int64))
        keep, _ = select(call, cfg)
        ids, wts = routed.topk_ids.clone(), routed.topk_weights.clone()
        rewrite_routing(
            ids,
            wts,
            keep,
            num_valid_tokens=num_valid,
            metrics_row=torch.zeros(4, dtype=torch.int64),
            stats=torch.zeros(2, dtype=torch.int64),
            token_weights=weights,
        )
        mask_router_inputs(logits.clone(), keep, bias=bias)
    assert not detector.findings, detector.report()


# ------------------------------------------------------------------------- the runtime's eager path


def _topk_configs():
    from sglang.srt.layers.moe.topk import TopKConfig

    from tests.sglang_helpers import deepseek_topk_config

    bias = torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(5)) * 0.1
    return {
        "fused-softmax": TopKConfig(top_k=TOP_K, renormalize=True, scoring_func="softmax", layer_id=0),
        "fused-grouped": deepseek_topk_config(top_k=TOP_K, layer_id=1, correction_bias=bias),
        "masked-custom": TopKConfig(
            top_k=TOP_K, renormalize=True, scoring_func="softmax", custom_routing_function=lambda *a: None, layer_id=2
        ),
    }


@pytest.mark.sglang
@pytest.mark.parametrize("phase", ["decode", "verify"])
@pytest.mark.parametrize("pruner", ["xshare", "xshare-ep", "moe-spec", "lynx"])
def test_runtime_eager_path_never_synchronises(pruner, phase) -> None:
    """The per-layer steps the routing hooks run: begin_call, then the fused path (route) or the masked
    path (select_and_mask, then SGLang's router, then rewrite), with the layer's metrics."""
    from xshare_sglang.sglang_plugin.model_layers import make_layer_state, make_runtime
    from xshare_sglang.sglang_plugin.runtime import ForwardScope
    from xshare_sglang.sglang_plugin.settings import PluginSettings

    cfg = PrunerConfig(policy=pruner, k0=1, budget=8, rank_budget=3, max_experts=24)
    configs = _topk_configs()
    states = {
        id(config): make_layer_state(config, layer_id=config.layer_id, row=row, num_experts=NUM_EXPERTS, device="cpu")
        for row, config in enumerate(configs.values())
    }
    for state in states.values():
        state.expert_to_rank = torch.arange(NUM_EXPERTS, dtype=torch.int32) // 8
    runtime = make_runtime(PluginSettings(pruner=cfg), states, "cpu")
    runtime.num_valid_buffer.fill_(NUM_TOKENS - 2)
    d = D if phase == "verify" else 1
    vote_weights = torch.rand(NUM_TOKENS)
    scope = ForwardScope(
        phase=phase,
        tokens_per_request=d,
        num_valid=runtime.num_valid_buffer,
        cfg=cfg,
        weights_source=(lambda: vote_weights) if phase == "verify" else None,
    )
    logits = make_logits(NUM_TOKENS, NUM_EXPERTS, "nonfinite", seed=11)
    runtime.enter(scope)
    with HostSyncDetector() as detector:
        for config in configs.values():
            call = runtime.begin_call(config, None)
            assert call is not None
            layer_logits = logits.clone()
            if call.layer.router is not None:
                routed = runtime.route(call, layer_logits, config.correction_bias)
                assert routed is not None
            else:
                masked, _ = runtime.select_and_mask(call, layer_logits, None)
                ids = torch.topk(masked, TOP_K, dim=-1).indices.to(torch.int32)  # SGLang's router stands here
                runtime.rewrite(call, ids, torch.ones(NUM_TOKENS, TOP_K))
            runtime.end_call()
    runtime.leave(None)
    assert runtime.faults == 0
    assert int(runtime.metrics[..., 0].sum()) > 0  # every layer call was counted
    assert not detector.findings, detector.report()


# ------------------------------------------------------------------------------ an ECHO step


def test_echo_scheduling_step_never_synchronises(tmp_path) -> None:
    """Stash, confidence, schedule, node allocation, verify slots and the tree cut of one step."""
    from tests.test_echo_gpu import DRAFT_TOKENS, STEPS, TOPK, _lists, warm_scheduler
    from xshare_sglang.spec.echo import cut_tree

    batch = 8
    runtime, index, _ = warm_scheduler(tmp_path, batch, "cpu")
    lists = _lists(batch, seed=8, device="cpu")
    with HostSyncDetector() as detector:
        runtime.stash(*lists)
        plan = runtime.plan(batch, num_steps=STEPS, topk=TOPK, num_draft_tokens=DRAFT_TOKENS, top_scores_index=index)
        links = torch.full((batch, DRAFT_TOKENS), -1, dtype=torch.int64)
        cut_tree(links, links.clone(), plan.kept)
    assert runtime.faults == 0 and plan is not None and plan.kept is not None
    assert not detector.findings, detector.report()
    assert runtime.summary()["requests"] == 2 * batch


def test_verify_vote_weights_never_synchronise() -> None:
    """What every pruned verify forward computes before its layers: draft depths from the positions,
    the nodes the tree links let a root reach, and the vote weights (eagerly, and recorded into verify
    graphs)."""
    from xshare_sglang.spec import acceptable_nodes, draft_depths, vote_weights

    positions = torch.tensor([10, 11, 11, 12, 20, 21, 22, 22, 5, 6, 6, 6])
    next_token = torch.tensor([[1, 3, -1, -1], [1, 2, -1, -1], [1, -1, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1], [-1, -1, 3, -1], [-1, 2, 3, -1]])
    with HostSyncDetector() as detector:
        depths = draft_depths(positions, D)
        acceptable = acceptable_nodes(next_token, next_sibling).reshape(-1)
        weights = vote_weights(depths, 0.7, acceptable)
    assert not detector.findings, detector.report()
    assert weights[0] == 1.0 and weights[3] == pytest.approx(0.49)  # a root, and a node at depth 2
