"""The fused selection kernels' serial work per policy, read off their Hopper machine code without a GPU.

For each router, policy and T, one ``prune_route`` call is captured (not launched) and each of its
kernels compiled for sm_90 as the launch would compile it (:mod:`xshare_sglang.bench.kernel_compile`).
Per kernel the table gives the grid and static SASS counts (every instruction once: instructions,
SHFL, BAR, CALL, backward branches = loops, global loads, registers), the trip counts of the serial
loops one program runs, from the launch arguments, and the program's warps (each runs the counted
code):

* ``tiles``: row tiles one program of the selection reads (phase A), times ``ranks``, the top-k rounds
  ``row_ranks`` runs per tile;
* ``parts``: programs whose shares the last program reads (added with atomics into one accumulator:
  one load, no loop);
* ``rule``: rounds of the set rule in the last program (greedy picks, LYNX digit compares and pick
  tiles, coverage picks and the row tiles each reads; the order of the experts is one loop-free step);
* ``route``: routing tiles the single program runs after the selection (one-launch calls), each of
  ``top_k`` argmax rounds;
* with ``--loops``, ``loop bodies``: for each loop of the kernel, what one trip issues
  (``instructions/BAR/SHFL/global loads``, inner loops counted once), so a serial chain is the body
  of its loop times the trips above.

Static counts times trip counts is the proxy for the serial chain of one call; the GPU timing
(``scripts/bench_selection.py``) decides.  Run from the repository root, no GPU needed::

    PYTHONPATH=. python scripts/kernel_sass.py --out kernel_sass.md

Routers and policies are those of ``bench_selection.py``; ``--tokens`` (default 1,32,512) and
``--models`` narrow them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.pop("TRITON_INTERPRET", None)  # the kernels must compile, not interpret

import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.bench.common import git_sha
from xshare_sglang.bench.kernel_compile import capture_launches, compile_launch, kernel_sass, loop_bodies, sass_stats
from xshare_sglang.kernels.bundles import flat_constexprs
from xshare_sglang.kernels.launch import named_arguments
from xshare_sglang.policies.call import RouterSpec, RoutingCall

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_selection  # its synthetic co-activation file

ROUTERS = {
    "qwen3-30b-a3b": (128, RouterSpec(8, "softmax", True)),
    "gpt-oss-120b": (128, RouterSpec(4, "softmax", True)),
    "deepseek-v3": (256, RouterSpec(8, "sigmoid", True, 8, 4, 2.5)),
}


def policies(num_experts: int, ranking_dir: Path) -> dict[str, tuple[PrunerConfig, int]]:
    """bench_selection.py's settings (budgets scale with E/128): name -> (config, D).  The static and
    co-activation rankings read bench_selection.py's synthetic calibration files, written into
    ``ranking_dir``."""
    scale = num_experts // 128
    calibrated = bench_selection.policy_configs(num_experts, 8, ranking_dir)
    coactivation, static = calibrated["moe-spec-coact"][0], calibrated["moe-spec-static"][0]
    return {
        "none": (PrunerConfig(), 1),
        "oea": (PrunerConfig(policy="oea", k0=1), 1),
        "xshare": (PrunerConfig(policy="xshare", k0=1, budget=16 * scale), 1),
        "xshare-threshold": (PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9), 1),
        "xshare-ep": (PrunerConfig(policy="xshare-ep", k0=1, rank_budget=4 * scale), 1),
        "moe-spec": (PrunerConfig(policy="moe-spec", max_experts=32 * scale), 1),
        "moe-spec-static": (static, 1),
        "moe-spec-coverage": (PrunerConfig(policy="moe-spec", max_experts=32 * scale, ranking="coverage"), 1),
        "moe-spec-coact": (coactivation, 1),
        "lynx": (PrunerConfig(policy="lynx", alpha=2.0, beta=4), 1),
        "xshare-spec": (PrunerConfig(policy="xshare-spec", k0=1, request_budget=2 * scale, budget=0), 4),
        "moe-spec-request": (PrunerConfig(policy="moe-spec", max_experts=8, scope="request"), 4),
    }


def greedy_picks(named: dict, num_tokens: int, top_k: int, budget: int) -> str:
    """Serial picks of a greedy ranking: they stop once no candidate gains, and with top-k scores at
    most T x top_k experts have an aggregate (the rest of the budget is one sort)."""
    picks = min(budget, named["num_experts"])
    gaining = num_tokens * top_k if named["SCORE_TOPK"] else named["num_experts"]
    if gaining >= picks:
        return f"{picks} picks"
    return f"{gaining} picks + one sort"


def coverage_trips(named: dict, num_tokens: int, top_k: int) -> str:
    """The coverage greedy's picks and what each one reads: one row of the pair sums (top-k scores
    above one program), the register tile once for the call, or the tiles of the picked expert's row
    list (dense scores: every row)."""
    picks = greedy_picks(named, num_tokens, top_k, named["count"])
    if named.get("PAIRS"):
        return f"{picks} x 1 row of pair sums"
    if not named["LISTS"]:
        return f"{picks}, rows read once"
    listed = num_tokens * top_k / named["num_experts"] if named["SCORE_TOPK"] else num_tokens
    return f"{picks} x ~{math.ceil(listed / named['TILE_ROWS'])} list tiles"


def trip_counts(kernel: str, grid: tuple, named: dict, num_tokens: int, top_k: int) -> dict[str, str]:
    """Serial loop trips of one program, from the launch arguments."""
    if kernel == "route_kernel":
        return {"tiles": "1", "ranks": "-", "parts": "-", "rule": "-", "route": f"1 x {top_k}"}
    if kernel == "lynx_pick_kernel":
        return {"tiles": "1", "ranks": "-", "parts": "-", "rule": f"1 pick tile x {top_k}", "route": "-"}
    per_program, per_request, chunk = named["rows_per_program"], named["rows_per_request"], named["CHUNK_T"]
    tiles_per_request = -(-per_request // chunk)
    tiles = per_program // per_request * tiles_per_request if named["PER_REQUEST"] else -(-per_program // chunk)
    rule_name = named["RULE"].__name__.removesuffix("_rule")
    reads_rows = named["MARKS"] or named["NEED_SCORES"]
    ranks = max(named["top_k"], named["k0"]) if named["NEED_SCORES"] and named["SCORE_TOPK"] else named["k0"]
    block_e = named["BLOCK_E"]
    pairwise = f"one {block_e}x{block_e} order"  # no loop: every pair in registers at once
    # the greedy budget skips the order when it takes every candidate anyway: no budget, or top-k
    # scores reaching at most T x top_k experts; the rounds skip it when the candidates fit the target
    if named["count"] <= 0:
        greedy = "- (budget 0)"
    elif named["SCORE_TOPK"] and num_tokens * named["top_k"] <= named["count"]:
        greedy = "- (T x top_k <= budget)"
    else:
        greedy = pairwise
    rules = {
        "greedy": lambda: greedy,
        "threshold": lambda: f"one sort of {block_e} + scan",
        "rank_rounds": lambda: f"{pairwise} + {named['SEARCH_STEPS']} bisection steps unless the candidates fit",
        "top_aggregate": lambda: pairwise,
        "coactivation": lambda: f"{greedy_picks(named, num_tokens, top_k, named['count'])}, 1 row each",
        "coverage": lambda: coverage_trips(named, num_tokens, top_k),
    }
    rule = rules[rule_name]() if rule_name in rules else "-"
    if named["LYNX"]:
        digits = named["beta"] + 2
        if (named["beta"] + 1) * math.log2(max(num_tokens, 1)) < 61:  # s fits one int64 (lynx_s_ranks)
            rule = f"{pairwise} of s"
        else:
            rule = f"{digits} digits x {block_e // named['LYNX_CHUNK']} chunks"
        if named["SINGLE"]:
            rule += f" + {-(-num_tokens // chunk)} pick tiles x {top_k}"
    if named["PER_REQUEST"]:
        rule += f"; {named['request_budget']} picks per request"
    routes = named["SINGLE"] and named["ROUTER"] is not None
    route = f"{-(-num_tokens // named['ROUTE_T'])} x {top_k}" if routes else "-"
    return {
        "tiles": str(tiles if reads_rows else 0),
        "ranks": str(ranks if reads_rows else 0),
        "parts": "-" if named["SINGLE"] else f"{grid[0]} atomic",
        "rule": rule,
        "route": route,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(ROUTERS), help=f"subset of {', '.join(ROUTERS)}")
    parser.add_argument("--tokens", default="1,32,512", help="token counts T")
    parser.add_argument("--policies", default="all", help="comma-separated subset, or all")
    parser.add_argument("--out", default=None, help="also write the Markdown table here")
    parser.add_argument(
        "--loops",
        action="store_true",
        help="add a column: each loop body's instructions/BAR/SHFL/global loads (one trip, in branch order)",
    )
    parser.add_argument(
        "--select-mass",
        action="store_true",
        help="compile the retained-mass metric of oea, static moe-spec and LYNX above one program in the "
        "selection instead of the routing kernel (routing_sums_mass=False), the other side of its A/B",
    )
    parser.add_argument(
        "--no-metrics",
        action="store_true",
        help="compile the calls without the serving plugin's metrics row (the A/B of the metrics' code)",
    )
    parser.add_argument(
        "--metrics-gate",
        action="store_true",
        help="compile the calls with the metrics row's device gate (the kernels hold both paths: a call whose gate "
        "is 0 skips the metrics' code, which --no-metrics compiles out)",
    )
    args = parser.parse_args()
    if args.metrics_gate and args.no_metrics:
        parser.error("--metrics-gate gates the metrics row, which --no-metrics leaves out: choose one")
    lines = [
        f"# Selection kernels on sm_90: static SASS and serial trips per program (commit {git_sha()})",
        "",
        "| router | T | policy | kernel | grid | SASS | SHFL | BAR | CALL | loops | regs | spill | tiles x ranks "
        "| parts | rule | route | warps |" + (" loop bodies |" if args.loops else ""),
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---|---:|"
        + ("---|" if args.loops else ""),
    ]
    rankings = tempfile.TemporaryDirectory(prefix="xshare-sass-rankings-")
    for model in args.models.split(","):
        num_experts, router = ROUTERS[model]
        for num_tokens in (int(t) for t in args.tokens.split(",")):
            for name, (cfg, tokens_per_request) in policies(num_experts, Path(rankings.name)).items():
                if args.policies != "all" and name not in args.policies.split(","):
                    continue
                gen = torch.Generator().manual_seed(num_tokens)
                logits = torch.randn(num_tokens, num_experts, generator=gen).to(torch.bfloat16)
                call = RoutingCall(
                    logits,
                    router,
                    tokens_per_request=tokens_per_request,
                    num_valid_tokens=torch.tensor([num_tokens], dtype=torch.int32),
                    expert_to_rank=torch.arange(num_experts, dtype=torch.int32) // (num_experts // 8),
                    correction_bias=torch.zeros(num_experts) if router.scoring == "sigmoid" else None,
                )
                extra = {}
                metrics_row = None if args.no_metrics else torch.zeros(4, dtype=torch.int64)
                if args.metrics_gate:
                    extra["metrics_gate"] = torch.ones(1, dtype=torch.int32)
                if args.select_mass:
                    extra["routing_sums_mass"] = False
                launches = capture_launches(call, cfg, metrics_row=metrics_row, **extra)
                for kernel, (grid, kernel_args, kwargs) in launches.items():
                    # the bundles' fields by their own names (the RULE's SEARCH_STEPS, READ's CHUNK_T, ...)
                    fields = {name.rsplit(".", 1)[-1]: value for name, value in flat_constexprs(kwargs).items()}
                    named = named_arguments(kernel, kernel_args) | kwargs | fields
                    compiled = compile_launch(kernel, kernel_args, kwargs)
                    stats = sass_stats(compiled)
                    loops = " ".join(str(body) for body in loop_bodies(kernel_sass(compiled))) if args.loops else None
                    trips = trip_counts(kernel, grid, named, num_tokens, router.top_k)
                    lines.append(
                        f"| {model} | {num_tokens} | {name} | {kernel.removesuffix('_kernel')} | {grid[0]} | "
                        f"{stats.instructions} | {stats.shuffles} | {stats.barriers} | {stats.calls} | "
                        f"{stats.backward_branches} | {stats.registers} | {stats.local_memory} | "
                        f"{trips['tiles']} x {trips['ranks']} | "
                        f"{trips['parts']} | {trips['rule']} | {trips['route']} | {kwargs['num_warps']} |"
                        + (f" {loops} |" if args.loops else "")
                    )
                    print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
