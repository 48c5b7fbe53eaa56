"""The pruned fused-MoE tuner (``scripts/tune_pruned_moe.py``, issue 37 item 3) and the benchmark's
use of the plugin's configuration rule, on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xshare_sglang.bench.moe_layer import MODELS, SglangFusedMoE, find_sglang_root
from xshare_sglang.bench.tune_moe import (
    SPACES,
    candidates,
    plan_points,
    pruned_routing,
    shared_memory_bytes,
)
from xshare_sglang.sglang_plugin import pruned_moe_config
from xshare_sglang.sglang_plugin.pruned_moe_config import load_pruned_table, pick_from_table, triton_folder

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = MODELS["qwen3-30b-a3b"]


def test_candidates_fit_shared_memory_and_the_load():
    config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "num_stages": 3}
    assert shared_memory_bytes(config) == 3 * (64 * 64 + 64 * 128) * 2
    # T=32, top-8 over 64 kept experts: 4 tokens per expert, so blocks of at most 16 rows
    small = candidates(SPACES["small"], 32, 8, 64, 227 * 1024)
    assert small and {c["BLOCK_SIZE_M"] for c in small} == {16}
    # T=512 over 16 kept: 256 per expert, every BLOCK_SIZE_M of the space
    wide = candidates(SPACES["small"], 512, 8, 16, 227 * 1024)
    assert {c["BLOCK_SIZE_M"] for c in wide} == set(SPACES["small"]["BLOCK_SIZE_M"])
    tight = candidates(SPACES["full"], 512, 8, 16, 64 * 1024)
    assert tight and all(shared_memory_bytes(c) <= 64 * 1024 for c in tight)
    assert len(tight) < len(candidates(SPACES["full"], 512, 8, 16, 227 * 1024))


def test_points_are_the_grid_bounds_below_e():
    points = plan_points(QWEN3, [32, 64, 512], ["decode"], 4, None)
    assert (32, 16) in points and (512, 64) in points  # moe-spec max_experts 16 / 64
    assert (32, 40) in points and (64, 80) in points  # xshare k0=1: T + 8, T + 16
    assert all(QWEN3.top_k <= kept < QWEN3.num_experts for _, kept in points)
    assert not any(t == 512 and kept > 64 for t, kept in points)  # xshare at T=512 keeps up to E: not tuned
    assert plan_points(QWEN3, [32], ["decode"], 4, [4, 16, 128]) == [(32, 16)]  # k <= kept < E


def test_pruned_routing_stays_inside_kept():
    gen = torch.Generator().manual_seed(0)
    ids, weights = pruned_routing(64, 8, 128, 16, gen, "cpu")
    assert ids.shape == (64, 8) and ids.dtype == torch.int32
    assert torch.unique(ids).numel() == 16
    assert all(torch.unique(row).numel() == 8 for row in ids)  # distinct experts per token
    assert torch.allclose(weights.sum(1), torch.ones(64))


def test_tuner_smoke_writes_a_table_the_hook_reads(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "tune_pruned_moe.py"), "--smoke", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "tune_report.json").read_text())
    (point,) = report["points"]
    assert (point["T"], point["kept"]) == (4, 4) and point["rel_err"] <= 2e-2
    assert point["space"] == point["candidates"] >= 2  # SGLang's own choice plus the smoke space
    assert point["best_us"] <= point["sglang_us"]
    name = "E=8,N=32,device_name=cpu,pruned.json"
    assert report["meta"]["files"] == [str(tmp_path / triton_folder() / name)]
    table = load_pruned_table(name, str(tmp_path))
    assert pick_from_table(table, 4, 4) == point["best"]


@pytest.fixture(scope="module")
def sglang_kernel():
    root = find_sglang_root(None)
    if root is None:
        pytest.skip("SGLang's fused_moe_triton_kernels.py is not here")
    return SglangFusedMoE(root)


def test_bench_uses_the_plugin_rule(sglang_kernel, monkeypatch, tmp_path):
    """The benchmark's ``--pruned-config plugin``: SGLang's H200 table at T*E/bound, or our table."""
    monkeypatch.setattr(
        SglangFusedMoE, "file_name", staticmethod(lambda e, n: f"E={e},N={n},device_name=NVIDIA_H200.json")
    )
    monkeypatch.setattr(pruned_moe_config, "CONFIG_DIR", str(tmp_path))
    sglang_kernel._configs.clear()
    own, source = sglang_kernel.config(128, 128, 768)
    assert source.startswith("tuned")
    config, label = sglang_kernel.pruned_config(128, QWEN3, 16)
    assert config == sglang_kernel.config(1024, 128, 768)[0] != own and label.endswith("at M=1024")
    assert sglang_kernel.pruned_config(128, QWEN3, None) == (own, source)
    folder = tmp_path / triton_folder()
    folder.mkdir()
    ours = {"BLOCK_SIZE_M": 32, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1, "USE_TMA": False}
    (folder / "E=128,N=768,device_name=NVIDIA_H200,pruned.json").write_text(json.dumps({"16": {"128": ours}}))
    sglang_kernel._configs.clear()
    config, label = sglang_kernel.pruned_config(128, QWEN3, 16)
    assert config == {k: v for k, v in ours.items() if k != "USE_TMA"} and label.startswith("pruned-table")
    sglang_kernel._configs.clear()
