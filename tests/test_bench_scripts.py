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
