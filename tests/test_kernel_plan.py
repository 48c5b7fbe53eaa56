"""The dispatch table (``xshare_sglang.kernels.plan``): one pure function says what every call launches.

* Every set rule the plan names is a jit function of ``kernels/jit/rules/`` with the one rule signature,
  and the kernels' runtime parameters are the bundles of ``kernels/bundles.py``; no jit code reads an
  argument by position.
* The wrapper launches exactly the plan's launches, with the plan's grids, warps and constexprs.
* ``python -m xshare_sglang.kernels.plan`` prints the table, and docs/kernels.md embeds the current one.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.bench import kernel_manifest
from xshare_sglang.kernels.bundles import KERNEL_BUNDLES
from xshare_sglang.kernels.launch import Outputs, call_spec, kernel_module
from xshare_sglang.kernels.plan import CallSpec, Mode, plan_call
from xshare_sglang.kernels.plan.table import dispatch_table, embedded
from xshare_sglang.policies.call import RouterSpec

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "xshare_sglang" / "kernels"
DEEPSEEK_V3 = RouterSpec(8, "sigmoid", True, 8, 4, 2.5)


RULE_SIGNATURE = ["agg", "warm", "base", "call", "policy", "tables", "coverage", "n_valid", "e", "e_ok", "CONFIG"]


def test_every_mode_names_a_rule_of_one_signature() -> None:
    """Each mode's rule is a jit function of ``jit.rules`` with the one rule signature, in its own module
    whose first line names its torch reference in ``policies/``, which exists."""
    jit = kernel_module()
    assert {mode.rule for mode in Mode} == set(jit.RULES)
    for name, rule in jit.RULES.items():
        assert list(inspect.signature(rule.fn).parameters) == RULE_SIGNATURE, name
        assert rule.__name__ == f"{name}_rule" and rule.fn.__module__.endswith(f".rules.{name}"), name
        first_line = sys.modules[rule.fn.__module__].__doc__.splitlines()[0]
        reference = first_line.removeprefix("Reference: ").split(" ")[0]
        module, function = reference.rsplit(".", 1)
        assert module.startswith("xshare_sglang.policies."), (name, first_line)
        assert callable(getattr(importlib.import_module(module), function)), (name, reference)


def test_the_bundles_are_the_kernels_parameters() -> None:
    """Each kernel's runtime parameters are, in order, the bundles (and plain arguments) the launch
    wrapper builds (:data:`~xshare_sglang.kernels.bundles.KERNEL_BUNDLES`); ``select_kernel`` takes at
    most 30 parameters in all."""
    jit = kernel_module()
    for kernel, bundles in KERNEL_BUNDLES.items():
        parameters = inspect.signature(getattr(jit, kernel).fn).parameters.values()
        runtime = [p.name for p in parameters if "constexpr" not in str(p.annotation)]
        assert runtime == [name for name, _ in bundles], kernel
    assert len(inspect.signature(jit.select_kernel.fn).parameters) <= 30


def _jit_functions():
    for path in sorted((KERNELS / "jit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                yield path, node


def test_no_jit_code_reads_an_argument_by_position() -> None:
    """No jit function indexes a tuple by a number (a shape's dimensions aside) or unpacks one of its
    names by position: every bundle is read by field name.  No ``MODE`` chain is left."""
    found = []
    for path, function in _jit_functions():
        for node in ast.walk(function):
            of_shape = isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith(".shape")
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and not of_shape:
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            unpacked = isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
            if unpacked and isinstance(node.value, ast.Name):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.Name) and node.id == "MODE":
                found.append(f"{path.name}:{node.lineno} MODE")
    assert found == []


def test_plan_call_chooses_then_derives() -> None:
    """``plan_call`` is short: it chooses the pipeline and calls one function per kernel."""
    source = (KERNELS / "plan" / "__init__.py").read_text()
    (function,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "plan_call"]
    assert function.end_lineno - function.lineno + 1 <= 60


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
    spec = call_spec(
        call,
        route=route,
        fill_dropped=case["fill"],
        outputs=outputs,
        pdl=case["pdl"],
        routing_sums_mass=case["routing_sums_mass"],
    )
    assert spec.metrics == case["metrics"] and spec.num_valid_on_device == (case["nv"] == "tensor")
    plan = plan_call(cfg, spec)
    if case["entry"] == "select" and cfg.policy == "none" and case["metrics"] == "off" and not case["stats"]:
        assert launches == []  # every expert kept: nothing to launch
        return
    assert [fn.__name__ for fn, *_ in launches] == list(plan.kernels)
    rules = kernel_module().RULES
    for (_, grid, _, recorded), launch in zip(launches, plan.launches, strict=True):
        assert tuple(grid) == launch.grid
        want = dict(launch.constexprs)
        if "RULE" in want:
            want["RULE"] = rules[want["RULE"]]  # the plan names the rule, the wrapper passes its function
        assert {k: v for k, v in recorded.items() if k in want} == want
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
    """A selection that does not route takes no routing constexprs (``ROUTER`` None) whatever the
    router (one compile): the same constexprs for a softmax and a biased grouped router above one
    program but the scores' sigmoid."""
    cfg = PrunerConfig(policy="xshare", k0=1, budget=16)
    softmax = CallSpec(64, 256, RouterSpec(8, "softmax"), torch.bfloat16, metrics="on")
    grouped = CallSpec(64, 256, DEEPSEEK_V3, torch.bfloat16, metrics="on", has_bias=True, fill_dropped=True)
    select = [plan_call(cfg, spec).launches[0] for spec in (softmax, grouped)]
    assert select[0].kernel == select[1].kernel == "select_kernel"
    assert select[0].constexprs["ROUTER"] is None
    assert {k: v for k, v in select[0].constexprs.items() if k != "SCORES"} == {
        k: v for k, v in select[1].constexprs.items() if k != "SCORES"
    }
    assert select[0].constexprs["SCORES"] == select[1].constexprs["SCORES"]._replace(SIGMOID=False)


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
    """The plan is pure: no module of it imports triton or the jit code."""
    for path in sorted((KERNELS / "plan").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                names += [a.name for a in node.names]
                assert not any("triton" in n or "jit" in n for n in names), (path, ast.unparse(node))


def test_kernel_modules_stay_small() -> None:
    """No module of ``xshare_sglang/kernels/`` over 600 lines, no function over 200: the jit code split
    by concern, each kernel's body its phases."""
    for path in sorted(KERNELS.rglob("*.py")):
        source = path.read_text()
        assert len(source.splitlines()) <= 600, path
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno + 1 <= 200, (path, node.name)
