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


SELECTION_POLICIES = [
    "oea",
    "xshare",
    "xshare-threshold",
    "xshare-ep",
    "moe-spec",
    "moe-spec-static",
    "moe-spec-coverage",
    "moe-spec-coact",
    "lynx",
    "xshare-spec",
    "moe-spec-request",
]


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
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "selection.json").read_text())
    meta, rows = report["meta"], report["rows"]
    assert meta["device"].startswith("cpu (smoke run")
    assert meta["errors"] == [] and meta["skipped"] == []
    # every policy at both token counts on a plain softmax router and a grouped, biased, scaled sigmoid one
    expected = [(m, t, p) for m in ("tiny", "tiny-grouped") for t in (1, 40) for p in SELECTION_POLICIES]
    assert sorted((r["model"], r["T"], r["policy"]) for r in rows) == sorted(expected)
    from xshare_sglang.kernels import plan_launch

    for r in rows:
        # one launch while the call is one tile (or one request), the selection then the routing above
        # (static moe-spec: the routing alone, its calibrated mask derived by every routing program)
        single = plan_launch(r["T"], r["E"], r["D"], r["D"] > 1).single
        assert single == (r["T"] == 1), r  # T=1 is one tile, T=40 never is
        lynx_picks = ["lynx_pick_kernel"] if r["policy"] == "lynx" else []
        selection = [] if r["policy"] == "moe-spec-static" else ["select_kernel"]
        want = ["select_kernel"] if single else [*selection, *lynx_picks, "route_kernel"]
        assert r["launches"] == len(want), r
        assert r["kernels"] == "+".join(want), r
        assert r["ids_equal"] and r["weights_close"] and r["metrics_equal"] and r["eager_alloc_bytes"] == 0, r
        assert r["checks_ok"] and r["goal_met"] is None  # CPU times are not judged
        assert r["D"] == (4 if r["policy"] in ("xshare-spec", "moe-spec-request") else 1)
        assert r["with_metrics"], r  # timed as the serving plugin calls it
    assert (tmp_path / "selection.csv").read_text().startswith("model,E,top_k,T,D,policy,settings,kept,launches")
    assert "| model | T | D | policy |" in (tmp_path / "selection.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")
def test_bench_selection_without_the_metrics_row(tmp_path) -> None:
    """--no-metrics times the same calls with no metrics row: the kernels then write no metrics (the
    check compares the untouched row with a reference that kept none) and the report says so."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "bench_selection.py"), "--smoke", "--no-metrics"]
    command += ["--models", "tiny", "--policies", "oea,xshare,moe-spec-static", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "selection.json").read_text())["rows"]
    want = [(t, p) for t in (1, 40) for p in ("oea", "xshare", "moe-spec-static")]
    assert sorted((r["T"], r["policy"]) for r in rows) == sorted(want)
    for r in rows:
        assert not r["with_metrics"] and r["metrics_equal"] and r["checks_ok"], r
    assert "WITHOUT metrics" in (tmp_path / "selection.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")
def test_bench_selection_with_a_closed_metrics_gate(tmp_path) -> None:
    """--metrics-gate closed times the calls of a forward the server does not sample: the row is passed
    with a gate of 0, so the kernels add nothing (the check compares the row with a reference that
    added nothing either); the report says so.  With --no-metrics the option is refused."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "bench_selection.py"), "--smoke", "--metrics-gate", "closed"]
    command += ["--models", "tiny", "--policies", "oea,xshare,lynx", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "selection.json").read_text())["rows"]
    assert sorted((r["T"], r["policy"]) for r in rows) == sorted(
        (t, p) for t in (1, 40) for p in ("oea", "xshare", "lynx")
    )
    for r in rows:
        assert r["with_metrics"] and r["metrics_equal"] and r["checks_ok"], r
    assert "its gate closed (--metrics-gate)" in (tmp_path / "selection.md").read_text()
    refused = subprocess.run([*command, "--no-metrics"], capture_output=True, text=True, env=env, timeout=600)
    assert refused.returncode == 2 and "--metrics-gate gates the metrics row" in refused.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")
def test_bench_selection_with_the_selections_retained_mass(tmp_path) -> None:
    """--select-mass (gpu_check's mass stage) sums oea's retained mass in the selection, the other side
    of the one open switch: every call still equals the reference, and the report says which side it
    timed."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "bench_selection.py"), "--smoke", "--select-mass"]
    command += ["--models", "tiny", "--policies", "moe-spec-coact,moe-spec-coverage,oea", "--out-dir", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "selection.json").read_text())
    assert sorted((r["T"], r["policy"]) for r in report["rows"]) == [
        (t, p) for t in (1, 40) for p in ("moe-spec-coact", "moe-spec-coverage", "oea")
    ]
    assert all(r["checks_ok"] for r in report["rows"]), report["rows"]
    assert report["meta"]["retained_mass"] == "summed by the selection (--select-mass)"
    assert "LYNX above one program: summed by the selection (--select-mass)." in (tmp_path / "selection.md").read_text()


def _kernel_sass_rows(model: str, tokens: str, policies: str, *flags: str) -> dict[tuple[str, str, str], list[str]]:
    """kernel_sass.py --loops compiled with the installed Triton: ``{(T, policy, kernel): cells}``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "--models", model, "--loops"]
    command += ["--tokens", tokens, "--policies", policies, *flags]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [[cell.strip() for cell in line.split("|")] for line in result.stdout.splitlines()]
    return {(cells[2], cells[3], cells[4]): cells for cells in rows if len(cells) > 5 and cells[1] == model}


def _loop_bodies(cells: list[str]) -> list[tuple[int, ...]]:
    """A kernel_sass row's loop bodies: (instructions, BAR, SHFL, global loads) of each loop."""
    return [tuple(int(n) for n in body.split("/")) for body in cells[-2].split()]


def test_kernel_sass_picks_in_every_warp_up_to_128_experts() -> None:
    """The co-activation ranking's pick loop has no barrier and no shuffle on 128 experts (every warp
    picks on its own copy of the gains), under whichever Triton is installed (CI: SGLang's 3.8), and
    has both on DeepSeek-V3's 256, where the picks are block-wide (plan.WARP_PICKS_MAX_EXPERTS)."""
    pick_loops = {}
    for model in ("qwen3-30b-a3b", "deepseek-v3"):
        rows = _kernel_sass_rows(model, "32", "moe-spec-coact")
        bodies = _loop_bodies(rows["32", "moe-spec-coact", "select"])
        # the pick loop: the shortest loop that loads (the row tiles' loops hold about 1000 instructions;
        # Triton 3.8 also reports loops around the pick loop, longer still)
        pick_loops[model] = min((body for body in bodies if body[3] >= 1), key=lambda body: body[0])
    instructions, barriers, shuffles, loads = pick_loops["qwen3-30b-a3b"]
    # each warp loads both halves of the picked row
    assert (barriers, shuffles, loads) == (0, 0, 2) and instructions > 50, pick_loops
    instructions, barriers, shuffles, loads = pick_loops["deepseek-v3"]
    assert barriers >= 1 and shuffles >= 1 and loads == 1, pick_loops


def test_kernel_sass_group_warps_route_rows_without_a_barrier_per_pick() -> None:
    """kernel_sass.py on DeepSeek-V3's router, policy ``none``: at T=1 (one program) and T=32 (the
    routing kernel, a program per row) each row routes on a warp per expert group (eight), and no loop
    of the kernel (the groups' picks, the row's picks among them) holds a barrier or a shuffle; at
    T=512, above 256 rows, the routing kernel takes tiles of 8 rows on a warp each."""
    rows = _kernel_sass_rows("deepseek-v3", "1,32,512", "none")
    cells = {"1": rows["1", "none", "select"], "32": rows["32", "none", "route"], "512": rows["512", "none", "route"]}
    for tokens in ("1", "32"):
        row = cells[tokens]
        loops = _loop_bodies(row)
        assert row[-3] == "8" and len(loops) >= 2, row
        assert all(barriers == 0 and shuffles == 0 for _, barriers, shuffles, _ in loops), row
    assert cells["32"][5] == "32" and cells["512"][5] == "64", cells  # programs: a row each, 8-row tiles


def test_bench_selection_topk_is_sglangs() -> None:
    """The benchmark's unpruned top-k (torch ops) routes exactly as SGLang's own select_experts."""
    from sglang.srt.layers.moe.topk import TopKConfig

    from tests.sglang_helpers import sglang_select_experts

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_selection

    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(256, generator=gen) * 0.05
    cases = [
        (bench_selection.MODEL_ROUTERS["qwen3-30b-a3b"], None, dict(scoring_func="softmax")),
        (bench_selection.MODEL_ROUTERS["gpt-oss-120b"], None, dict(scoring_func="softmax")),
        (
            bench_selection.MODEL_ROUTERS["deepseek-v3"],
            bias,
            dict(
                scoring_func="sigmoid",
                use_grouped_topk=True,
                num_expert_group=8,
                topk_group=4,
                correction_bias=bias,
                routed_scaling_factor=2.5,
                apply_routed_scaling_factor_on_output=True,
            ),
        ),
    ]
    for model, model_bias, extra in cases:
        router = model.router
        logits = torch.randn(37, model.shape.num_experts, generator=gen) * 2
        config = TopKConfig(top_k=router.top_k, renormalize=True, torch_native=True, layer_id=0, **extra)
        ref_ids, ref_weights = sglang_select_experts(config, logits)
        ids, weights = bench_selection.sglang_native_topk(logits, router, model_bias)
        order, ref_order = ids.sort(1), ref_ids.sort(1)
        assert torch.equal(order.values, ref_order.values.to(torch.int32)), model.shape.name
        got = weights.gather(1, order.indices)
        want = ref_weights.float().gather(1, ref_order.indices)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")
def test_bench_moe_layer_smoke(tmp_path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    # T=7 only keeps this under 30 s (the script's own --smoke default adds T=1)
    command = [sys.executable, str(ROOT / "scripts" / "bench_moe_layer.py"), "--smoke", "--tokens", "7"]
    command += ["--guard-repeats", "2"]  # the guard table's path, twice the work: too few timings to prune
    command += ["--pruned-config", "both"]  # the plugin's config path as well (no tuned file on CPU: SGLang's)
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
    # launches are profiled on a GPU only
    assert all(r["launches_pruned"] is None for r in rows)
    # the headline speed-up is against the unpruned layer routed by a fused top-k; the torch-op top-k's
    # layer is the extra column
    for r in rows:
        assert r["baseline"] == "fused top-k (policy none)" and r["baseline_torch_topk_us"] > 0
        assert r["speedup"] == pytest.approx(r["baseline_us"] / r["pruned_us"], rel=2e-3, abs=2e-3)
        assert r["speedup_torch_topk"] == pytest.approx(
            r["baseline_torch_topk_us"] / r["pruned_us"], rel=2e-3, abs=2e-3
        )
    assert all(r["pruned_le_baseline"] and r["activated_pruned"] <= r["activated_baseline"] for r in rows)
    # the roofline: max(weight bytes / bandwidth, FLOPs / the matmul peak measured in this run)
    assert meta["matmul_tflops"] > 0
    shapes = {"tiny": (64, 32, 2), "tiny-ep": (64, 32, 4)}  # H, I, k
    for r in rows:
        hidden, inter, top_k = shapes[r["model"]]
        assert 0 < r["slots_pruned"] <= r["T"] * top_k and 0 < r["slots_baseline"] <= r["T"] * top_k
        if r["model"] == "tiny":  # one rank: substitution never adds a slot (EP: picks can move onto this rank)
            assert r["slots_pruned"] <= r["slots_baseline"] == r["T"] * top_k
        for which in ("baseline", "pruned"):
            memory = r[f"activated_{which}"] * 3 * hidden * inter * 2 / (meta["bandwidth_gbps"] * 1e3)
            compute = r[f"slots_{which}"] * 6 * hidden * inter / (meta["matmul_tflops"] * 1e6)
            assert r[f"roofline_{which}_us"] == pytest.approx(max(memory, compute), rel=1e-2, abs=0.01)
            assert r[f"{which}_over_roofline"] == pytest.approx(r[f"{which}_us"] / r[f"roofline_{which}_us"], rel=1e-2)
        assert r["pruned_bound"] in ("memory", "compute") and r["target_roofline"] is None  # CPU: no targets
        if r["backend"] == "sglang":  # both configs timed; no tuned file for "cpu": the plugin keeps SGLang's
            assert r["pruned_sglang_config_us"] > 0 and r["config_gain"] > 0
            assert r["moe_config_pruned"] == r["moe_config"]
    for model in meta["models"].values():
        assert model["checks"]["align"] == "ok"
        assert model["checks"]["grouped_mm"].startswith("rel err")
        if meta["sglang_kernel"] != "not loaded":  # SGLang's own kernel file was found: it must pass too
            assert model["checks"]["sglang"].startswith("rel err")
    expected = "sglang" if meta["sglang_kernel"] != "not loaded" else "grouped_mm"
    assert all(r["backend"] == expected for r in rows)
    assert (tmp_path / "moe_layer.csv").read_text().startswith("model,phase,T,D,policy,settings,backend")
    assert "| phase | T | policy |" in (tmp_path / "moe_layer.md").read_text()
    assert "| roof us | b/roof | p/roof | m/c |" in (tmp_path / "moe_layer.md").read_text()
    guard = json.loads((tmp_path / "guard_table.json").read_text())
    keys = sorted((r["model"], r["phase"], r["T"], r["settings"]) for r in rows)
    assert sorted((g["model"], g["phase"], g["T"], g["settings"]) for g in guard["rows"]) == keys
    assert all(g["samples"] == 2 and not g["prune"] and g["reason"] == "2 timings, 3 needed" for g in guard["rows"])
    assert (
        "| model | phase | T | policy | settings | unpruned | pruned | runs | guard |"
        in (tmp_path / "guard_table.md").read_text()
    )


def test_guard_rows_decide_from_repeated_runs() -> None:
    from xshare_sglang.bench.moe_layer import guard_rows

    def row(base, repeat, pruned, tokens=8):
        return {
            "model": "m",
            "phase": "decode",
            "T": tokens,
            "policy": "xshare",
            "settings": "k0=1",
            "baseline_us": base,
            "baseline_repeat_us": repeat,
            "pruned_us": pruned,
        }

    runs = [[row(10.0, 10.2, 6.0), row(5.0, 5.0, 5.1, tokens=1)] for _ in range(2)]
    runs.append([row(9.8, 10.1, 30.0), row(5.0, 5.1, 4.9, tokens=1)])  # one slow pruned outlier
    decode_8, decode_1 = guard_rows(runs, 0.05)
    assert (decode_8["T"], decode_8["prune"], decode_8["samples"]) == (8, True, 3)
    assert decode_8["baseline_us"] == 10.05 and decode_8["pruned_us"] == 6.0  # medians of 6 and of 3 samples
    assert (decode_1["T"], decode_1["prune"]) == (1, False)


def test_kernel_sass_reports_each_launch(tmp_path) -> None:
    """scripts/kernel_sass.py compiles each launch of a call for sm_90 (no GPU) and counts its SASS: one
    kernel at T=1, two at T=64 (none: the routing alone), and a policy's selection adds code to the
    kernel of ``none``."""
    out = tmp_path / "sass.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "--models", "qwen3-30b-a3b"]
    command += ["--tokens", "1,64", "--policies", "none,xshare", "--out", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| qwen3")]
    table = {(int(r[1]), r[2].strip(), r[3].strip()): [c.strip() for c in r] for r in rows}
    assert set(table) == {
        (1, "none", "select"),
        (1, "xshare", "select"),
        (64, "none", "route"),  # none above one tile: the routing kernel alone
        (64, "xshare", "select"),
        (64, "xshare", "route"),
    }
    instructions = {key: int(row[5]) for key, row in table.items()}
    assert all(n > 100 for n in instructions.values())
    assert instructions[(1, "xshare", "select")] > instructions[(1, "none", "select")]
    from xshare_sglang.kernels import plan_launch

    programs = plan_launch(64, 128, 1, False).num_parts
    assert programs > 1
    # every program adds its share into one accumulator; no register spills to local memory
    assert table[(64, "xshare", "select")][13] == f"{programs} atomic"
    assert all(row[11] == "0" for row in table.values()), table


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is for machines without a GPU")
def test_bench_kernel_routing_smoke(tmp_path) -> None:
    pytest.importorskip("triton_kernels.topk", reason="needs triton_kernels (SGLang's dependency)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "kernel_routing.csv"
    command = [sys.executable, str(ROOT / "scripts" / "bench_kernel_routing.py"), "--smoke", "--tokens", "1,9"]
    result = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    import csv

    rows = list(csv.DictReader(out.open()))
    # both routers, both token counts, every policy; CPU figures are marked as no timing
    assert sorted({(r["router"], r["T"]) for r in rows}) == [
        ("gpt-oss-120b", "1"),
        ("gpt-oss-120b", "9"),
        ("gpt-oss-20b", "1"),
        ("gpt-oss-20b", "9"),
    ]
    assert len(rows) == 4 * 3 and all(r["device"].startswith("cpu (smoke") for r in rows)
    assert result.stdout.count("| gpt-oss-") == len(rows)


def test_carry_triton_kernels_defines_what_triton_36_lacks(tmp_path) -> None:
    """``scripts/carry_triton_kernels.py`` copies the installed ``triton_kernels`` into the given folder
    with ``is_hip_gfx1250`` defined in the copy instead of imported from Triton (3.6 lacks it), and
    refuses a package whose import it does not recognize rather than copy it unchanged."""
    triton_kernels = pytest.importorskip("triton_kernels", reason="needs triton_kernels (SGLang's dependency)")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "carry_triton_kernels.py"), "--destination", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    source = Path(triton_kernels.__file__).parent
    copy = tmp_path / "triton_kernels"
    original, changed = (source / "target_info.py").read_text(), (copy / "target_info.py").read_text()
    assert "    is_hip_gfx1250,\n" in original and "    is_hip_gfx1250,\n" not in changed
    assert "def is_hip_gfx1250():" in changed
    compile(changed, "target_info.py", "exec")  # still Python
    assert not list(copy.rglob("__pycache__"))
    assert (copy / "topk.py").read_text() == (source / "topk.py").read_text()  # the rest unchanged
    again = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "carry_triton_kernels.py"), "--destination", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},  # the copy itself, already changed
    )
    assert again.returncode != 0 and "no single import of is_hip_gfx1250" in again.stderr


def _selection_csv(path: Path, rows: list[tuple]) -> Path:
    """A ``selection.csv`` with the fields ``selection_table.py`` reads (and one it does not)."""
    header = "model,T,policy,selection_us,none_us,layer_us,checks_ok\n"
    body = "".join(",".join(map(str, row)) + ",True\n" for row in rows)
    path.write_text(header + body, encoding="utf-8")
    return path


def test_selection_table_from_a_csv(tmp_path) -> None:
    """The docs' added-cost table: selection minus none per T (bold at most 2 µs), none's median per T,
    share and worst 1% excess over layers of at least 70 µs only, another run's figures in brackets and
    the range of the changes per band of T."""
    new = _selection_csv(
        tmp_path / "new.csv",
        [
            ("qwen3-30b-a3b", 1, "xshare", 4.5, 2.5, 50.0),  # layer under 70 us: no share
            ("qwen3-30b-a3b", 1, "oea", 5.0, 2.9, 60.0),
            ("qwen3-30b-a3b", 32, "xshare", 12.0, 3.0, 100.0),  # share 12%, excess 11.0
            ("qwen3-30b-a3b", 512, "xshare", 12.0, 3.0, 400.0),  # share 3%, excess 8.0
            ("deepseek-v3", 8, "oea", 6.0, 5.0, 80.0),  # added 1.0: the goal; share 7.5%, excess 5.2
        ],
    )
    old = _selection_csv(
        tmp_path / "old.csv",
        [("qwen3-30b-a3b", 1, "xshare", 5.0, 2.0, 50.0), ("qwen3-30b-a3b", 512, "xshare", 10.0, 3.0, 400.0)],
    )
    script = [sys.executable, str(ROOT / "scripts" / "selection_table.py")]
    out = subprocess.run([*script, str(new)], capture_output=True, text=True, check=True, timeout=60).stdout
    lines = out.splitlines()
    assert lines[2] == "| Qwen3-30B-A3B | `none` (absolute, median of the rows) | 2.7 | - | 3.0 | - | - | - | 3.0 | | |"
    assert lines[3] == "| | xshare | **2.0** | - | 9.0 | - | - | - | 9.0 | 3.0-12.0% | 11.0 us (T=32) |"
    assert lines[4] == "| | oea | 2.1 | - | - | - | - | - | - |  |  |"
    assert lines[5] == "| DeepSeek-V3 | `none` (absolute, median of the rows) | - | 5.0 | - | - | - | - | - | | |"
    assert lines[6] == "| | oea | - | **1.0** | - | - | - | - | - | 7.5-7.5% | 5.2 us (T=8) |"
    assert len(lines) == 7  # no DeepSeek-V3 xshare line: the file has none, and no GPT-OSS router at all
    out = subprocess.run(
        [*script, str(new), "--against", str(old), "--policies", "xshare"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    lines = out.splitlines()
    assert lines[3] == "| | xshare | **2.0** (3.0) | - | 9.0 | - | - | - | 9.0 (7.0) | 3.0-12.0% | 11.0 us (T=32) |"
    assert lines[-2:] == [
        "T in {1, 8}: -1.0 to -1.0 us over 1 rows",
        "T in {64, 128, 256, 512}: +2.0 to +2.0 us over 1 rows",
    ]
