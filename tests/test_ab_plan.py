"""The A/B tool without servers: arms and settings validation, the plan and its --dry-run text, the
summary statistics recomputed by hand from synthetic records, and the Pareto front."""

from __future__ import annotations

import json
import shlex

import pytest

from xshare_sglang.serving.ab.ab_cli import main
from xshare_sglang.serving.ab.ab_config import AbConfigError, AbSettings, Arm, candidate_arm, read_arms_file
from xshare_sglang.serving.ab.ab_plan import build_plan
from xshare_sglang.serving.ab.ab_plot import pareto_front
from xshare_sglang.serving.ab.ab_report import render_markdown, summarize
from xshare_sglang.serving.datasets import custom_conversations, gsm8k_path, write_custom_dataset

MOE_SPEC = '{"policy": "moe-spec", "max_experts": 48}'


def settings(tmp_path, **overrides):
    base = dict(
        model_path="Qwen/Qwen3-30B-A3B",
        arms=(candidate_arm("xshare"), Arm(name="baseline")),
        output_dir=tmp_path / "out",
        concurrencies=(8, 1),
        datasets=("random-ids", "mt-bench"),
        repeats=2,
    )
    base.update(overrides)
    return AbSettings(**base)


# ---------------------------------------------------------------- arms and settings
def test_baseline_goes_first_and_is_added_when_missing(tmp_path):
    s = settings(tmp_path)
    assert [a.name for a in s.arms] == ["baseline", "xshare"]
    s = settings(tmp_path, arms=(candidate_arm(MOE_SPEC), candidate_arm("xshare")))
    assert [a.name for a in s.arms] == ["baseline", "moe-spec-maxexperts48", "xshare"]
    assert s.arms[0].is_baseline and s.arms[0].launch_flags() == []
    assert s.concurrencies == (1, 8)


def test_candidate_specs_are_validated_with_the_plugin_settings():
    arm = candidate_arm('{"policy": "xshare-spec", "k0": 1, "name": "spec"}')
    assert arm.name == "spec" and arm.expected_policy == "xshare-spec"
    assert arm.launch_flags() == ["--moe-pruner-config", '{"policy":"xshare-spec","k0":1}']
    # a verify-phase override makes two policies, joined as the proof line joins them
    two = candidate_arm('{"policy": "xshare", "verify": {"policy": "moe-spec", "max_experts": 48}}')
    assert two.expected_policy == "moe-spec,xshare"
    with pytest.raises(AbConfigError, match=r"--candidate.*policy"):
        candidate_arm("xshare-typo")
    with pytest.raises(AbConfigError, match=r"--candidate.*k0"):
        candidate_arm('{"policy": "xshare", "k0": -1}')
    with pytest.raises(AbConfigError, match="prunes nothing"):
        candidate_arm("none")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--moe-pruner xshare", "pruner flag"),
        ("--xshare-echo-budget 4", "pruner flag"),
        ("--port 31000", "set by the A/B tool"),
        ("--model-path other", "set by the A/B tool"),
    ],
)
def test_server_args_may_not_hold_pruner_or_managed_flags(tmp_path, flags, message):
    with pytest.raises(AbConfigError, match=message):
        settings(tmp_path, server_args=tuple(shlex.split(flags)))
    with pytest.raises(AbConfigError, match=message):
        Arm(name="x", pruner={"policy": "xshare"}, server_args=tuple(shlex.split(flags)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"concurrencies": (0,)}, "--concurrency"),
        ({"concurrencies": ()}, "--concurrency"),
        ({"datasets": ("sharegpt",)}, "--dataset 'sharegpt': allowed values are random-ids, mt-bench, gsm8k"),
        ({"repeats": 0}, "--repeats"),
        ({"output_len": 2}, "--output-len"),
        ({"model_path": ""}, "--model-path"),
        ({"arms": (Arm(name="baseline"),)}, "no candidate arm"),
        ({"arms": (candidate_arm("xshare"), candidate_arm("xshare"))}, "repeated: xshare"),
        ({"arms": (Arm(name="baseline", pruner={"policy": "xshare"}),)}, "reserved"),
        ({"datasets": (), "accuracy": False}, "nothing to run"),
    ],
)
def test_invalid_settings_name_the_flag(tmp_path, overrides, message):
    with pytest.raises(AbConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings(tmp_path, **overrides)


def test_several_pruner_off_arms_one_baseline(tmp_path):
    """Pruner-off arms besides the baseline (another SGLang configuration alone) are compared with it as
    candidates are: the baseline is the one named 'baseline', else the first pruner-off arm given."""
    fixed, adaptive = Arm(name="fixed"), Arm(name="adaptive", server_args=("--speculative-adaptive",))
    arms = settings(tmp_path, arms=(adaptive, candidate_arm("xshare"), fixed)).arms
    assert [(a.name, a.is_baseline, a.unpruned) for a in arms] == [
        ("adaptive", True, True),
        ("xshare", False, False),
        ("fixed", False, True),
    ]
    named = settings(tmp_path, arms=(adaptive, candidate_arm("xshare"), Arm(name="baseline"))).arms
    assert [(a.name, a.is_baseline) for a in named] == [("baseline", True), ("adaptive", False), ("xshare", False)]


def test_arms_file_yaml_and_json(tmp_path):
    path = tmp_path / "arms.yaml"
    path.write_text(
        "model_path: m\nserver_args: --tp 2 --moe-runner-backend triton\narms:\n"
        "  - name: base\n"
        "  - name: x8\n    pruner: {policy: xshare, budget: 8}\n    server_args: [--cuda-graph-max-bs-decode, 64]\n"
    )
    doc = read_arms_file(path)
    assert doc["model_path"] == "m"
    assert doc["server_args"] == ("--tp", "2", "--moe-runner-backend", "triton")
    base, x8 = doc["arms"]
    assert base.unpruned and x8.pruner == {"policy": "xshare", "budget": 8}
    assert x8.server_args == ("--cuda-graph-max-bs-decode", "64")
    (tmp_path / "arms.json").write_text(json.dumps({"arms": [{"name": "x", "pruner": {"policy": "lynx"}}]}))
    assert read_arms_file(tmp_path / "arms.json")["arms"][0].expected_policy == "lynx"
    (tmp_path / "bad.yaml").write_text("arms:\n  - name: x\n    prunr: {policy: xshare}\n")
    with pytest.raises(AbConfigError, match=r"unknown keys \['prunr'\]"):
        read_arms_file(tmp_path / "bad.yaml")
    with pytest.raises(AbConfigError, match="no such file"):
        read_arms_file(tmp_path / "missing.yaml")


def test_cli_errors_exit_2_with_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--model-path", "m", "--candidate", "nope", "--dry-run", "--output-dir", str(tmp_path)])
    assert exc.value.code == 2
    assert "--candidate" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--model-path", "m", "--candidate", "xshare", "--url", "xshare=http://h:1", "--dry-run"])
    assert exc.value.code == 2
    assert "every arm needs a server; missing baseline" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--model-path", "m", "--candidate", "xshare", "--server-log", "xshare=/x.log", "--dry-run"])
    assert "only for servers given by --url" in capsys.readouterr().err


# ---------------------------------------------------------------- plan
def test_plan_rotates_arms_and_runs_every_dataset_and_concurrency(tmp_path):
    s = settings(tmp_path, arms=(candidate_arm("xshare"), candidate_arm(MOE_SPEC)), repeats=4)
    sessions = build_plan(s)
    assert [(x.repeat, x.arm.name) for x in sessions] == [
        (1, "baseline"),
        (1, "xshare"),
        (1, "moe-spec-maxexperts48"),
        (2, "xshare"),
        (2, "moe-spec-maxexperts48"),
        (2, "baseline"),
        (3, "moe-spec-maxexperts48"),
        (3, "baseline"),
        (3, "xshare"),
        (4, "baseline"),
        (4, "xshare"),
        (4, "moe-spec-maxexperts48"),
    ]
    assert [x.index for x in sessions] == list(range(12))
    assert all(f"{x.index:03d}-r{x.repeat}-{x.arm.name}" == x.server_log.stem for x in sessions)
    for session in sessions:
        serving = [r for r in session.runs if r.kind == "serving"]
        assert [(r.dataset, r.concurrency) for r in serving] == [
            ("random-ids", 1),
            ("random-ids", 8),
            ("mt-bench", 1),
            ("mt-bench", 8),
        ]
        assert [r.kind for r in session.runs][-1] == "accuracy"
        argv = session.launch_argv
        assert argv[argv.index("--port") + 1] == "30000" and "--enable-metrics" in argv
        assert ("--moe-pruner-config" in argv) == (not session.arm.unpruned)
        c8 = serving[1].argv
        assert c8[c8.index("--num-prompts") + 1] == "64" and c8[c8.index("--max-concurrency") + 1] == "8"
        assert c8[c8.index("--random-input-len") + 1] == "1024"
        mt = serving[2].argv
        assert mt[mt.index("--dataset-name") + 1] == "custom"
        assert mt[mt.index("--sharegpt-output-len") + 1] == "256"
        gsm = session.runs[-1].argv
        assert gsm[gsm.index("--data-path") + 1] == str(gsm8k_path())
    # every session writes to its own folder
    outputs = [r.output_path for x in sessions for r in x.runs]
    assert len(set(outputs)) == len(outputs)


def test_dry_run_prints_every_command_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "--model-path",
            "Qwen/Qwen3-30B-A3B",
            "--candidate",
            "xshare",
            "--concurrency",
            "1",
            "4",
            "--dataset",
            "gsm8k",
            "--repeats",
            "2",
            "--output-dir",
            str(out),
            "--dry-run",
            "--server-args",
            "--tp 1 --speculative-algorithm EAGLE3",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0 and not out.exists()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    launches = [
        shlex.split(line.removesuffix(" &").split(" > ")[0]) for line in lines if "sglang.launch_server" in line
    ]
    assert len(launches) == 4
    assert ["--moe-pruner-config" in argv for argv in launches] == [False, True, True, False]  # rotated
    assert all(argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3" for argv in launches)
    benches = [line for line in lines if "sglang.benchmark.serving" in line]
    assert len(benches) == 4 * 2
    assert all("--dataset-name custom" in b and "datasets/gsm8k.jsonl" in b for b in benches)
    assert sum("sglang.test.few_shot_gsm8k" in line for line in lines) == 4
    assert text.count("moe-pruner active: policy=xshare") == 2


def test_shipped_workloads(tmp_path):
    mt = custom_conversations("mt-bench")
    assert len(mt) == 160 and all(row["conversations"][1]["content"] == "" for row in mt)
    gsm = custom_conversations("gsm8k")
    assert len(gsm) == 1319
    first = gsm[0]["conversations"]
    assert first[0]["content"].startswith("Question: Janet") and first[0]["content"].endswith("\nAnswer:")
    assert first[1]["content"].endswith("#### 18")
    path = write_custom_dataset("gsm8k", tmp_path / "d" / "gsm8k.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == gsm
    with pytest.raises(ValueError, match="allowed: mt-bench, gsm8k"):
        custom_conversations("sharegpt")


# ---------------------------------------------------------------- summary
def _serving(arm, repeat, tput, tpot, *, baseline=False, dataset="random-ids", concurrency=8, activated=None):
    return {
        "record": "serving", "arm": arm, "repeat": repeat, "baseline": baseline, "dataset": dataset,
        "concurrency": concurrency, "status": "ok",
        "metrics": {"output_throughput": tput, "median_tpot_ms": tpot, "accept_length": None},
        "pruner_metrics": None if activated is None else {"activated_experts": activated},
    }  # fmt: skip


def _accuracy(arm, repeat, acc, *, baseline=False):
    return {"record": "accuracy", "arm": arm, "repeat": repeat, "baseline": baseline, "status": "ok",
            "metrics": {"accuracy": acc, "invalid": 0.0}}  # fmt: skip


def test_summary_pairs_repetitions():
    rows = [
        _serving("baseline", 1, 100.0, 10.0, baseline=True),
        _serving("x", 1, 120.0, 8.0, activated=40.0),
        _serving("baseline", 2, 110.0, 11.0, baseline=True),
        _serving("x", 2, 121.0, 10.0, activated=42.0),
        _serving("baseline", 3, 90.0, 9.0, baseline=True),
        {**_serving("x", 3, 0.0, 0.0), "status": "failed", "error": "exit code 1"},
        _accuracy("baseline", 1, 0.80, baseline=True),
        _accuracy("x", 1, 0.75),
        _accuracy("baseline", 2, 0.82, baseline=True),
        _accuracy("x", 2, 0.82),
    ]
    summary = summarize(rows)
    base, x = summary.serving
    assert base.baseline and base.output_throughput == 100.0 and base.throughput_delta.pairs == 0
    assert (base.throughput_low, base.throughput_high) == (90.0, 110.0)
    # pairs: 120/100-1 = 0.20, 121/110-1 = 0.10; repetition 3 failed on the candidate's side
    assert x.throughput_delta.pairs == 2
    assert x.throughput_delta.median == pytest.approx(0.15)
    assert (x.throughput_delta.low, x.throughput_delta.high) == (pytest.approx(0.10), pytest.approx(0.20))
    assert x.tpot_delta.median == pytest.approx(((8 / 10 - 1) + (10 / 11 - 1)) / 2)
    assert x.activated_experts == 41.0 and x.output_throughput == 120.5
    acc_base, acc_x = summary.accuracy
    assert acc_base.accuracy == pytest.approx(0.81)
    assert acc_x.delta_points.median == pytest.approx(-2.5)  # -5 and 0 points
    assert (acc_x.delta_points.low, acc_x.delta_points.high) == (pytest.approx(-5.0), pytest.approx(0.0))
    assert any("repetition 3, arm x, random-ids c=8: failed: exit code 1" in f for f in summary.failures)
    text = render_markdown(summary)
    assert "| 8 | x | 120.5 | +15.0% [+10.0, +20.0] (n=2) |" in text
    assert "| x | 0.785 | -2.5 [-5.0, +0.0] (n=2) |" in text


def test_pareto_front():
    points = [("base", 100.0, 0.90), ("a", 120.0, 0.90), ("b", 130.0, 0.85), ("c", 110.0, 0.80), ("d", 130.0, 0.85)]
    # a dominates base (faster, same accuracy); c is dominated by a; b and d tie and both stay
    assert pareto_front(points) == ["a", "b", "d"]
