"""ECHO inside SGLang, on CPU: the flags and the configurations refused at start-up, the hooks on
SGLang's own draft functions (candidates stashed from ``organize_draft_results``, ECHO's slots handed
to ``build_eagle_verify_input``, cut trees, the calibration log from ``eagle_sample``), faults, and
the pruner's verify votes ignoring cut nodes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_helpers import apply_echo_hooks, build_tree_links, sglang_draft
from tests.test_sglang_cli import _python, assert_refused, parse_in_fresh_process
from xshare_sglang.sglang_plugin import hooks
from xshare_sglang.sglang_plugin.settings import ENV_VAR
from xshare_sglang.spec import acceptable_nodes
from xshare_sglang.spec.echo import (
    DraftCandidates,
    EchoCalibration,
    allocate_nodes,
    calibrate,
    echo_schedule,
    layer_confidence,
    read_echo_log,
    verify_slots,
)
from xshare_sglang.spec.echo.settings import EchoSettings

pytestmark = pytest.mark.sglang

STEPS, TOPK, DRAFT_TOKENS = 3, 4, 8


def _calibration(tmp_path, gates: dict[int, float]) -> str:
    path = tmp_path / "calib.json"
    EchoCalibration(num_steps=STEPS, topk=TOPK, num_draft_tokens=DRAFT_TOKENS, gates=gates).save(path)
    return str(path)


def test_start_up_refuses_what_echo_cannot_serve(tmp_path) -> None:
    calib = _calibration(tmp_path, {1: 0.3})
    eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "draft"]
    shape = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"]
    chain = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    cases = {
        "ok": [*eagle, *shape, "--xshare-echo-calibration", calib, "--xshare-echo-budget", "4"],
        "no_spec": ["--xshare-echo-calibration", calib],
        "log_no_spec": ["--xshare-echo-log-dir", str(tmp_path / "log")],
        "chain": [*eagle, *chain, "--xshare-echo-calibration", calib],
        "unset_shape": [*eagle, "--xshare-echo-calibration", calib],
        "steps": [*eagle, *shape[:1], "4", *shape[2:], "--xshare-echo-calibration", calib],
        "missing": [*eagle, *shape, "--xshare-echo-calibration", str(tmp_path / "nope.json")],
        "budget": [*eagle, *shape, "--xshare-echo-calibration", calib, "--xshare-echo-budget", "9"],
        "budget_alone": [*eagle, *shape, "--xshare-echo-budget", "3"],
        "width": [*eagle, *shape, "--xshare-echo-calibration", calib, "--xshare-echo-max-width", "0"],
    }
    report = parse_in_fresh_process(cases)
    status, env = report["ok"]
    assert status is None and json.loads(env)["echo"] == {"calibration": calib, "budget": 4.0}
    expected = {
        "no_spec": "--xshare-echo-calibration needs EAGLE tree speculative decoding",
        "log_no_spec": "--xshare-echo-log-dir needs EAGLE tree speculative decoding",
        "chain": "--speculative-eagle-topk > 1",
        "unset_shape": "needs the draft tree's shape set explicitly",
        "steps": "calibrated for 3 draft steps, the server drafts 4",
        "missing": "--xshare-echo-calibration: ECHO calibration",
        "budget": "--xshare-echo-budget 9.0: at most --speculative-num-draft-tokens minus 1 (7)",
        "budget_alone": "--xshare-echo-budget: budget=/default_width=/max_width= have no effect without calibration",
        "width": "argument --xshare-echo-max-width: must be >= 1",
    }
    assert_refused(report, expected)


def test_register_applies_echo_hooks_without_routing_hooks(tmp_path) -> None:
    calib = _calibration(tmp_path, {1: 0.3})
    code = """
        import json
        from xshare_sglang.sglang_plugin import hooks, liveness, register
        register()
        print("RESULT" + json.dumps({"echo": liveness.unhooked(hooks.ECHO_HOOKS),
                                     "routing": liveness.unhooked(hooks.ROUTING_HOOKS)}))
    """
    result = _python(code, env={ENV_VAR: json.dumps({"echo": {"calibration": calib}})})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("RESULT", 1)[1])
    assert report["echo"] == [] and len(report["routing"]) == len(hooks.ROUTING_HOOKS)
    # trace recording alone needs the routing hooks (they record the router logits)
    result = _python(code, env={ENV_VAR: json.dumps({"policy": "none", "trace_dir": str(tmp_path / "t")})})
    report = json.loads(result.stdout.split("RESULT", 1)[1])
    assert report["routing"] == [] and len(report["echo"]) == 3


@pytest.fixture
def echo_hooks():
    from xshare_sglang.sglang_plugin.echo_runtime import set_echo_runtime

    apply_echo_hooks()
    yield
    set_echo_runtime(None)


def _batch(num_requests: int):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(forward_mode=ForwardMode.DECODE, seq_lens=torch.full((num_requests,), 10))


def _fake_build(seen: dict):
    """Stands in for SGLang's tree build (a CUDA/sgl_kernel op): links the tree as its kernel does."""

    def original(batch, draft_input, parent_list, top_scores_index, draft_tokens, draft_probs, **kwargs):
        seen["index"], seen["tokens"] = top_scores_index.clone(), draft_tokens.clone()
        next_token, next_sibling = build_tree_links(parent_list, top_scores_index, kwargs["topk"])
        return SimpleNamespace(
            retrieve_next_token=next_token,
            retrieve_next_sibling=next_sibling,
            topk=kwargs["topk"],
            draft_token_num=kwargs["num_draft_tokens"],
        )

    return original


def _build_kwargs():
    return dict(
        target_worker=None, topk=TOPK, num_steps=STEPS, num_draft_tokens=DRAFT_TOKENS, tree_mask_mode=None, device="cpu"
    )


@pytest.mark.parametrize(("gates", "budget"), [({1: 0.0}, None), ({1: 0.5, 3: 0.05}, None), ({2: 0.2}, 3.0)])
def test_hooks_hand_echo_slots_to_sglang_and_cut_the_rest(echo_hooks, tmp_path, gates, budget) -> None:
    from sglang.srt.speculative import eagle_utils

    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime, set_echo_runtime
    from xshare_sglang.sglang_plugin.hooks import eagle_build_verify_input, eagle_sample

    settings = EchoSettings(calibration=_calibration(tmp_path, gates), budget=budget, log_dir=str(tmp_path / "log"))
    runtime = EchoRuntime(settings)
    set_echo_runtime(runtime)
    requests = 5
    lists = sglang_draft(requests, TOPK, STEPS, seed=3)
    # SGLang's own function, through the registry's wrapper: the candidates land in the stash
    parent_list, sglang_index, sglang_tokens = eagle_utils.organize_draft_results(*lists, DRAFT_TOKENS)
    seen = {}
    verify_input = eagle_build_verify_input.hook(
        _fake_build(seen), _batch(requests), None, parent_list, sglang_index, sglang_tokens, None, **_build_kwargs()
    )
    # what ECHO should have chosen, computed independently from the same lists
    candidates = DraftCandidates.from_sglang(*lists)
    confidence = layer_confidence(candidates)
    gated, thresholds = EchoCalibration(STEPS, TOPK, DRAFT_TOKENS, gates).gate_tensors()
    k_max = int((budget or DRAFT_TOKENS - 1) * requests)
    allocation = echo_schedule(confidence, gated, thresholds, k_max, max_width=TOPK, per_request_cap=DRAFT_TOKENS - 1)
    allocated = allocate_nodes(candidates, allocation.widths)
    index, kept = verify_slots(candidates, allocated, DRAFT_TOKENS)
    assert torch.equal(seen["index"], index)
    assert torch.equal(seen["tokens"], candidates.tokens.gather(1, index))
    assert int(kept[:, 1:].sum()) <= k_max
    # only the allocated nodes stay reachable from the roots
    reachable = acceptable_nodes(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling)
    assert torch.equal(reachable, kept)
    if gates == {1: 0.0}:  # every request passes everywhere: chains of width 1, the rest cut
        assert allocation.widths.tolist() == [[1, 1, 1]] * requests
        assert kept.sum(dim=1).tolist() == [STEPS + 1] * requests
    # the calibration log: confidences and accepted lengths (bonus excluded)
    accept_lens = torch.tensor([1, 2, 4, 3, 1], dtype=torch.int32)
    eagle_sample.hook((None, accept_lens, None), verify_input, None, None)
    runtime.log.flush()
    (record,) = read_echo_log(tmp_path / "log")
    assert record.accepted == [0, 1, 3, 2, 0]
    assert torch.allclose(torch.tensor(record.confidence), confidence, atol=1e-6)
    assert (record.num_steps, record.topk, record.num_draft_tokens) == (STEPS, TOPK, DRAFT_TOKENS)
    assert calibrate([record], min_samples=1).num_steps == STEPS


def test_logging_only_keeps_sglangs_tree_and_samples(echo_hooks, tmp_path) -> None:
    from sglang.srt.speculative import eagle_utils

    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime, set_echo_runtime
    from xshare_sglang.sglang_plugin.hooks import eagle_build_verify_input, eagle_sample

    runtime = EchoRuntime(EchoSettings(log_dir=str(tmp_path / "log"), log_every=2))
    set_echo_runtime(runtime)
    for step in range(5):
        lists = sglang_draft(3, TOPK, STEPS, seed=step)
        parent_list, index, tokens = eagle_utils.organize_draft_results(*lists, DRAFT_TOKENS)
        seen = {}
        verify_input = eagle_build_verify_input.hook(
            _fake_build(seen), _batch(3), None, parent_list, index, tokens, None, **_build_kwargs()
        )
        assert torch.equal(seen["index"], index)  # SGLang's own top-(D - 1)
        assert acceptable_nodes(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling).all()
        eagle_sample.hook((None, torch.tensor([1, 1, 2]), None), verify_input, None, None)
    runtime.log.flush()
    assert len(read_echo_log(tmp_path / "log")) == 3  # steps 0, 2, 4


def test_a_fault_falls_back_to_sglangs_tree(echo_hooks, tmp_path) -> None:
    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime, set_echo_runtime
    from xshare_sglang.sglang_plugin.hooks import eagle_build_verify_input, eagle_organize_draft_results

    runtime = EchoRuntime(EchoSettings(calibration=_calibration(tmp_path, {1: 0.5})))
    set_echo_runtime(runtime)
    lists = sglang_draft(2, TOPK, STEPS, seed=1)
    # a malformed step (the parents of another shape): the stash fails, counted, and is dropped
    eagle_organize_draft_results.hook(lambda *a: None, lists[0], lists[1], [p[:, :1] for p in lists[2]], DRAFT_TOKENS)
    assert runtime.faults == 1
    from sglang.srt.speculative import eagle_utils

    parent_list, index, tokens = eagle_utils.organize_draft_results.__wrapped__(*lists, DRAFT_TOKENS)
    seen = {}
    verify_input = eagle_build_verify_input.hook(
        _fake_build(seen), _batch(2), None, parent_list, index, tokens, None, **_build_kwargs()
    )
    assert torch.equal(seen["index"], index)
    assert acceptable_nodes(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling).all()
    # the scheduler itself failing (bad calibration depth for this tree): SGLang's slots again
    runtime.stash(*lists)
    runtime._gates = {torch.device("cpu"): (torch.ones(5, dtype=torch.bool), torch.zeros(5))}
    verify_input = eagle_build_verify_input.hook(
        _fake_build(seen), _batch(2), None, parent_list, index, tokens, None, **_build_kwargs()
    )
    assert torch.equal(seen["index"], index) and runtime.faults == 2


def test_cut_nodes_cast_no_expert_vote(tmp_path, monkeypatch) -> None:
    """With ECHO cutting trees, verify votes are weighted by reachability even without depth decay."""
    from tests.test_sglang_verify import D, _verify_batch
    from xshare_sglang import PrunerConfig
    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime, set_echo_runtime
    from xshare_sglang.sglang_plugin.verify_scope import eager_scope

    calib = EchoCalibration(num_steps=2, topk=2, num_draft_tokens=D, gates={1: 0.5})
    calib.save(tmp_path / "c.json")
    runtime = SimpleNamespace(config_for=lambda phase, num_tokens=None: PrunerConfig(policy="xshare-spec"))
    batch = _verify_batch(3, cut_request=1)
    set_echo_runtime(None)
    assert eager_scope(runtime, batch).weights_source is None
    set_echo_runtime(EchoRuntime(EchoSettings(calibration=str(tmp_path / "c.json"))))
    try:
        weights = eager_scope(runtime, batch).weights_source()
    finally:
        set_echo_runtime(None)
    expected = [1.0] * (3 * D)
    expected[1 * D + 2] = 0.0
    assert weights.tolist() == expected
