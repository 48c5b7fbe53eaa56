"""``scripts/results.py``: every GPU figure the docs show is generated from the committed run folders.

* ``--check`` passes: each run folder's ``run.json`` and each generated block (README.md,
  docs/benchmarks.md, docs/bench_selection.md) is what the script makes from the raw files now.
* The speed-up against a fused top-k is measured where a run's baseline was one, and estimated from the
  same run's selection rows where the baseline routed with torch ops, on a synthetic run.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import results  # noqa: E402


def test_generated_figures_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "results.py"), "--check"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _write(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_fused_baseline_measured_or_estimated(tmp_path) -> None:
    """A row of an older run (no ``baseline`` column, the baseline routed with torch ops): the speed-up
    against a fused top-k is (baseline - median(topk_us - none_us) of that router and T) / pruned; a
    row of a newer run (``baseline`` names the fused top-k) is measured, its torch-op speed-up from
    ``baseline_torch_topk_us``."""
    old = tmp_path / "h200-2026-11-01-abcdef1"
    old.mkdir()
    selection = [
        {"model": "qwen3-30b-a3b", "T": "8", "policy": p, "topk_us": topk, "none_us": "3.0"}
        for p, topk in (("oea", "15.0"), ("xshare", "17.0"), ("lynx", "19.0"))
    ]
    _write(old / "selection.csv", selection)
    layer = {"model": "qwen3-30b-a3b", "phase": "decode", "T": "8", "policy": "xshare", "pruned_us": "50.0"}
    _write(old / "moe_layer.csv", [{**layer, "baseline_us": "100.0"}])
    (row,) = results.moe_rows(old)
    assert row["estimated"] and row["torch"] == pytest.approx(2.0)
    assert row["fused"] == pytest.approx((100.0 - 14.0) / 50.0)  # the median gap 17 - 3
    new = tmp_path / "h200-2026-12-01-abcdef2"
    new.mkdir()
    fields = {"baseline_us": "80.0", "baseline": "fused top-k (policy none)", "baseline_torch_topk_us": "95.0"}
    _write(new / "moe_layer.csv", [{**layer, **fields}])
    (row,) = results.moe_rows(new)
    assert not row["estimated"]
    assert row["fused"] == pytest.approx(1.6) and row["torch"] == pytest.approx(1.9)


def test_rows_without_an_estimate_are_counted_not_hidden(tmp_path, monkeypatch) -> None:
    """A layer row of an older run at a T its selection stage never timed has no fused figure: the
    block keeps it out of the policy range and of the < 1x count, and says how many it left out."""
    run = tmp_path / "h200-2026-11-01-abcdef1"
    run.mkdir()
    _write(run / "selection.csv", [{"model": "qwen3-30b-a3b", "T": "8", "topk_us": "13.0", "none_us": "3.0"}])
    layer = {"model": "qwen3-30b-a3b", "phase": "decode", "policy": "xshare"}
    _write(
        run / "moe_layer.csv",
        [
            {**layer, "T": "8", "pruned_us": "50.0", "baseline_us": "100.0"},
            {**layer, "T": "512", "pruned_us": "400.0", "baseline_us": "300.0"},
        ],
    )
    monkeypatch.setattr(results, "RUNS", tmp_path)
    block = results.moe_layer_block([{"folder": run.name, "commit": "abcdef1"}])
    (row,) = [line for line in block.splitlines() if line.startswith("| `abcdef1`")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3] == "2 (1)"  # two rows, one without a fused figure
    assert cells[4] == "1.80-1.80\\*"  # (100 - 10) / 50; the T=512 row (0.75x by torch) is left out
    assert cells[-1] == "0"


def test_a_block_needs_its_markers() -> None:
    text = "a\n<!-- results:x -->\nold\n<!-- /results:x -->\nb\n"
    assert results.replace_block(text, "x", "new") == "a\n<!-- results:x -->\nnew\n<!-- /results:x -->\nb\n"
    with pytest.raises(ValueError, match="results:y"):
        results.replace_block(text, "y", "new")


def test_run_records_read_the_folders() -> None:
    """Every committed run folder names its commit and date, and the device its result files state."""
    for folder in results.run_folders():
        record = results.run_record(folder)
        assert folder.name.endswith(record["commit"]) and record["date"] in folder.name
        assert record["device"] == "NVIDIA H200" and record["triton"] == "3.6.0"
        assert record["selection_rows"] + record["moe_layer_rows"] > 0
        assert record["commit"] not in record["also_measured_at"]
    # the metrics A/B in f53d4e0's folder ran at d53498d; its record says so
    (f53d4e0,) = [f for f in results.run_folders() if f.name.endswith("f53d4e0")]
    assert results.run_record(f53d4e0)["also_measured_at"] == ["d53498d"]


def test_test_counts_per_stage_from_the_logs(tmp_path) -> None:
    """A stage's pytest summary when it has one; a stage a box cut: its progress characters, the last
    partial line included, or its verbose lines in either of pytest's two formats."""
    folder = tmp_path / "h200-2026-11-01-abcdef1"
    folder.mkdir()
    (folder / "gpu_check.log").write_text(
        "[gpu_check 0s] commit abcdef1; output o; budget 9s; stages tests,kernel_routing\n"
        "[gpu_check 1s] stage tests: up to 90s: python3 -m pytest ...\n"
        "........................................................................ [ 65%]\n"
        "......F.....[gpu_check 97s] stage tests stopped at its 93s box\n"
        "[gpu_check 97s] stage kernel_routing: up to 9s: python3 -m pytest ...\n"
        "8 passed, 8 deselected, 1 warning in 11.60s\n"
    )
    (folder / "gpu_tests.log").write_text(
        "# call 2, commit abcdef1\n[gw1] [ 10%] PASSED tests/test_a.py::test_one\ntests/test_a.py::test_two FAILED\n"
    )
    assert results._tests(folder) == [
        {"log": "gpu_check.log", "stage": "tests", "passed": 83, "failed": 1, "errors": 0, "cut": True},
        {"log": "gpu_check.log", "stage": "kernel_routing", "passed": 8, "failed": 0, "errors": 0, "cut": False},
        {"log": "gpu_tests.log", "stage": "call 2", "passed": 1, "failed": 1, "errors": 0, "cut": True},
    ]


def test_docker_block_shows_each_smoke_run(tmp_path, monkeypatch) -> None:
    """Each ``docs/docker-runs/*/summary.json``: status, total, every step's seconds, the image sizes."""
    run = tmp_path / "cpu-2026-12-02-abc1234"
    run.mkdir()
    summary = {
        "status": "passed",
        "commit": "abc1234",
        "total_seconds": 634,
        "steps": [
            {"step": "build the local CPU base", "seconds": 412},
            {"step": "wait for both servers", "seconds": 34},
        ],
        "image_bytes": {
            "xshare-smoke/debian:bookworm": 198_901_424,
            "xshare-smoke/cpu-base:7ca6e585f279": 11_031_150_018,
            "xshare-smoke/xshare-sglang:x": 11_189_329_646,
        },
        "base_reused": False,
        "docker": "client 28.2.2, daemon 20.10.24",
        "storage_driver": "overlay2",
        "daemon_started_by_run": True,
        "cores": 2,
    }
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "smoke.log").write_text("[docker-smoke 08:29:35] installing Debian packages: docker.io\n")
    monkeypatch.setattr(results, "DOCKER_RUNS", tmp_path)
    block = results.docker_block([])
    assert "**`cpu-2026-12-02-abc1234`**: passed in 634 s at `abc1234` (everything built; 2 cores" in block
    assert "daemon started by the run, Debian packages installed by the run: docker.io)." in block
    assert "| build the local CPU base | 412 |\n| wait for both servers | 34 |" in block
    assert "`xshare-smoke/cpu-base` 11.03 GB, `xshare-smoke/xshare-sglang` 11.19 GB" in block
    assert "the project's layers 158 MB" in block
    monkeypatch.setattr(results, "DOCKER_RUNS", tmp_path / "none")
    assert results.docker_block([]) == ""
