"""Speculative verify in the plugin: per-phase configs, and SGLang's own ``select_experts`` under a
published verify scope (eager forwards, and the scope a verify CUDA graph is captured with)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from tests import brute_force
from tests.test_sglang_context import _init, _model, _runner, _topk_config, plugin_env  # noqa: F401
from xshare_sglang import PrunerConfig, select_experts_mask
from xshare_sglang.sglang_plugin.flags import add_flags, settings_from_args
from xshare_sglang.sglang_plugin.settings import ENV_VAR, PluginSettings
from xshare_sglang.spec import vote_weights

NUM_EXPERTS, TOP_K, D = 32, 4, 4
VERIFY = {"policy": "xshare-spec", "k0": 1, "request_budget": 1, "budget": 0}


def test_phase_overrides_resolve_per_phase() -> None:
    settings = PluginSettings.from_dict({"policy": "xshare", "k0": 2, "budget": 6, "verify": VERIFY})
    assert settings.config_for("decode") == PrunerConfig(policy="xshare", k0=2, budget=6)
    assert settings.config_for("verify") == PrunerConfig(**VERIFY)
    assert settings.config_for("extend") is None  # not a pruned phase
    assert PluginSettings.from_dict(json.loads(settings.to_json())) == settings
    assert "| verify: policy=xshare-spec k0=1 request_budget=1 budget=0" in settings.summary()
    # fields the override leaves out come from the top level
    inherited = PluginSettings.from_dict({"policy": "xshare", "k0": 1, "verify": {"policy": "oea"}})
    assert inherited.config_for("verify") == PrunerConfig(policy="oea", k0=1)
    # verify-only pruning: the top-level policy is none, the plugin is still on
    verify_only = PluginSettings.from_dict({"verify": {"policy": "moe-spec", "max_experts": 8}})
    assert verify_only.enabled and verify_only.config_for("decode") is None
    assert not PluginSettings.from_dict({"policy": "xshare", "verify": {"policy": "none"}}).config_for("verify")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"policy": "xshare", "prefill": {"k0": 1}}, "no field(s) 'prefill'"),
        ({"policy": "xshare", "phases": ["decode"], "verify": {"k0": 1}}, "which is not pruned"),
        ({"policy": "xshare", "verify": {"phases": ["verify"]}}, "set the pruned phases at the top level"),
        ({"policy": "xshare", "verify": {"bugdet": 1}}, "verify phase: PrunerConfig has no field(s) 'bugdet'"),
        ({"policy": "xshare", "verify": ["xshare-spec"]}, "verify: must be an object"),
    ],
)
def test_phase_overrides_are_validated(data, message) -> None:
    with pytest.raises(ValueError) as info:
        PluginSettings.from_dict(data)
    assert message in str(info.value)


def test_verify_flag_overrides_only_the_verify_policy() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(
        [
            *("--moe-pruner", "xshare", "--moe-pruner-budget", "5", "--moe-pruner-verify", "moe-spec"),
            *("--moe-pruner-max-experts", "16", "--moe-pruner-scope", "request", "--moe-pruner-depth-decay", "0.7"),
        ]
    )
    settings = settings_from_args(args, None)
    decode, verify = settings.config_for("decode"), settings.config_for("verify")
    assert (decode.policy, decode.budget, decode.max_experts) == ("xshare", 5, 16)
    assert (verify.policy, verify.max_experts, verify.scope, verify.depth_decay) == ("moe-spec", 16, "request", 0.7)
    # the flag only: verify pruned, decode left alone
    only = settings_from_args(parser.parse_args(["--moe-pruner-verify", "oea"]), None)
    assert only.enabled and only.config_for("decode") is None and only.config_for("verify").policy == "oea"


def _verify_batch(num_requests: int, cut_request: int | None = None):
    """An EAGLE verify ForwardBatch stand-in: trees root 0 -> {1, 2}, 1 -> 3 (depths 0, 1, 1, 2), the
    sibling link 1 -> 2 removed in ``cut_request`` (node 2 cut from its tree)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    next_token = torch.tensor([[1, 3, -1, -1]] * num_requests)
    next_sibling = torch.tensor([[-1, 2, -1, -1]] * num_requests)
    if cut_request is not None:
        next_sibling[cut_request, 1] = -1
    seq_lens = torch.arange(num_requests) * 10 + 7
    positions = (seq_lens[:, None] + torch.tensor([0, 1, 1, 2])).reshape(-1)
    spec_info = SimpleNamespace(
        draft_token_num=D, retrieve_next_token=next_token, retrieve_next_sibling=next_sibling, ragged_verify_layout=None
    )
    return SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec_info, positions=positions)


def _weights(num_requests: int, decay: float | None, cut_request: int | None) -> list[float]:
    depth_weight = [1.0, 1.0, 1.0, 1.0] if decay is None else [1.0, decay, decay, decay**2]
    weights = depth_weight * num_requests
    if cut_request is not None:
        weights[cut_request * D + 2] = 0.0
    return weights


def _select(config, logits):
    from sglang.srt.layers.moe import topk

    out = topk.select_experts(
        hidden_states=torch.zeros(logits.shape[0], 8), router_logits=logits.clone(), topk_config=config, layer_id=0
    )
    return out.topk_ids.clone(), out.topk_weights.clone()


@pytest.mark.parametrize("decay", [None, 0.5])
def test_eager_verify_forward_prunes_per_request(plugin_env, monkeypatch, decay) -> None:  # noqa: F811
    """xshare at decode, xshare-spec at verify: the verify call keeps every voting node's top-1 and
    each request's best other expert, by the weighted votes; the cut node routes nowhere."""
    from xshare_sglang.sglang_plugin.hooks import model_runner_forward_raw

    verify = {**VERIFY, "depth_decay": decay} if decay is not None else dict(VERIFY)
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "xshare", "k0": 1, "budget": 2, "verify": verify}))
    config = _topk_config()
    runner = _runner(_model(config))
    runtime = _init(runner)
    num_requests, cut = 3, (1 if decay is not None else None)
    logits = torch.randn(num_requests * D, NUM_EXPERTS, generator=torch.Generator().manual_seed(4)) * 2
    seen = {}

    def original(self, forward_batch):
        seen["routing"] = _select(config, logits)
        seen["keep"] = runtime.layers[id(config)].keep.clone()

    model_runner_forward_raw.hook(original, runner, _verify_batch(num_requests, cut))
    ids, weights = seen["routing"]
    keep = seen["keep"]
    vote = _weights(num_requests, decay, cut)
    cfg = PrunerConfig(**verify)
    assert keep.tolist() == brute_force.select(logits, cfg, top_k=TOP_K, tokens_per_request=D, token_weights=vote)
    # by the letter of XShare Alg. 4 with request_budget 1: each voting node's top-1, plus per
    # request the highest weighted aggregate outside its warm-up
    probs = torch.softmax(logits.double(), dim=1)
    top = probs.topk(TOP_K, dim=1)
    scores = torch.zeros_like(probs).scatter(1, top.indices, top.values / top.values.sum(1, keepdim=True))
    scores = scores * torch.tensor(vote, dtype=torch.float64)[:, None]
    for r in range(num_requests):
        rows = [t for t in range(r * D, (r + 1) * D) if vote[t] > 0]
        warm = {int(logits[t].argmax()) for t in rows}
        assert all(keep[e] for e in warm)
        aggregate = scores[rows].sum(dim=0)
        best = max((e for e in range(NUM_EXPERTS) if e not in warm), key=lambda e: (aggregate[e], -e))
        assert keep[best]
    assert keep.sum() < NUM_EXPERTS
    routed = ids[ids >= 0].long()
    assert keep[routed].all()
    if cut is not None:
        assert (ids[cut * D + 2] == -1).all() and (weights[cut * D + 2] == 0).all()
    assert (ids[torch.tensor(vote) > 0] >= 0).any(dim=1).all()
    # the same runtime prunes a decode forward with the decode policy
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    decode_batch = SimpleNamespace(forward_mode=ForwardMode.DECODE, spec_info=None)
    model_runner_forward_raw.hook(original, runner, decode_batch)
    want = select_experts_mask(logits, PrunerConfig(policy="xshare", k0=1, budget=2), top_k=TOP_K)
    assert torch.equal(seen["keep"], want)


@pytest.mark.parametrize(("bs", "raw_bs", "cut"), [(4, 4, None), (4, 2, 0), (8, 5, 4), (2, 1, 0)])
def test_verify_graph_scope_groups_and_pads(plugin_env, monkeypatch, bs, raw_bs, cut) -> None:  # noqa: F811
    """The scope a verify graph is captured with: D from the captured width, real tokens raw_bs * D
    from the load_batch hook, cut nodes from the refilled buffer; padded requests route to -1."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from xshare_sglang.sglang_plugin.hooks import decode_graph_load_batch
    from xshare_sglang.sglang_plugin.hooks.model_runner_init import capture_head

    verify = {**VERIFY, "depth_decay": 0.5}
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "xshare", "k0": 1, "budget": 2, "verify": verify}))
    config = _topk_config()
    runner = _runner(_model(config))
    runtime = _init(runner)
    graph_runner = SimpleNamespace(
        model_runner=runner, capture_forward_mode=ForwardMode.TARGET_VERIFY, captured_req_width=D
    )
    real = _verify_batch(raw_bs, cut)
    # SGLang's replay copies the real batch into the static buffers, padding positions with zeros
    static_positions = torch.zeros(bs * D, dtype=torch.int64)
    static_positions[: raw_bs * D] = real.positions
    # the load_batch hook runs before the replay; the captured ops then read the buffers it filled
    graph_runner.bs, graph_runner.raw_bs, graph_runner.raw_num_token = bs, raw_bs, raw_bs * D
    runtime.acceptable_buffers[bs * D] = torch.ones(bs * D, dtype=torch.bool)
    decode_graph_load_batch.hook(None, graph_runner, real)
    assert runtime.num_valid_buffer.item() == raw_bs * D
    want_acceptable = torch.ones(bs * D, dtype=torch.bool)
    if cut is not None:
        want_acceptable[cut * D + 2] = False
    assert torch.equal(runtime.acceptable_buffers[bs * D], want_acceptable)
    # on CPU the "recorded" weight ops run once, here, from the buffers as refilled above; the load_batch
    # hook then runs again as before a replay (the capture's warm-up set every row real).  A GPU test
    # replays a captured graph for real (tests/test_kernels_gpu.py).
    capture_head(graph_runner, SimpleNamespace(input_ids=torch.zeros(bs * D), positions=static_positions))
    assert runtime.num_valid_buffer.item() == bs * D
    decode_graph_load_batch.hook(None, graph_runner, real)
    scope = runtime.scope
    assert (scope.phase, scope.tokens_per_request, scope.cfg.policy) == ("verify", D, "xshare-spec")
    expected_weights = _weights(raw_bs, 0.5, cut) + [1.0] * ((bs - raw_bs) * D)
    assert scope.token_weights.tolist() == expected_weights
    logits = torch.randn(bs * D, NUM_EXPERTS, generator=torch.Generator().manual_seed(bs + raw_bs)) * 2
    ids, _ = _select(config, logits)
    keep = runtime.layers[id(config)].keep
    vote = _weights(raw_bs, 0.5, cut) + [0.0] * ((bs - raw_bs) * D)
    assert keep.tolist() == brute_force.select(
        logits,
        PrunerConfig(**verify),
        top_k=TOP_K,
        tokens_per_request=D,
        num_valid_tokens=raw_bs * D,
        token_weights=vote,
    )
    assert (ids[raw_bs * D :] == -1).all()  # padded requests
    assert keep[ids[ids >= 0].long()].all()
    if cut is not None:
        assert (ids[cut * D + 2] == -1).all()


def test_weights_match_the_spec_helpers() -> None:
    """The weights the tests above write by hand are the package's own for these trees."""
    batch = _verify_batch(2, cut_request=1)
    from xshare_sglang.sglang_plugin.verify_scope import tree_acceptable
    from xshare_sglang.spec import draft_depths

    acceptable = tree_acceptable(batch.spec_info, 2, D)
    got = vote_weights(draft_depths(batch.positions, D), 0.5, acceptable)
    assert got.tolist() == _weights(2, 0.5, 1)


def test_ragged_verify_is_left_unpruned(plugin_env, monkeypatch, caplog) -> None:  # noqa: F811
    from xshare_sglang.sglang_plugin.verify_scope import eager_scope

    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "xshare", "verify": VERIFY}))
    runtime = _init(_runner(_model(_topk_config())))
    batch = _verify_batch(2)
    batch.spec_info.ragged_verify_layout = object()
    scope = eager_scope(runtime, batch)
    assert scope.phase == "verify" and scope.cfg is None


def test_a_broken_verify_input_leaves_the_forward_unpruned(plugin_env, monkeypatch) -> None:  # noqa: F811
    """Tree links of the wrong shape: the vote weights fail at the first layer call, which is counted
    as a fault, and the forward routes exactly as SGLang alone would."""
    from xshare_sglang.sglang_plugin.hooks import model_runner_forward_raw

    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "xshare", "verify": {**VERIFY, "depth_decay": 0.5}}))
    config = _topk_config()
    runner = _runner(_model(config))
    runtime = _init(runner)
    batch = _verify_batch(2)
    batch.spec_info.retrieve_next_token = torch.full((2, D + 1), -1)
    logits = torch.randn(2 * D, NUM_EXPERTS, generator=torch.Generator().manual_seed(9))
    seen = {}

    def original(self, forward_batch):
        seen["routing"] = _select(config, logits)

    model_runner_forward_raw.hook(original, runner, batch)
    assert runtime.faults == 1
    ids, _ = seen["routing"]
    want = torch.softmax(logits, dim=1).topk(TOP_K, dim=1)
    assert torch.equal(ids.long().sort(dim=1).values, want.indices.sort(dim=1).values)


@pytest.mark.parametrize("decode_policy", ["xshare", "none"])
def test_a_one_token_verify_is_a_decode_step(plugin_env, monkeypatch, decode_policy) -> None:  # noqa: F811
    """--speculative-adaptive at 0 steps verifies each request's last token alone (D = 1): eagerly and
    in a captured graph, that forward takes the decode phase's config (none: unpruned), never the
    verify policy; D = 2 stays verify."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from xshare_sglang.sglang_plugin.hooks.model_runner_init import capture_head
    from xshare_sglang.sglang_plugin.verify_scope import eager_scope

    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": decode_policy, "k0": 1, "budget": 2, "verify": VERIFY}))
    runtime = _init(_runner(_model(_topk_config())))
    decode_policy_or_none = None if decode_policy == "none" else decode_policy
    for width, phase, policy in ((1, "decode", decode_policy_or_none), (2, "verify", "xshare-spec")):
        spec_info = SimpleNamespace(draft_token_num=width, ragged_verify_layout=None)
        batch = SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY, spec_info=spec_info, input_ids=torch.zeros(3 * width)
        )
        scope = eager_scope(runtime, batch)
        assert (scope.phase, scope.tokens_per_request) == (phase, width)
        assert (scope.cfg.policy if scope.cfg is not None else None) == policy
        graph_runner = SimpleNamespace(capture_forward_mode=ForwardMode.TARGET_VERIFY, captured_req_width=width)
        capture_head(graph_runner, SimpleNamespace(input_ids=torch.zeros(3 * width), positions=torch.zeros(3 * width)))
        assert (runtime.scope.phase, runtime.scope.tokens_per_request) == (phase, width)
        assert (runtime.scope.cfg.policy if runtime.scope.cfg is not None else None) == policy
        assert runtime.graph_pruned[(phase, 3 * width)] is (policy is not None)
        runtime.leave(None)
