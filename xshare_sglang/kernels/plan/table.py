"""The dispatch table of the fused selection kernels, printed from :func:`~.plan.plan_call`.

For each served model's router and each policy, the token counts T from 1 to :data:`MAX_T` are grouped
into bands that launch the same kernels with the same warps and constexprs (the grid may grow inside a
band); each band gives its launches and the constexprs that tell the variants apart.  The settings are
the serving plugin's on an H100/H200: bfloat16 logits, the real-token count on the device, the
metrics row, dependent launches, D = 4 for the per-request policies.  docs/kernels.md embeds the output
of ``python -m xshare_sglang.kernels.plan`` between its ``plan-table`` markers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from ...config import PrunerConfig
from ...policies.call import RouterSpec
from ..bundles import flat_constexprs
from . import CallSpec, Launch, plan_call

MAX_T = 512
BEGIN, END = "<!-- plan-table:begin -->", "<!-- plan-table:end -->"

#: name -> (E, router, correction bias): the routers the benchmarks time.
MODELS = {
    "Qwen3-30B-A3B": (128, RouterSpec(8, "softmax"), False),
    "GPT-OSS-120B": (128, RouterSpec(4, "softmax"), False),
    "DeepSeek-V3": (256, RouterSpec(8, "sigmoid", True, 8, 4, 2.5), True),
}

#: Constexprs shown per kernel: the ones whose values tell this table's variants apart.
SHOWN = {
    "select_kernel": (
        "RULE",
        "RULE_CONFIG.ORDER",
        "SCORES.NEED_SCORES",
        "SCORES.METRIC_SCORES",
        "FINISH.ROUTE_MASS",
        "READ.CHUNK_T",
        "ROUTER.ROW_WARPS",
        "ROUTER.GROUP_WARPS",
        "RULE_CONFIG.WARP_PICKS",
        "RULE_CONFIG.PAIRS",
        "RULE_CONFIG.LISTS",
    ),
    "lynx_pick_kernel": ("CHUNK_T",),
    "route_kernel": ("MASK.ALL_KEPT", "MASK.STATIC_KEEP", "MASS", "CHUNK_T", "ROUTER.ROW_WARPS", "ROUTER.GROUP_WARPS"),
    "fill_kernel": (),
}


def policies(num_experts: int, folder: Path) -> dict[str, tuple[PrunerConfig, int]]:
    """The benchmarks' settings per policy (budgets scale with E / 128): name -> (config, D).  The
    calibrated rankings read synthetic files written into ``folder`` (only their counts' shape
    matters to the plan)."""
    scale = num_experts // 128
    counts = [[float((e * 7919) % 101) for e in range(num_experts)]]
    pairs = [[1.0 if i == j else 0.0 for j in range(num_experts)] for i in range(num_experts)]
    ranking, coactivation = folder / f"ranking_{num_experts}.json", folder / f"coactivation_{num_experts}.json"
    header = {"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}
    ranking.write_text(json.dumps(header))
    coactivation.write_text(json.dumps({**header, "coactivation": [pairs]}))
    budget = 32 * scale
    return {
        "none": (PrunerConfig(), 1),
        "oea": (PrunerConfig(policy="oea", k0=1), 1),
        "xshare": (PrunerConfig(policy="xshare", k0=1, budget=16 * scale), 1),
        "xshare-threshold": (PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9), 1),
        "xshare-ep": (PrunerConfig(policy="xshare-ep", k0=1, rank_budget=4 * scale), 1),
        "moe-spec": (PrunerConfig(policy="moe-spec", max_experts=budget), 1),
        "moe-spec static": (
            PrunerConfig(policy="moe-spec", max_experts=budget, ranking="static", static_ranking_path=str(ranking)),
            1,
        ),
        "moe-spec coverage": (PrunerConfig(policy="moe-spec", max_experts=budget, ranking="coverage"), 1),
        "moe-spec co-activation": (
            PrunerConfig(
                policy="moe-spec", max_experts=budget, ranking="coactivation", static_ranking_path=str(coactivation)
            ),
            1,
        ),
        "lynx": (PrunerConfig(policy="lynx", alpha=2.0, beta=4), 1),
        "xshare-spec (D=4)": (PrunerConfig(policy="xshare-spec", k0=1, request_budget=2 * scale, budget=0), 4),
        "moe-spec per request (D=4)": (PrunerConfig(policy="moe-spec", max_experts=8, scope="request"), 4),
    }


def _value(name: str, value) -> str | None:
    """A shown constexpr as the table writes it: by its field name, a flag when it is one."""
    name = name.rsplit(".", 1)[-1]
    if name == "MASS":
        return None if value is None else "ROUTE_MASS"  # the routing kernel sums the retained mass
    if value is True:
        return name
    if value is False or value is None:
        return None
    return f"{name}={value}"


def _signature(launch: Launch) -> tuple:
    constexprs = flat_constexprs(launch.constexprs) | {"MASS": launch.constexprs.get("MASS")}
    shown = tuple(_value(name, constexprs.get(name)) for name in SHOWN[launch.kernel])
    return launch.kernel, launch.num_warps, tuple(value for value in shown if value)


def _bands(cfg: PrunerConfig, num_experts: int, router: RouterSpec, bias: bool, tokens_per_request: int):
    """[(first T, last T, [launch signature], [grid ranges])] over T = 1..MAX_T."""
    bands: list[list] = []
    for num_tokens in range(1, MAX_T + 1):
        spec = CallSpec(
            num_tokens=num_tokens,
            num_experts=num_experts,
            router=router,
            dtype=torch.bfloat16,
            tokens_per_request=tokens_per_request,
            layer_id=0,
            has_bias=bias,
            num_valid_on_device=True,
            metrics="on",
            pdl=True,
        )
        launches = plan_call(cfg, spec).launches
        signature = [_signature(launch) for launch in launches]
        grids = [launch.grid[0] for launch in launches]
        if bands and bands[-1][2] == signature:
            bands[-1][1] = num_tokens
            bands[-1][3] = [(low, grid) for (low, _), grid in zip(bands[-1][3], grids, strict=True)]
        else:
            bands.append([num_tokens, num_tokens, signature, [(grid, grid) for grid in grids]])
    return bands


def _launches_cell(signature, grids) -> str:
    parts = []
    for (kernel, warps, _), (low, high) in zip(signature, grids, strict=True):
        grid = str(low) if low == high else f"{low}-{high}"
        parts.append(f"`{kernel}` [{grid}] x {warps}w")
    return " → ".join(parts)


def _constexprs_cell(signature) -> str:
    parts = []
    for kernel, _, shown in signature:
        if shown:
            parts.append(f"{kernel.split('_')[0]}: " + " ".join(shown))
    return "; ".join(parts) or "-"


def dispatch_table() -> str:
    """The table as markdown (what docs/kernels.md embeds)."""
    lines = [
        f"Generated by `python -m xshare_sglang.kernels.plan` (T = 1 to {MAX_T}; bfloat16 logits, the metrics "
        "row, dependent launches). A launch is `kernel` [programs] x warps; the constexprs named are those "
        "that are on (or their value).",
    ]
    with tempfile.TemporaryDirectory() as folder:
        for model, (num_experts, router, bias) in MODELS.items():
            lines += [
                "",
                f"#### {model} (E={num_experts}, top-{router.top_k})",
                "",
                "| policy | T | launches | constexprs |",
                "|---|---|---|---|",
            ]
            for name, (cfg, tokens_per_request) in policies(num_experts, Path(folder)).items():
                for first, last, signature, grids in _bands(cfg, num_experts, router, bias, tokens_per_request):
                    tokens = str(first) if first == last else f"{first}-{last}"
                    launches, constexprs = _launches_cell(signature, grids), _constexprs_cell(signature)
                    lines.append(f"| {name} | {tokens} | {launches} | {constexprs} |")
    return "\n".join(lines) + "\n"


def embedded(document: str) -> str | None:
    """The table between the markers of a document (None without them)."""
    if BEGIN not in document or END not in document:
        return None
    return document.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the fused kernels' dispatch table (markdown).")
    parser.add_argument("--write", type=Path, help="replace the table between the plan-table markers of this file")
    parser.add_argument("--check", type=Path, help="exit 1 unless this file embeds the current table")
    args = parser.parse_args(argv)
    table = dispatch_table()
    if args.write:
        document = args.write.read_text()
        if embedded(document) is None:
            print(f"{args.write}: no {BEGIN} ... {END} markers", file=sys.stderr)
            return 2
        head, rest = document.split(BEGIN, 1)
        args.write.write_text(head + BEGIN + "\n" + table + END + rest.split(END, 1)[1])
        return 0
    if args.check:
        if embedded(args.check.read_text()) != table:
            command = f"python -m xshare_sglang.kernels.plan --write {args.check}"
            print(f"{args.check}: the dispatch table is stale; run {command}")
            return 1
        return 0
    sys.stdout.write(table)
    return 0
