"""Per-forward context: the ModelRunner hook that builds the runtime, the capture / replay / eager
publication hooks, with SGLang's own classes and enums where they can be built on CPU and named
stand-ins where they cannot."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_helpers import apply_routing_hooks, runner_attributes, stand_in_experts, stand_in_topk
from xshare_sglang.sglang_plugin.runtime import ForwardScope, get_runtime, set_runtime
from xshare_sglang.sglang_plugin.settings import ENV_VAR

pytestmark = pytest.mark.sglang

NUM_EXPERTS = 32
#: what the load_batch hook reads from SGLang's DecodeCudaGraphRunner besides the real-token count
_DECODE_GRAPH = {"capture_forward_mode": None, "bs": 8, "captured_req_width": 1}


def _topk_config(**kwargs):
    from sglang.srt.layers.moe.topk import TopKConfig

    base = dict(top_k=4, renormalize=True, torch_native=True, scoring_func="softmax")
    return TopKConfig(**{**base, **kwargs})


def _model(*configs, draft_config=None):
    model = torch.nn.Module()
    layers = torch.nn.ModuleList()
    for layer_id, config in enumerate(configs):
        block = torch.nn.Module()
        block.topk = stand_in_topk(config, layer_id=layer_id)
        block.experts = stand_in_experts(layer_id=layer_id, num_experts=NUM_EXPERTS)
        layers.append(block)
    if draft_config is not None:
        layers.append(stand_in_topk(draft_config, layer_id=0, is_draft=True))
    model.layers = layers
    return model


def _runner(model, *, is_draft_worker=False):
    """Stand-in for SGLang's ModelRunner: only the attributes the plugin's hook reads."""
    return SimpleNamespace(**runner_attributes(model, is_draft_worker=is_draft_worker))


@pytest.fixture
def plugin_env(monkeypatch):
    import sglang.srt.runtime_context as runtime_context

    apply_routing_hooks()
    monkeypatch.setattr(
        runtime_context, "get_parallel", lambda: SimpleNamespace(tp_rank=0, tp_size=1, moe_ep_rank=0, moe_ep_size=1)
    )
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "xshare", "k0": 1, "budget": 3, "log_interval": 2}))
    set_runtime(None)
    yield
    set_runtime(None)


def _init(runner):
    from xshare_sglang.sglang_plugin.hooks import model_runner_init

    model_runner_init.hook(None, runner)
    return get_runtime()


def test_runner_init_builds_the_runtime(plugin_env, caplog) -> None:
    target, other = _topk_config(), _topk_config()
    draft = _topk_config()
    runner = _runner(_model(target, other, draft_config=draft))
    with caplog.at_level(logging.INFO, logger="xshare_sglang.sglang_plugin.hooks.model_runner_init"):
        runtime = _init(runner)
    assert runtime is not None and runtime.runner is runner
    assert {id(target), id(other)} == set(runtime.layers)  # the draft TopK is not a pruned layer
    assert [s.top_k for s in runtime.layers.values()] == [4, 4]
    assert runtime.metrics.shape == (4, 2, 4)  # phases (decode, verify, extend, mixed) x layers x columns
    assert len(runner.capture_head_hooks) == 1 and len(runner.capture_tail_hooks) == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("moe-pruner active:")]
    assert len(lines) == 1
    assert "policy=xshare" in lines[0] and "budget=3" in lines[0] and "layers=2" in lines[0]
    assert "hooks=[" in lines[0] and "transform_select_experts_inputs" in lines[0]
    assert " rank=tp0/1,ep0/1 " in lines[0]


def test_draft_runner_and_pruner_off_build_nothing(plugin_env, monkeypatch) -> None:
    assert _init(_runner(_model(_topk_config()), is_draft_worker=True)) is None
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "none"}))
    runner = _runner(_model(_topk_config()))
    assert _init(runner) is None and runner.capture_head_hooks == []


@pytest.mark.parametrize(
    ("config_kwargs", "pruner", "ep_size", "message"),
    [
        ({}, {"policy": "xshare", "k0": 5}, 1, "PrunerConfig.k0=5 is invalid: must be <= the model's top_k=4"),
        ({"scoring_func": "sqrtsoftplus"}, {"policy": "oea"}, 1, "scores experts with 'sqrtsoftplus'"),
        ({}, {"policy": "xshare-ep"}, 1, "--ep-size 1"),
    ],
)
def test_runner_init_refuses_what_the_model_cannot_take(
    plugin_env, monkeypatch, config_kwargs, pruner, ep_size, message
) -> None:
    from xshare_sglang.sglang_plugin.model_layers import PrunerSetupError

    monkeypatch.setenv(ENV_VAR, json.dumps(pruner))
    with pytest.raises(PrunerSetupError, match=message.replace("(", r"\(").replace("[", r"\[")):
        _init(_runner(_model(_topk_config(**config_kwargs))))


def _gpt_oss_topk(backend: str):
    """A GPT-OSS-shaped ``TopK`` (top-4, softmax renormalized over the picks, no bias: gpt_oss.py) bound
    by SGLang's own ``bind_runner_backend`` to ``backend``, as its ``FusedMoE`` does."""
    from sglang.srt.layers.moe.topk import TopKConfig
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    topk = stand_in_topk(TopKConfig(top_k=4, renormalize=True, layer_id=0), layer_id=0)
    topk._runner_backend_bound, topk.is_fp4_experts = False, False
    topk.bind_runner_backend(MoeRunnerBackend(backend))
    return topk


@pytest.mark.sglang_modes
@pytest.mark.parametrize(
    ("backend", "output_format"), [("triton_kernel", "TRITON_KERNEL"), ("flashinfer_mxfp4", "BYPASSED")]
)
def test_runner_init_accepts_routing_inside_the_moe_kernel(plugin_env, backend, output_format) -> None:
    """GPT-OSS on the MoE runner SGLang picks for it by default (``triton_kernel`` on H100/H200,
    ``flashinfer_mxfp4`` on SM100 with MXFP4 weights: arg_groups/model_overrides/gpt_oss.py), whose
    routing runs inside the MoE kernel: the model loads with the pruner on."""
    topk = _gpt_oss_topk(backend)
    assert topk.topk_config.output_format.name == output_format
    model = torch.nn.Module()
    block = torch.nn.Module()
    block.topk, block.experts = topk, stand_in_experts(layer_id=0, num_experts=NUM_EXPERTS, runner=backend)
    model.layers = torch.nn.ModuleList([block])
    runtime = _init(_runner(model))
    assert runtime is not None and list(runtime.layers) == [id(topk.topk_config)]
    assert not runtime.layers[id(topk.topk_config)].fill_dropped  # SGLang routes: nothing is dropped


@pytest.mark.sglang_modes
def test_runner_init_refuses_what_kernel_routing_cannot_do(plugin_env, monkeypatch) -> None:
    """Truncation coverage needs a step after routing, which a MoE kernel that routes inside has not;
    a top-k format the pruner does not act on at all is refused as before."""
    from sglang.srt.layers.moe.topk import TopKOutputFormat

    from xshare_sglang.sglang_plugin.model_layers import PrunerSetupError

    with pytest.raises(PrunerSetupError, match="--moe-runner-backend triton"):
        _init(_runner(_model(_topk_config(output_format=TopKOutputFormat.PACKED))))
    monkeypatch.setenv(ENV_VAR, json.dumps({"policy": "xshare", "k0": 1, "budget": 3, "coverage": "truncation"}))
    model = torch.nn.Module()
    block = torch.nn.Module()
    block.topk = _gpt_oss_topk("triton_kernel")
    block.experts = stand_in_experts(layer_id=0, num_experts=NUM_EXPERTS, runner="triton_kernel")
    model.layers = torch.nn.ModuleList([block])
    with pytest.raises(
        PrunerSetupError, match=r"--moe-pruner-coverage truncation .*--moe-runner-backend triton_kernel .*substitution"
    ):
        _init(_runner(model))


def test_runner_init_checks_the_static_ranking(plugin_env, monkeypatch, tmp_path) -> None:
    from xshare_sglang.sglang_plugin.model_layers import PrunerSetupError
    from xshare_sglang.sglang_plugin.settings import _parse_settings

    path = tmp_path / "ranking.json"
    counts = [[1.0] * NUM_EXPERTS]  # one layer only
    path.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
    pruner = {"policy": "moe-spec", "max_experts": 8, "ranking": "static", "static_ranking_path": str(path)}
    monkeypatch.setenv(ENV_VAR, json.dumps(pruner))
    with pytest.raises(PrunerSetupError, match="has 1 layers, but the model has MoE layer 1"):
        _init(_runner(_model(_topk_config(), _topk_config())))
    path.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": [[1.0] * 16]}))
    _parse_settings.cache_clear()  # a process parses its settings once; here the file changes within one
    with pytest.raises(PrunerSetupError, match="ranks 16 experts per layer, the model has 32"):
        _init(_runner(_model(_topk_config())))


def test_capture_hooks_publish_the_graph_scope(plugin_env) -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from xshare_sglang.sglang_plugin.hooks.model_runner_init import capture_head, capture_tail

    runner = _runner(_model(_topk_config()))
    runtime = _init(runner)
    graph_runner = SimpleNamespace(capture_forward_mode=ForwardMode.TARGET_VERIFY, captured_req_width=4)
    capture_head(graph_runner, SimpleNamespace(input_ids=torch.zeros(16, dtype=torch.int64)))
    assert runtime.scope.phase == "verify" and runtime.scope.tokens_per_request == 4
    assert runtime.scope.num_valid is runtime.num_valid_buffer and runtime.num_valid_buffer.item() == 16
    assert runtime.pruning_phase()
    capture_tail(graph_runner, None, None, 16)
    assert runtime.scope is None and not runtime.pruning_phase()
    capture_head(
        SimpleNamespace(capture_forward_mode=ForwardMode.DECODE, captured_req_width=1),
        SimpleNamespace(input_ids=torch.zeros(8)),
    )
    assert runtime.scope.phase == "decode" and runtime.scope.tokens_per_request == 1


def test_load_batch_hook_writes_the_real_token_count(plugin_env) -> None:
    from xshare_sglang.sglang_plugin.hooks import decode_graph_load_batch

    runner = _runner(_model(_topk_config()))
    runtime = _init(runner)
    decode_graph_load_batch.hook(None, SimpleNamespace(model_runner=runner, raw_num_token=7, **_DECODE_GRAPH))
    assert runtime.num_valid_buffer.item() == 7
    draft_runner = _runner(_model(_topk_config()), is_draft_worker=True)
    decode_graph_load_batch.hook(None, SimpleNamespace(model_runner=draft_runner, raw_num_token=3))
    assert runtime.num_valid_buffer.item() == 7  # the draft model's graphs never write it


@pytest.mark.parametrize(
    ("mode", "spec_info", "phase", "tokens_per_request", "pruned"),
    [
        ("DECODE", None, "decode", 1, True),
        ("TARGET_VERIFY", SimpleNamespace(draft_token_num=5), "verify", 5, True),
        ("EXTEND", None, "extend", 1, False),
        ("MIXED", None, "mixed", 1, False),
        ("IDLE", None, None, 1, False),
    ],
)
def test_forward_hook_publishes_the_eager_scope(plugin_env, mode, spec_info, phase, tokens_per_request, pruned) -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from xshare_sglang.sglang_plugin.hooks import model_runner_forward_raw

    runner = _runner(_model(_topk_config()))
    runtime = _init(runner)
    outer = ForwardScope(phase="decode")
    runtime.enter(outer)
    seen = {}

    def original(self, forward_batch, *args, **kwargs):
        seen["scope"] = runtime.scope
        seen["pruning"] = runtime.pruning_phase()
        return "output"

    batch = SimpleNamespace(forward_mode=ForwardMode[mode], spec_info=spec_info)
    assert model_runner_forward_raw.hook(original, runner, batch) == "output"
    assert seen["scope"].phase == phase and seen["scope"].tokens_per_request == tokens_per_request
    assert seen["scope"].num_valid is None and seen["pruning"] is pruned
    assert runtime.scope is outer  # restored
    assert runtime.pruned_forwards == (1 if pruned else 0)
    # another ModelRunner (the draft worker) passes straight through
    other = _runner(_model(_topk_config()), is_draft_worker=True)
    model_runner_forward_raw.hook(original, other, batch)
    assert runtime.pruned_forwards == (1 if pruned else 0)


def test_graph_style_padding_follows_the_buffer(plugin_env) -> None:
    """Eager stand-in for a replay: the captured scope reads the device buffer, so changing the
    real-token count between calls moves the padding boundary without touching the Python state."""
    from sglang.srt.layers.moe import topk
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from xshare_sglang.sglang_plugin.hooks import decode_graph_load_batch
    from xshare_sglang.sglang_plugin.hooks.model_runner_init import capture_head

    config = _topk_config()
    runner = _runner(_model(config))
    _init(runner)
    capture_head(
        SimpleNamespace(capture_forward_mode=ForwardMode.DECODE, captured_req_width=1),
        SimpleNamespace(input_ids=torch.zeros(8)),
    )
    logits = torch.randn(8, NUM_EXPERTS, generator=torch.Generator().manual_seed(0))
    for real in (8, 5, 1):
        decode_graph_load_batch.hook(None, SimpleNamespace(model_runner=runner, raw_num_token=real, **_DECODE_GRAPH))
        out = topk.select_experts(
            hidden_states=torch.zeros(8, 4), router_logits=logits.clone(), topk_config=config, layer_id=0
        )
        assert (out.topk_ids[real:] == -1).all()
        assert (out.topk_ids[:real] >= 0).any(dim=1).all()
