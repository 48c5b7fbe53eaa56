"""The GPU benchmark scripts run end to end (their --smoke mode: CPU, Triton interpreter, no timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")
def test_bench_selection_smoke(tmp_path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_selection.py"), "--smoke", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "selection.json").read_text())
    assert report["meta"]["device"].startswith("cpu (smoke run")
    policies = [row["policy"] for row in report["rows"]]
    assert policies == [
        "oea",
        "xshare",
        "xshare-threshold",
        "xshare-spec",
        "xshare-ep",
        "moe-spec",
        "moe-spec-static",
        "lynx",
    ]
    assert all(row["masks_equal"] and row["eager_alloc_bytes"] == 0 for row in report["rows"])
    assert (tmp_path / "selection.csv").read_text().startswith("E,T,policy,kernel_us,reference_us")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")
def test_bench_moe_layer_smoke(tmp_path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    # T=7 only keeps this under 30 s (the script's own --smoke default adds T=1)
    command = [sys.executable, str(ROOT / "scripts" / "bench_moe_layer.py"), "--smoke", "--tokens", "7"]
    result = subprocess.run(
        [*command, "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "moe_layer.json").read_text())
    meta, rows = report["meta"], report["rows"]
    assert meta["device"].startswith("cpu (smoke run")
    assert {(r["model"], r["phase"], r["T"]) for r in rows} == {
        (model, phase, 7) for model in ("tiny", "tiny-ep") for phase in ("decode", "verify")
    }
    assert {r["policy"] for r in rows} == {"xshare", "moe-spec", "lynx", "xshare-ep", "xshare-spec"}
    # pruned layer == float32 reference MoE with the same routing; kernel masks and routing == torch reference
    assert all(r["checks_ok"] and r["masks_equal"] and r["routing_equal"] for r in rows)
    assert all(r["moe_rel_err"] <= 2e-2 for r in rows)
    assert all(r["pruned_le_baseline"] and r["activated_pruned"] <= r["activated_baseline"] for r in rows)
    for model in meta["models"].values():
        assert model["checks"]["align"] == "ok"
        assert model["checks"]["grouped_mm"].startswith("rel err")
        if meta["sglang_kernel"] != "not loaded":  # SGLang's own kernel file was found: it must pass too
            assert model["checks"]["sglang"].startswith("rel err")
    expected = "sglang" if meta["sglang_kernel"] != "not loaded" else "grouped_mm"
    assert all(r["backend"] == expected for r in rows)
    assert (tmp_path / "moe_layer.csv").read_text().startswith("model,phase,T,D,policy,settings,backend")
    assert "| phase | T | policy |" in (tmp_path / "moe_layer.md").read_text()
