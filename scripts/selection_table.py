"""The added-cost tables of docs/bench_selection.md, from the CSV ``bench_selection.py`` writes.

For each router and policy: ``selection_us - none_us`` per T (µs, bold where it meets the 2 µs goal),
the selection's share of every pruned layer that takes at least 70 µs, and how far the selection is
above 1% of such a layer at its worst T (the stretch).  The first line per router is ``none`` itself
(the median of its rows per T).  With ``--against OLD.csv`` each cell also shows the other run's added
cost in brackets, and the last lines give the range of the differences per T band.

Usage, from the repository root (no GPU, no install beyond Python)::

    python3 scripts/selection_table.py docs/gpu/h200-2026-11-28-040baec/selection.csv
    python3 scripts/selection_table.py NEW.csv --against OLD.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

ROUTERS = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "gpt-oss-120b": "GPT-OSS-120B", "deepseek-v3": "DeepSeek-V3"}
TOKENS = (1, 8, 32, 64, 128, 256, 512)
GOAL_US = 2.0
LARGE_LAYER_US = 70.0
STRETCH_SHARE = 0.01


def load(path: Path) -> list[dict]:
    """The rows of one ``selection.csv``, with the fields the tables use as numbers."""
    with path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        row["T"] = int(row["T"])
        for field in ("selection_us", "none_us", "layer_us"):
            row[field] = float(row[field])
        row["added_us"] = row["selection_us"] - row["none_us"]
    return rows


def _cell(added: float | None, before: float | None) -> str:
    if added is None:
        return "-"
    text = f"**{added:.1f}**" if added <= GOAL_US else f"{added:.1f}"
    return text if before is None else f"{text} ({before:.1f})"


def table(rows: list[dict], before: list[dict] | None = None) -> str:
    """The markdown table: one line of ``none`` and one per policy, for each router in ``rows``."""
    old = {(r["model"], r["policy"], r["T"]): r["added_us"] for r in before or ()}
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    lines = [
        "| router | policy | "
        + " | ".join(f"T={t}" for t in TOKENS)
        + " | share of layers >= 70 us | worst excess over 1% |",
        "|---|---|" + "---:|" * len(TOKENS) + "---|---|",
    ]
    for model, name in ROUTERS.items():
        mine = [r for r in rows if r["model"] == model]
        if not mine:
            continue
        medians = []
        for t in TOKENS:
            values = [r["none_us"] for r in mine if r["T"] == t]
            medians.append(f"{statistics.median(values):.1f}" if values else "-")
        lines.append(f"| {name} | `none` (absolute, median of the rows) | " + " | ".join(medians) + " | | |")
        for policy in policies:
            by_t = {r["T"]: r for r in mine if r["policy"] == policy}
            if not by_t:
                continue
            cells = [
                _cell(by_t[t]["added_us"] if t in by_t else None, old.get((model, policy, t)) if t in by_t else None)
                for t in TOKENS
            ]
            large = [r for r in by_t.values() if r["layer_us"] >= LARGE_LAYER_US]
            if large:
                shares = [r["selection_us"] / r["layer_us"] for r in large]
                worst = max(large, key=lambda r: r["selection_us"] - STRETCH_SHARE * r["layer_us"])
                excess = worst["selection_us"] - STRETCH_SHARE * worst["layer_us"]
                tail = f"{100 * min(shares):.1f}-{100 * max(shares):.1f}% | {excess:.1f} us (T={worst['T']})"
            else:
                tail = " | "
            lines.append(f"| | {policy} | " + " | ".join(cells) + f" | {tail} |")
    return "\n".join(lines)


def differences(rows: list[dict], before: list[dict], bands: tuple[tuple[int, ...], ...]) -> list[str]:
    """Per band of T: the lowest and highest change of the added cost over the rows both runs have."""
    old = {(r["model"], r["policy"], r["T"]): r["added_us"] for r in before}
    lines = []
    for band in bands:
        keys = [(r, (r["model"], r["policy"], r["T"])) for r in rows if r["T"] in band]
        change = [r["added_us"] - old[key] for r, key in keys if key in old]
        if change:
            label = ", ".join(map(str, band))
            lines.append(f"T in {{{label}}}: {min(change):+.1f} to {max(change):+.1f} us over {len(change)} rows")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", type=Path, help="selection.csv of bench_selection.py")
    parser.add_argument("--against", type=Path, help="another run's selection.csv: its figures in brackets")
    parser.add_argument("--policies", help="comma-separated policies to keep (default: every one in the file)")
    args = parser.parse_args(argv)
    rows = load(args.csv)
    before = load(args.against) if args.against else None
    if args.policies:
        wanted = set(args.policies.split(","))
        rows = [r for r in rows if r["policy"] in wanted]
    print(table(rows, before))
    if before is not None:
        print()
        print("\n".join(differences(rows, before, ((1, 8), (32,), (64, 128, 256, 512)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
