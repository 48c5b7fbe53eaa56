"""The benchmark's report: the Markdown tables, CSV and JSON of the rows (:func:`write_outputs`), and
the start-up guard's decisions from repeated runs (:func:`guard_rows`, :func:`guard_markdown`)."""

from __future__ import annotations

import json
from pathlib import Path

from ...break_even import BucketTiming, decide
from ..common import write_csv


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def md_tables(rows: list[dict], meta: dict) -> str:
    lines = [
        "# MoE layer: unpruned (a fused top-k) vs pruned routing",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}, sglang kernel "
        f"{meta['sglang_kernel']}; git {meta['git_sha'][:12]}; {meta['date']}.",
        f"Copy bandwidth {meta['bandwidth_gbps']:.0f} GB/s (read + write). Times in us per layer call: median of "
        f"{meta['replays']} replays of CUDA graphs of {meta['calls_per_graph']} calls over {meta['rotate']} "
        f"rotated inputs and {meta['weight_copies']} weight copies. Logits: trace `{meta['trace']}`, "
        f"rho={meta['rho']:.2f}.",
        "",
        "Columns: act = activated experts (this rank's, mean over inputs), baseline -> pruned; base = the "
        "unpruned layer routed by a fused top-k (the kernels' policy none), what a user runs; torch = the "
        "unpruned layer routed by torch ops (softmax, topk); floor = pruned "
        "activated x bytes per expert / bandwidth; x = base time / pruned time (x torch: against torch); "
        "ideal = activated ratio; "
        "r/i = x / ideal (target >= 0.8 for T >= 32); sel = selection time, and its share of the pruned layer "
        "(target <= 3% for T <= 512); roof = roofline max(weight bytes / bandwidth, FLOPs / bf16 matmul peak), "
        "b/roof and p/roof = baseline and pruned time over their rooflines (pruned target <= 1.5 for T >= 32), "
        "m/c = the pruned roofline's bound (memory or compute); cfg = SGLang's config time / the pruned time "
        "(with `--pruned-config both`: the plugin's config against SGLang's own, > 1 = the plugin's is faster); "
        "launches = kernels one layer call puts on the GPU (profiled): unpruned (a fused top-k, "
        "the alignment, the MoE) / pruned.",
    ]
    if meta.get("matmul_tflops"):
        lines.insert(4, f"bf16 matmul peak {meta['matmul_tflops']:.0f} TFLOP/s (measured in this run).")
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += ["", f"## {model}", "", f"{meta['models'][model]['note']}; backend {meta['models'][model]['backend']}"]
        lines += [
            "",
            "| phase | T | policy | settings | act | base us | torch us | pruned us | floor us | roof us | b/roof "
            "| p/roof | m/c | cfg | x | x torch | ideal | r/i | sel us | sel % | launches | checks |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["model"] != model:
                continue
            ok = "ok" if r["checks_ok"] else "FAIL"
            lines.append(
                f"| {r['phase']} | {r['T']} | {r['policy']} | {r['settings']} | {r['activated_baseline']:.1f} -> "
                f"{r['activated_pruned']:.1f} | {r['baseline_us']:.1f} | "
                f"{_fmt(r.get('baseline_torch_topk_us'), '.1f')} | "
                f"{r['pruned_us']:.1f} | "
                f"{r['floor_pruned_us']:.1f} | {_fmt(r.get('roofline_pruned_us'), '.1f')} | "
                f"{_fmt(r.get('baseline_over_roofline'), '.2f')} | {_fmt(r.get('pruned_over_roofline'), '.2f')}"
                f"{_mark(r.get('target_roofline'))} | {(r.get('pruned_bound') or '-')[:1]} | "
                f"{_fmt(r.get('config_gain'), '.2f')} | "
                f"{r['speedup']:.2f} | {_fmt(r.get('speedup_torch_topk'), '.2f')} | {_fmt(r['ideal'], '.2f')} | "
                f"{_fmt(r['realized_over_ideal'], '.2f')}"
                f"{_mark(r['target_speedup'])} | {r['selection_us']:.1f} | {100 * r['selection_share']:.1f}"
                f"{_mark(r['target_selection'])} | {_launches(r)} | {ok} |"
            )
    return "\n".join(lines) + "\n"


def _launches(r: dict) -> str:
    counts = [r.get(key) for key in ("launches_baseline", "launches_pruned")]
    return "-" if any(c is None for c in counts) else "/".join(str(c) for c in counts)


def _mark(met: bool | None) -> str:
    return "" if met is None else (" ✓" if met else " ✗")


def write_outputs(out_dir: Path, rows: list[dict], meta: dict) -> None:
    if rows:
        write_csv(out_dir / "moe_layer.csv", rows)
        (out_dir / "moe_layer.md").write_text(md_tables(rows, meta))
    (out_dir / "moe_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def guard_rows(runs: list[list[dict]], margin: float) -> list[dict]:
    """The start-up guard's decision for every (model, phase, T, settings) measured in repeated runs.

    Each run gives one baseline sample (``baseline_us``, and ``baseline_repeat_us`` when timed again
    after the policies) and one pruned sample (``pruned_us``) per row; :func:`xshare_sglang.break_even.decide`
    turns them into the decision a server would take for that bucket.
    """
    samples: dict[tuple, tuple[list[float], list[float]]] = {}
    for rows in runs:
        for row in rows:
            key = (row["model"], row["phase"], row["T"], row["policy"], row["settings"])
            base, pruned = samples.setdefault(key, ([], []))
            base.append(row["baseline_us"])
            if row.get("baseline_repeat_us") not in (None, row["baseline_us"]):
                base.append(row["baseline_repeat_us"])
            pruned.append(row["pruned_us"])
    keys = list(samples)
    timings = [BucketTiming(key[1], key[2], tuple(samples[key][0]), tuple(samples[key][1])) for key in keys]
    out = []
    for key, decision in zip(keys, decide(timings, margin), strict=True):
        model, phase, tokens, policy, settings = key
        out.append(
            {
                "model": model,
                "phase": phase,
                "T": tokens,
                "policy": policy,
                "settings": settings,
                "baseline_us": _round(decision.unpruned_s, 2),
                "pruned_us": _round(decision.pruned_s, 2),
                "samples": len(samples[key][1]),
                "prune": decision.prune,
                "reason": decision.reason,
            }
        )
    return out


def guard_markdown(rows: list[dict], margin: float) -> str:
    lines = [
        f"Start-up guard decisions (margin {margin:g}): medians of repeated CUDA-graph timings, in µs",
        "",
        "| model | phase | T | policy | settings | unpruned | pruned | runs | guard |",
        "|---|---|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        state = "**on**" if r["prune"] else "off"
        lines.append(
            f"| {r['model']} | {r['phase']} | {r['T']} | {r['policy']} | {r['settings']} | {r['baseline_us']} | "
            f"{r['pruned_us']} | {r['samples']} | {state} ({r['reason']}) |"
        )
    return "\n".join(lines) + "\n"
