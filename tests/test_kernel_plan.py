"""The dispatch table (``xshare_sglang.kernels.plan``): one pure function says what every call launches.

* The plan's set-rule numbers are the jit code's ``MODE_*`` constants.
* The wrapper launches exactly the plan's launches, with the plan's grids, warps and constexprs.
* ``python -m xshare_sglang.kernels.plan`` prints the table, and docs/kernels.md embeds the current one.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.bench import kernel_manifest
from xshare_sglang.kernels.launch import Outputs, call_spec, kernel_module
from xshare_sglang.kernels.plan import CallSpec, Mode, plan_call
from xshare_sglang.kernels.plan.table import dispatch_table, embedded
from xshare_sglang.policies.call import RouterSpec

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "xshare_sglang" / "kernels"
DEEPSEEK_V3 = RouterSpec(8, "sigmoid", True, 8, 4, 2.5)


def test_modes_are_the_jit_codes() -> None:
    jit = kernel_module()
    for mode in Mode:
        assert getattr(jit, f"MODE_{mode.name}").value == int(mode), mode


@pytest.mark.parametrize("case", kernel_manifest.CASES[::7], ids=kernel_manifest.case_id)
def test_the_wrapper_launches_what_the_plan_says(case, tmp_path) -> None:
    """For a spread of the manifest's calls: the recorded launches are the plan's, in order, with its
    grids, warps, options and constexprs, and the spec the wrapper derives from the call is the case's."""
    call, cfg, kwargs = kernel_manifest.build_call(case, tmp_path)
    launches = kernel_manifest.capture(case, tmp_path)
    route = case["entry"] == "prune_route"
    outputs = Outputs(
        keep=torch.empty(call.num_experts, dtype=torch.bool),
        ids=torch.empty(1, 1, dtype=torch.int32) if route else None,
        metrics_row=kwargs.get("metrics_row"),
        metrics_gate=kwargs.get("metrics_gate"),
        stats_out=kwargs.get("stats_out"),
    )
    spec = call_spec(call, route=route, fill_dropped=case["fill"], outputs=outputs, pdl=case["pdl"])
    assert spec.metrics == case["metrics"] and spec.num_valid_on_device == (case["nv"] == "tensor")
    plan = plan_call(cfg, spec)
    if case["entry"] == "select" and cfg.policy == "none" and case["metrics"] == "off" and not case["stats"]:
        assert launches == []  # every expert kept: nothing to launch
        return
    assert [fn.__name__ for fn, *_ in launches] == list(plan.kernels)
    for (_, grid, _, recorded), launch in zip(launches, plan.launches, strict=True):
        assert tuple(grid) == launch.grid
        assert {k: v for k, v in recorded.items() if k in launch.constexprs} == launch.constexprs
        assert {k: recorded[k] for k in launch.options} == launch.options


def test_plan_answers_for_the_served_shapes(tmp_path) -> None:
    """A few rows of the table, stated: what runs for a decode step and a large batch."""
    qwen = RouterSpec(8, "softmax")
    xshare = PrunerConfig(policy="xshare", k0=1, budget=16)

    def kernels(cfg, num_tokens, router=qwen, num_experts=128, **fields):
        spec = CallSpec(num_tokens, num_experts, router, torch.bfloat16, metrics="on", pdl=True, **fields)
        return [(launch.kernel, launch.grid, launch.num_warps) for launch in plan_call(cfg, spec).launches]

    # one row: one program on one warp (xshare's budget takes every candidate: a light rule)
    assert kernels(xshare, 1) == [("select_kernel", (1,), 1)]
    # a tile of 8 rows: one program on four warps; above, the selection then the routing
    assert kernels(xshare, 8) == [("select_kernel", (1,), 4)]
    assert kernels(xshare, 512) == [("select_kernel", (64,), 4), ("route_kernel", (64,), 8)]
    # none: a fused top-k, one launch whatever T
    assert kernels(PrunerConfig(), 512) == [("route_kernel", (64,), 8)]
    # DeepSeek-V3: a row on a warp per expert group, up to 256 rows a program each
    assert kernels(PrunerConfig(), 1, DEEPSEEK_V3, 256, has_bias=True) == [("select_kernel", (1,), 8)]
    assert kernels(PrunerConfig(), 8, DEEPSEEK_V3, 256, has_bias=True) == [("route_kernel", (8,), 8)]
    assert kernels(PrunerConfig(), 512, DEEPSEEK_V3, 256, has_bias=True) == [("route_kernel", (64,), 8)]
    # LYNX above one program: three launches
    lynx = [name for name, _, _ in kernels(PrunerConfig(policy="lynx"), 32)]
    assert lynx == ["select_kernel", "lynx_pick_kernel", "route_kernel"]
    # the coverage ranking of 5 rows: two programs and its pair sums, zeroed by fill_kernel first
    coverage = PrunerConfig(policy="moe-spec", max_experts=32, ranking="coverage")
    assert [name for name, _, _ in kernels(coverage, 5)] == ["fill_kernel", "select_kernel", "route_kernel"]


def test_a_select_kernel_that_does_not_route_compiles_one_variant() -> None:
    """The routing's constexprs of a selection that does not route take one value whatever the router
    (one compile): the same constexprs for a softmax and a biased grouped router above one program."""
    cfg = PrunerConfig(policy="xshare", k0=1, budget=16)
    softmax = CallSpec(64, 256, RouterSpec(8, "softmax"), torch.bfloat16, metrics="on")
    grouped = CallSpec(64, 256, DEEPSEEK_V3, torch.bfloat16, metrics="on", has_bias=True, fill_dropped=True)
    select = [plan_call(cfg, spec).launches[0] for spec in (softmax, grouped)]
    assert select[0].kernel == select[1].kernel == "select_kernel"
    assert {k: v for k, v in select[0].constexprs.items() if k != "SIGMOID"} == {
        k: v for k, v in select[1].constexprs.items() if k != "SIGMOID"
    }


def test_the_table_prints_and_docs_embed_it() -> None:
    """``python -m xshare_sglang.kernels.plan`` prints the table docs/kernels.md embeds between its
    markers (regenerate with ``--write docs/kernels.md``)."""
    result = subprocess.run(
        [sys.executable, "-m", "xshare_sglang.kernels.plan"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = dispatch_table()
    assert result.stdout == table
    for heading in ("#### Qwen3-30B-A3B", "#### GPT-OSS-120B", "#### DeepSeek-V3"):
        assert heading in table
    assert "| xshare | 1 | `select_kernel` [1] x 1w |" in table
    assert embedded((ROOT / "docs" / "kernels.md").read_text()) == table, (
        "docs/kernels.md's dispatch table is stale: python -m xshare_sglang.kernels.plan --write docs/kernels.md"
    )


def test_plan_module_reads_no_tensor() -> None:
    """The plan is pure: it imports neither triton nor the jit code."""
    source = (KERNELS / "plan" / "__init__.py").read_text()
    assert "triton" not in source and "jit" not in source


def test_kernel_modules_stay_small() -> None:
    """No module of ``xshare_sglang/kernels/`` over 600 lines, no function over 200: the jit code split
    by concern, each kernel's body its phases."""
    for path in sorted(KERNELS.rglob("*.py")):
        source = path.read_text()
        assert len(source.splitlines()) <= 600, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno + 1 <= 200, (path, node.name)
