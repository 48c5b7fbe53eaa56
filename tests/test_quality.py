"""``xshare-sglang quality``: teacher-forced KL, top-1 agreement and NLL change against the unpruned
model, with window-bootstrap intervals, on decode and verify batches of the tiny MoE model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.forked_runs import run_forked
from xshare_sglang import PrunerConfig
from xshare_sglang.tiny.measures import Interval, bootstrap_interval, teacher_forced_logprobs, token_measures
from xshare_sglang.tiny.quality import QualityRow, QualitySettings, pareto_verdicts, run_quality
from xshare_sglang.tiny.spec_eval import default_draft_dir
from xshare_sglang.tiny.tiny_demo import heldout_windows
from xshare_sglang.tiny.tiny_model import load_tiny_model, tiny_model_dir

SMALL = QualitySettings(requests=4, draft_tokens=4, windows_per_domain=4, window_tokens=16, bootstrap=400)


def test_token_measures_by_hand() -> None:
    # one window, two positions, vocabulary of 3
    ref = torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]]]).log()
    new = torch.tensor([[[0.25, 0.5, 0.25], [0.2, 0.5, 0.3]]]).log()
    targets = torch.tensor([[0, 2]])
    m = token_measures(ref, new, targets)
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    kl1 = 0.1 * math.log(0.1 / 0.2) + 0.6 * math.log(0.6 / 0.5)
    torch.testing.assert_close(m["kl"], torch.tensor([[kl0, kl1]], dtype=torch.float64))
    assert m["top1_agree"].tolist() == [[0.0, 1.0]]
    # NLL of the true token: position 0 token 0 (0.5 -> 0.25), position 1 token 2 (0.3 -> 0.3)
    torch.testing.assert_close(m["nll_delta"], torch.tensor([[math.log(2.0), 0.0]], dtype=torch.float64))


def test_bootstrap_resamples_windows() -> None:
    gen = torch.Generator().manual_seed(0)
    same = bootstrap_interval(torch.full((5, 7), 0.25, dtype=torch.float64), 200, gen)
    assert (same.mean, same.low, same.high) == (0.25, 0.25, 0.25)
    # windows that differ: the interval brackets the mean and is not degenerate; tokens inside a
    # window do not count as independent (a window of many equal tokens is still one sample)
    values = torch.tensor([[0.0] * 50, [1.0] * 50], dtype=torch.float64)
    spread = bootstrap_interval(values, 400, gen)
    assert spread.mean == 0.5 and spread.low <= 0.25 and spread.high >= 0.75


@pytest.fixture(scope="module")
def rows():
    configs = [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="oea", k0=1),
        PrunerConfig(policy="xshare", k0=1, budget=8),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=4, budget=0),
    ]
    return run_quality(configs, settings=SMALL, draft_dir=default_draft_dir()).rows


def test_unpruned_is_its_own_reference(rows) -> None:
    none = rows[0]
    assert none.policy == "none" and none.batch == "decode R=4"
    assert none.kl.high < 1e-6 and none.top1_agree.low == 1.0 and abs(none.nll_delta.mean) < 1e-5
    assert none.speedup == 1.0 and none.experts == none.natural_experts
    assert none.tokens == 3 * SMALL.windows_per_domain * SMALL.window_tokens


def test_policies_are_told_apart(rows) -> None:
    oea, xshare = rows[1], rows[2]
    # oea k0=1 keeps each token's top-1 only: it reads fewer experts and costs more quality than
    # xshare with a budget of 8, and the intervals say so
    assert oea.experts < xshare.experts < xshare.natural_experts
    assert oea.speedup > xshare.speedup > 1.0
    assert oea.kl.low > xshare.kl.high > 0
    assert oea.top1_agree.high < xshare.top1_agree.low < 1.0
    assert oea.nll_delta.mean > xshare.nll_delta.mean
    for row in rows[1:]:
        for interval in (row.kl, row.top1_agree, row.nll_delta):
            assert interval.low <= interval.mean <= interval.high


def test_verify_policies_run_on_verify_batches(rows) -> None:
    spec = rows[3]
    assert spec.batch == "verify R=4 D=4"
    # per request of D=4 tokens, at most request_budget + k0 * D experts each; the union over R=4
    # requests stays below the unpruned union of the same 16-row calls
    assert spec.experts < spec.natural_experts
    assert spec.kl.mean > 0 and spec.top1_agree.mean < 1.0
    # acceptance under pruned verify, against the same speculative decoding with unpruned verify
    for interval in (spec.accept_len, spec.unpruned_accept_len):
        assert 0 <= interval.low <= interval.mean <= interval.high <= SMALL.draft_tokens - 1
    assert spec.unpruned_accept_len.mean > 0  # the draft model does get tokens accepted
    assert all(row.accept_len is None for row in rows[:3])  # decode policies have no verify


def test_verify_forwards_group_each_requests_tokens() -> None:
    model, tokenizer = load_tiny_model()
    windows, _ = heldout_windows(tiny_model_dir(), tokenizer, 1, 8)
    cfg = PrunerConfig(policy="moe-spec", max_experts=1, scope="request")
    _, stats = teacher_forced_logprobs(model, windows, cfg, requests=3, step_tokens=4)
    assert {s.phase for s in stats} == {"verify"}
    assert {s.rows for s in stats} == {12}  # R=3 requests x D=4 tokens per layer call
    # one expert per request: at most 3 distinct experts per call, never more
    assert max(s.activated for s in stats) <= 3 < max(s.natural_activated for s in stats)


def test_cli_writes_json_and_plot(tmp_path) -> None:
    from xshare_sglang.cli import main

    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([{"policy": "xshare", "k0": 1, "budget": 4}]))
    out = tmp_path / "q.json"
    code = main(
        [
            "quality",
            "--configs",
            str(configs),
            "--requests",
            "3",
            "--windows",
            "1",
            "--tokens",
            "8",
            "--bootstrap",
            "50",
            "--json",
            str(out),
            "--plot-dir",
            str(tmp_path / "plots"),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    rows, routing = report["rows"], report["routing"]
    assert [r["policy"] for r in rows] == ["none", "xshare"]  # the unpruned reference is always measured
    assert set(rows[1]) >= {"kl", "top1_agree", "nll_delta", "experts", "speedup"}
    assert (tmp_path / "plots" / "quality_pareto.png").stat().st_size > 0
    # the routing profile: 4 layers, entropy below uniform, a verify batch of 3 x 4 tokens reads
    # more than one token's top-4 and no more than all 32 experts or the 12 x 4 picks
    assert report["model"] == "tiny_moe" and len(routing["entropy"]) == len(routing["union"]) == 4
    assert all(0 < h < math.log(32) for h in routing["entropy"])
    assert all(4 < u <= min(32, 12 * 4) for u in routing["union"])
    assert routing["uniform_union"] == pytest.approx(32 * (1 - (1 - 4 / 32) ** 12))


BAD_ARGUMENTS = [
    (["--requests", "0"], "--requests"),
    (["--tokens", "30"], "--tokens=30"),
    (["--windows", "0"], "--windows"),
    (["--draft-tokens", "-1"], "--draft-tokens"),
    (["--bootstrap", "0"], "--bootstrap"),
    (["--study", "--configs", "c.json"], "--study and --configs"),
    (["--calibration", "/tmp"], "--calibration /tmp: is a folder"),
    (["--configs", "/nonexistent/c.json"], "--configs /nonexistent/c.json: no such file"),
]
#: Run as a user runs them, ``python -m xshare_sglang quality ...`` in a fresh interpreter: a flag value
#: refused, a file refused.  Each of the others runs the same command in a process of its own too,
#: forked after one import of the package (``tests/forked_runs.py``).
BAD_ARGUMENTS_OWN_PROCESS = (0, 6)


@pytest.fixture(scope="module")
def forked_bad_arguments(tmp_path_factory) -> dict[str, dict]:
    cases = {
        f"case-{index}": {"module": "xshare_sglang", "args": ["quality", *argv]}
        for index, (argv, _) in enumerate(BAD_ARGUMENTS)
        if index not in BAD_ARGUMENTS_OWN_PROCESS
    }
    return run_forked(cases, tmp_path_factory.mktemp("quality-runs"))


@pytest.mark.parametrize(("argv", "flag"), BAD_ARGUMENTS)
def test_bad_arguments_exit_2_before_any_work(argv, flag, request) -> None:
    index = BAD_ARGUMENTS.index((argv, flag))
    if index in BAD_ARGUMENTS_OWN_PROCESS:
        result = subprocess.run(
            [sys.executable, "-m", "xshare_sglang", "quality", *argv], capture_output=True, text=True, timeout=120
        )
    else:
        forked = request.getfixturevalue("forked_bad_arguments")[f"case-{index}"]
        result = subprocess.CompletedProcess(argv, forked["returncode"], forked["stdout"], forked["stderr"])
    assert result.returncode == 2
    assert flag in result.stderr and "Traceback" not in result.stderr
    assert "configurations" not in result.stdout  # nothing was measured


def test_second_model_routes_like_qwen3_and_is_not_trivial() -> None:
    """The shipped 128-expert model: Qwen3-MoE's routing shape, under 30 MB, and routing that leaves a
    pruner something to do (not uniform, not collapsed onto a few experts)."""
    from xshare_sglang.tiny.tiny_model import tiny_model_dir

    folder = tiny_model_dir("e128")
    config = json.loads((folder / "config.json").read_text())
    assert config.get("num_experts", config.get("num_local_experts")) == 128
    assert config["num_experts_per_tok"] == 8 and config["norm_topk_prob"] is True
    assert (folder / "model.safetensors").stat().st_size < 30 * 2**20
    for name in ("MODEL_CARD.md", "loss_curve.png", "training_log.json", "LICENSE.gsm8k.MIT", "heldout_code.jsonl"):
        assert (folder / name).is_file(), name
    settings = QualitySettings(requests=8, draft_tokens=4, windows_per_domain=1, window_tokens=8, bootstrap=50)
    report = run_quality(
        [PrunerConfig(), PrunerConfig(policy="xshare", k0=1, budget=8)], settings=settings, model_dir=folder
    )
    routing = report.routing
    assert routing.num_experts == 128 and routing.top_k == 8 and len(routing.entropy) == 4
    assert all(1.0 < h < math.log(128) - 0.1 for h in routing.entropy)
    # a verify call of 3 windows x 4 tokens (the last batch of 3) or 8 x 4 reads more than one token's 8
    # experts and fewer than the independent-uniform expectation
    assert all(8 < u < routing.uniform_union for u in routing.union)
    none, xshare = report.rows
    assert xshare.experts < none.experts and xshare.top1_agree.mean < 1.0


def _row(family: str, params: str, speedup: float, low: float, high: float) -> QualityRow:
    mid = (low + high) / 2
    zero = Interval(0.0, 0.0, 0.0)
    return QualityRow(
        policy=family.split()[0],
        params=params,
        batch="decode R=8",
        tokens=100,
        kl=zero,
        top1_agree=Interval(mid, low, high),
        nll_delta=zero,
        experts=1.0,
        natural_experts=2.0,
        speedup=speedup,
        family=family,
    )


def test_pareto_verdicts_by_hand() -> None:
    rows = [
        _row("none", "", 1.0, 1.0, 1.0),
        _row("xshare", "k0=1 budget=0", 3.0, 0.40, 0.50),  # frontier
        _row("xshare", "k0=1 budget=4", 2.0, 0.60, 0.70),  # frontier
        _row("lynx", "alpha=2.0", 1.5, 0.55, 0.65),  # beaten by xshare budget=4: not on the frontier
        _row("moe-spec", "max_experts=8", 2.0, 0.50, 0.60),
        _row("moe-spec", "max_experts=16", 1.2, 0.75, 0.85),  # frontier
        # the new family beats xshare budget=0 (3.0 >= 3.0, 0.52 > 0.50) and xshare budget=4 (2.5 >= 2.0,
        # 0.72 > 0.70), but not moe-spec max_experts=16 (intervals overlap)
        _row("moe-spec ranking=coverage", "max_experts=8", 3.0, 0.52, 0.62),
        _row("moe-spec ranking=coverage", "max_experts=16", 2.5, 0.72, 0.80),
        # a second new family that every seed beats
        _row("moe-spec ranking=coactivation", "max_experts=8", 1.0, 0.10, 0.20),
    ]
    coverage, coactivation = pareto_verdicts(rows)
    assert coverage.family == "moe-spec ranking=coverage" and coverage.dominates
    assert coverage.dominated == ("xshare k0=1 budget=0", "xshare k0=1 budget=4")
    assert coverage.beaten_by == ()
    assert coverage.versus_router == ((8, "same"), (16, "same"))
    assert not coactivation.dominates and coactivation.dominated == ()
    assert coactivation.beaten_by == ("max_experts=8",) and coactivation.versus_router == ((8, "worse"),)


def test_study_calibrates_then_compares(tmp_path) -> None:
    """``quality --study`` writes the calibration file first, runs seeds and new families, and reports
    a verdict per new family in the JSON next to the study plot."""
    from xshare_sglang.cli import main

    calibration = tmp_path / "calibration.json"
    out = tmp_path / "study.json"
    argv = ["quality", "--study", "--requests", "3", "--windows", "1", "--tokens", "8", "--bootstrap", "50"]
    argv += ["--draft", "none", "--calibration", str(calibration), "--json", str(out), "--plot-dir", str(tmp_path)]
    assert main(argv) == 0
    saved = json.loads(calibration.read_text())
    assert len(saved["coactivation"]) == 4 and len(saved["budget_curves"][0]) == 33
    report = json.loads(out.read_text())
    families = {v["family"] for v in report["verdicts"]}
    assert families == {
        "moe-spec ranking=coverage",
        "moe-spec budget_allocation=calibrated",
        "moe-spec ranking=coverage budget_allocation=calibrated",
        "moe-spec ranking=coactivation",
    }
    assert all(len(v["versus_router"]) == 6 for v in report["verdicts"])
    assert (tmp_path / "quality_study.png").stat().st_size > 0
