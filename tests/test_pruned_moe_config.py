"""The fused-MoE configuration of a pruned layer call (issue 37, item 2), on CPU.

SGLang's own ``try_get_optimal_moe_config`` is called with the plugin's hook applied (through SGLang's
HookRegistry) and without it (the function the registry wrapped), on the Qwen3-30B-A3B shape
(E=128, N=768, H=2048, top-8).  The device name is patched to one SGLang ships a tuned table for (H200)
or to one it does not; ``get_exec`` (published by a server only) is stubbed to a non-deterministic run.
"""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest

from xshare_sglang import PrunerConfig
from xshare_sglang.sglang_plugin import pruned_moe_config
from xshare_sglang.sglang_plugin.pruned_moe_config import (
    choose,
    effective_tokens,
    keep_bound,
    pick_from_table,
    pruned_file_name,
    triton_folder,
)

E, N, H, TOP_K = 128, 768, 2048, 8
W1, W2 = (E, 2 * N, H), (E, H, N)


# ------------------------------------------------------------------------------- pure rules
def test_keep_bound_per_policy():
    assert keep_bound(PrunerConfig(policy="moe-spec", max_experts=16), 512, 1, E) == 16
    # one top-max_experts per request of D rows: the union of R = T / D of them
    spec_req = PrunerConfig(policy="moe-spec", max_experts=4, scope="request")
    assert keep_bound(spec_req, 16, 4, E) == 16
    assert keep_bound(spec_req, 512, 4, E) == E  # capped at E
    assert keep_bound(PrunerConfig(policy="xshare", k0=1, budget=8), 8, 1, E) == 16  # k0*T + budget
    assert keep_bound(PrunerConfig(policy="xshare", k0=1, budget=8), 512, 1, E) == E
    assert keep_bound(PrunerConfig(policy="xshare", k0=1, budget=8, max_experts=12), 8, 1, E) == 12
    assert keep_bound(PrunerConfig(policy="oea", k0=2), 4, 1, E) == 8
    xspec = PrunerConfig(policy="xshare-spec", k0=1, request_budget=2, budget=3)
    assert keep_bound(xspec, 8, 4, E) == 8 + 2 * 2 + 3
    # data-dependent growth: no bound, unless capped
    assert keep_bound(PrunerConfig(policy="lynx"), 8, 1, E) is None
    assert keep_bound(PrunerConfig(policy="xshare-threshold", k0=1), 8, 1, E) is None
    assert keep_bound(PrunerConfig(policy="lynx", max_experts=32), 8, 1, E) == 32
    assert keep_bound(None, 8, 1, E) is None
    assert keep_bound(PrunerConfig(policy="none"), 8, 1, E) is None


def test_effective_tokens_keeps_per_expert_load():
    assert effective_tokens(128, 128, 16) == 1024
    assert effective_tokens(3, 128, 48) == 8  # ceil(3 * 128 / 48)
    assert effective_tokens(64, 128, 128) == 64
    assert effective_tokens(64, 128, 500) == 64  # a bound past E is E


def test_pick_from_table_nearest_kept_then_nearest_m():
    table = {16: {32: {"id": "16/32"}, 128: {"id": "16/128"}}, 64: {128: {"id": "64/128"}}}
    assert pick_from_table(table, 16, 100)["id"] == "16/128"
    assert pick_from_table(table, 20, 40)["id"] == "16/32"
    assert pick_from_table(table, 48, 128)["id"] == "64/128"  # log-ratio 0.29 vs 1.1
    assert pick_from_table(table, 7, 128) is None  # 16 / 7 > 2: no tuned count near enough
    assert pick_from_table(table, 200, 128) is None


def test_choose_order():
    table = {16: {128: {"BLOCK_SIZE_M": 32}}}
    got = choose(num_tokens=128, num_experts=E, bound=16, sglang_has_table=True, pruned_table=table)
    assert (got.source, got.config) == ("pruned-table", {"BLOCK_SIZE_M": 32})
    got = choose(num_tokens=128, num_experts=E, bound=16, sglang_has_table=True, pruned_table=None)
    assert (got.source, got.num_tokens) == ("scaled", 1024)
    got = choose(num_tokens=128, num_experts=E, bound=16, sglang_has_table=False, pruned_table=None)
    assert (got.source, got.num_tokens) == ("sglang", 128)
    got = choose(num_tokens=128, num_experts=E, bound=None, sglang_has_table=True, pruned_table=table)
    assert got.source == "sglang"
    got = choose(num_tokens=128, num_experts=E, bound=E, sglang_has_table=True, pruned_table=table)
    assert got.source == "sglang"


# ------------------------------------------------------------------ SGLang's lookup, hooked


@pytest.fixture
def lookup(monkeypatch, tmp_path):
    """SGLang's lookup hooked and unhooked, with a settable device name and our config folder in
    ``tmp_path``."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as sglang_config

    from tests.sglang_helpers import apply_routing_hooks
    from xshare_sglang.sglang_plugin.hooks import moe_config_lookup
    from xshare_sglang.sglang_plugin.runtime import set_runtime

    apply_routing_hooks()
    hooked = sglang_config.try_get_optimal_moe_config
    unhooked = inspect.unwrap(hooked)
    assert unhooked is not hooked
    device = {"name": "NVIDIA H200"}
    monkeypatch.setattr(sglang_config, "get_device_name", lambda: device["name"])
    deterministic = SimpleNamespace(deterministic=SimpleNamespace(enable_deterministic_inference=False))
    monkeypatch.setattr(sglang_config, "get_exec", lambda: deterministic)
    monkeypatch.setattr(pruned_moe_config, "CONFIG_DIR", str(tmp_path))
    sglang_config.get_moe_configs.cache_clear()
    moe_config_lookup.clear_cache()
    yield SimpleNamespace(hooked=hooked, unhooked=unhooked, device=device, dir=tmp_path, module=sglang_config)
    set_runtime(None)
    sglang_config.get_moe_configs.cache_clear()
    moe_config_lookup.clear_cache()


def _publish(cfg: PrunerConfig | None, *, phase: str = "decode", tokens_per_request: int = 1):
    from sglang.srt.layers.moe.topk import TopKConfig

    from xshare_sglang.sglang_plugin.model_layers import make_layer_state, make_runtime
    from xshare_sglang.sglang_plugin.runtime import ForwardScope, set_runtime
    from xshare_sglang.sglang_plugin.settings import PluginSettings

    topk = TopKConfig(top_k=TOP_K, renormalize=True, layer_id=0)
    states = {id(topk): make_layer_state(topk, layer_id=0, row=0, num_experts=E, device="cpu")}
    runtime = make_runtime(PluginSettings(pruner=cfg or PrunerConfig(policy="moe-spec", max_experts=16)), states, "cpu")
    runtime.enter(ForwardScope(phase=phase, tokens_per_request=tokens_per_request, cfg=cfg))
    set_runtime(runtime)
    return runtime


def _call(fn, m: int, *, down: bool = False, w1=W1, w2=W2):
    # as fused_moe.py calls it: five positional arguments, the rest by name
    return fn(w1, w2, TOP_K, None, m, block_shape=None, per_channel_quant=False, return_down_config=down)


@pytest.mark.sglang
def test_pruned_call_looks_sglang_table_up_at_effective_tokens(lookup):
    assert _call(lookup.unhooked, 128) != _call(lookup.unhooked, 1024)  # the table differs there
    _publish(PrunerConfig(policy="moe-spec", max_experts=16))
    assert _call(lookup.hooked, 128) == _call(lookup.unhooked, 1024)  # 128 * 128 / 16
    assert _call(lookup.hooked, 128, down=True) == _call(lookup.unhooked, 1024, down=True)
    _publish(PrunerConfig(policy="xshare", k0=1, budget=8))
    assert _call(lookup.hooked, 8) == _call(lookup.unhooked, 64)  # bound 1*8 + 8 = 16
    assert _call(lookup.hooked, 512) == _call(lookup.unhooked, 512)  # bound 520 >= E: unchanged


@pytest.mark.sglang
def test_unpruned_and_foreign_calls_untouched(lookup):
    from xshare_sglang.sglang_plugin.runtime import set_runtime

    want = _call(lookup.unhooked, 128)
    set_runtime(None)
    assert _call(lookup.hooked, 128) == want
    _publish(None)  # a forward of a phase that is not pruned
    assert _call(lookup.hooked, 128) == want
    _publish(PrunerConfig(policy="lynx"))  # pruned, but no static bound
    assert _call(lookup.hooked, 128) == want
    _publish(PrunerConfig(policy="moe-spec", max_experts=16))
    wide = (2 * E, 2 * N, H), (2 * E, H, N)  # more experts than the target model's layers: not its layer
    assert _call(lookup.hooked, 128, w1=wide[0], w2=wide[1]) == _call(lookup.unhooked, 128, w1=wide[0], w2=wide[1])
    _publish(PrunerConfig(policy="moe-spec", max_experts=16, max_tokens=64))  # 128 tokens: not pruned
    assert _call(lookup.hooked, 128) == want


@pytest.mark.sglang
def test_no_tuned_file_falls_back_to_sglang_choice(lookup):
    lookup.device["name"] = "NVIDIA Nonexistent GPU"
    assert _call(lookup.unhooked, 64) != _call(lookup.unhooked, 512)  # the default rule switches at M > E
    _publish(PrunerConfig(policy="moe-spec", max_experts=16))
    assert _call(lookup.hooked, 64) == _call(lookup.unhooked, 64)
    assert _call(lookup.hooked, 64, down=True) == _call(lookup.unhooked, 64, down=True)


@pytest.mark.sglang
def test_our_table_keyed_by_tokens_and_kept(lookup):
    name = pruned_file_name(lookup.module.get_config_file_name(E, N, None, [0, 0], False))
    assert name == "E=128,N=768,device_name=NVIDIA_H200,pruned.json"
    folder = lookup.dir / triton_folder()
    folder.mkdir()
    table = {
        "16": {"128": {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}},
        "64": {"128": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 4}},
    }
    (folder / name).write_text(json.dumps(table))
    _publish(PrunerConfig(policy="moe-spec", max_experts=16))
    assert _call(lookup.hooked, 100) == table["16"]["128"]
    config, (down, _) = _call(lookup.hooked, 128, down=True)
    assert config == table["16"]["128"] and down is None
    config, (down, _) = lookup.hooked(W1, W2, TOP_K, None, 128, False, None, False, True)  # all positional
    assert config == table["16"]["128"] and down is None
    _publish(PrunerConfig(policy="moe-spec", max_experts=48))
    assert _call(lookup.hooked, 128) == table["64"]["128"]
    _publish(PrunerConfig(policy="moe-spec", max_experts=4))  # no kept count within 2x: SGLang's table, scaled
    assert _call(lookup.hooked, 128) == _call(lookup.unhooked, 4096)
    # the caller pops keys from what it gets: the cached table must not change
    _publish(PrunerConfig(policy="moe-spec", max_experts=16))
    _call(lookup.hooked, 128).pop("BLOCK_SIZE_M")
    assert _call(lookup.hooked, 128) == table["16"]["128"]
