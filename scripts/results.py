"""Every measured figure the docs show, generated from the committed run folders (``docs/gpu/*/``,
``docs/docker-runs/*/``).

Each run folder gets a machine-readable ``run.json``: commit, date, device, driver (and the file it
was read from), torch and Triton versions, the stages that ran, the GPU test counts parsed from its logs,
the result files its own text says were measured on a tree with uncommitted changes, and every file it
holds (those in its subfolders included).  The docs
hold generated blocks between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``:

* ``runs``: every run and what it holds (docs/benchmarks.md);
* ``selection``: the latest complete selection run's added cost per router, policy and T, against the
  run before it (docs/bench_selection.md);
* ``moe-layer``: per run, the pruned MoE layer's speed-up ranges per model, phase and policy, against
  the unpruned layer the run timed and, for the runs whose baseline routed with torch ops, estimated
  against a fused top-k from the same run's selection rows where those time the layer's top-k
  (docs/benchmarks.md);
* ``readme``: one results table at the latest timed commit, with the rows below 1.0x and the noise of
  their estimate (README.md);
* ``docker``: each run of ``scripts/docker_smoke.sh`` (its ``summary.json``): the steps' seconds and the
  image sizes (docs/docker.md).

Usage, from the repository root (no GPU)::

    python3 scripts/results.py           # write every run.json and generated block
    python3 scripts/results.py --check   # regenerate in memory; exit 1 on any difference
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import selection_table  # the added-cost table

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "docs" / "gpu"
DOCS = {"runs": "docs/benchmarks.md", "selection": "docs/bench_selection.md", "moe-layer": "docs/benchmarks.md"}
DOCS["goals"] = "docs/bench_selection.md"
DOCS["readme"] = "README.md"
DOCS["docker"] = "docs/docker.md"
DOCKER_RUNS = ROOT / "docs" / "docker-runs"
FOLDER = re.compile(r"^(?P<device>[a-z0-9]+)-(?P<date>\d{4}-\d{2}-\d{2})-(?P<commit>[0-9a-f]{7,})$")
HEADER = re.compile(r"^(?P<device>[^;]+); torch (?P<torch>[^,]+), triton (?P<triton>[^,;]+)[,;]")
# nvidia-smi's CSV line (name, memory, driver, clock) or a README's "driver N"
DRIVER = re.compile(r"(?:MiB, |driver )(\d+\.\d+\.\d+)")
# a result header's "git <sha>": the bench scripts write the first 12 characters of --git-sha (default
# HEAD's sha); anything after the hex sha ("git fa1eae1-patc" of --git-sha fa1eae1-patched) names a tree
# with uncommitted changes
GIT_FIELD = re.compile(r"\bgit ([0-9a-f]{7,40})([^\s;,]*)")
# a line of a run README's table of scripts that ran against a patch: its last cell names the outputs
PATCH_ROW = re.compile(r"^\|.*`[^`]+\.patch`.*\|([^|]*)\|\s*$")
# a line of pytest's progress characters, ending in its percentage, or cut (a box stopped the stage)
PROGRESS = re.compile(r"^([.FEsxX]+)(?:\s+\[\s*\d+%\]|\[gpu_check .*)?$")
# pytest -v: "PASSED tests/..." (with xdist) or "tests/... PASSED"
VERBOSE = re.compile(r"\b(PASSED|FAILED|ERROR) (tests/\S+)|(tests/\S+::\S+) (PASSED|FAILED|ERROR)\b")
PYTEST = re.compile(r"(\d+) (passed|failed|errors?)\b")
#: moe_layer.csv names a DeepSeek-V3 expert-parallel rank; its router is selection.csv's deepseek-v3
SELECTION_MODEL = {"deepseek-v3-ep8": "deepseek-v3"}
#: selection routers whose ``topk_us`` times another top-k than the MoE-layer baseline of the runs without
#: a fused one: bench_selection.py times DeepSeek-V3's biased group-limited top-k, while bench_moe_layer.py
#: routes its DeepSeek-V3 shape with a plain sigmoid top-k ("no group-limited routing, no correction
#: bias" in its moe_layer*.md), so their ``topk_us - none_us`` estimates nothing for that layer
OTHER_TOPK = {"deepseek-v3"}
OTHER_TOPK_NOTE = "DeepSeek-V3's layer ran a plain sigmoid top-k, its selection rows the grouped, biased one"
MODEL_NAMES = {**selection_table.ROUTERS, "deepseek-v3-ep8": "DeepSeek-V3 (EP rank)"}


# ------------------------------------------------------------------------------------------------ runs
def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _header(folder: Path) -> dict:
    """Device, torch and Triton from the first line of a result Markdown that states them."""
    for path in sorted(folder.glob("*.md")):
        for line in path.read_text(encoding="utf-8").splitlines()[:6]:
            match = HEADER.match(line.strip())
            if match:
                return {key: value.strip() for key, value in match.groupdict().items()}
    return {}


def _segment_counts(lines: list[str]) -> tuple[dict, bool] | None:
    """Test counts of one stage's lines: its pytest summary, or where the stage was cut before one,
    its verbose ``PASSED``/``FAILED`` lines, or else its progress characters.  None without tests."""
    summary = {"passed": 0, "failed": 0, "errors": 0}
    verbose: dict[str, str] = {}
    progress = {"passed": 0, "failed": 0, "errors": 0}
    found = False
    for line in lines:
        if re.search(r"\d+ (passed|failed).* in [\d.]+s", line):
            found = True
            for number, kind in PYTEST.findall(line):
                summary["errors" if kind.startswith("error") else kind] += int(number)
        for kind, test, other_test, other_kind in VERBOSE.findall(line):
            verbose[test or other_test] = kind or other_kind
        match = PROGRESS.match(line.strip())
        if match:
            chars = match.group(1)
            progress["passed"] += chars.count(".")
            progress["failed"] += chars.count("F")
            progress["errors"] += chars.count("E")
    if found:
        return summary, False
    if verbose:
        counts = {kind: sum(v == kind for v in verbose.values()) for kind in ("PASSED", "FAILED", "ERROR")}
        return {"passed": counts["PASSED"], "failed": counts["FAILED"], "errors": counts["ERROR"]}, True
    if any(progress.values()):
        return progress, True
    return None


def _tests(folder: Path) -> list[dict]:
    """GPU test counts from the run's logs, one entry per stage that ran tests (a stage starts at
    gpu_check's ``stage`` line, or at a ``# call`` line of an older log): its log, its name, passed,
    failed, errors, and ``cut`` when it stopped before its pytest summary (the counts are then those of
    the tests that finished)."""
    out = []
    for name in ("gpu_check.log", "gpu_tests.log"):
        path = folder / name
        if not path.exists():
            continue
        segments: list[tuple[str, list[str]]] = [("tests", [])]
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            stage = re.match(r"\[gpu_check \d+s\] stage (\w+): up to", line)
            if stage or line.startswith("# call"):
                segments.append((stage.group(1) if stage else line[2:].split(",")[0], []))
            segments[-1][1].append(line)
        for stage, lines in segments:
            counts = _segment_counts(lines)
            if counts is not None:
                out.append({"log": name, "stage": stage, **counts[0], "cut": counts[1]})
    return out


def _tests_cell(tests: list[dict]) -> str:
    if not tests:
        return "-"
    parts = []
    for t in tests:
        failed = f", {t['failed']} failed" if t["failed"] or t["errors"] else ""
        parts.append(f"{t['stage']}: {t['passed']} passed{failed}" + (" (cut)" if t["cut"] else ""))
    return "; ".join(parts)


def _stages(folder: Path) -> list[str]:
    """The stages the run's gpu_check.sh calls asked for (every call's header line), in order."""
    path = folder / "gpu_check.log"
    stages: list[str] = []
    if path.exists():
        for match in re.finditer(r"; stages ([a-z_,]+)", path.read_text(encoding="utf-8", errors="replace")):
            stages += [stage for stage in match.group(1).split(",") if stage not in stages]
    return stages


def run_record(folder: Path) -> dict:
    """The ``run.json`` of one run folder, from its name, result files and logs."""
    name = FOLDER.match(folder.name)
    if name is None:
        raise ValueError(f"{folder}: not a run folder name (device-YYYY-MM-DD-commit)")
    header = _header(folder)
    driver, driver_from = _driver(folder)
    selection = sorted(p.name for p in folder.glob("selection*.csv"))
    moe_layer = sorted(p.name for p in folder.glob("moe_layer*.csv"))
    return {
        "folder": folder.name,
        "commit": name["commit"],
        "date": name["date"],
        "device": header.get("device"),
        "driver": driver,
        "driver_from": driver_from,
        "torch": header.get("torch"),
        "triton": header.get("triton"),
        "stages": _stages(folder),
        "tests": _tests(folder),
        "also_measured_at": _other_commits(folder, name["commit"]),
        "modified_tree": _modified_tree(folder),
        "selection_rows": sum(len(_read_csv(folder / f)) for f in selection),
        "moe_layer_rows": sum(len(_read_csv(folder / f)) for f in moe_layer),
        "files": _files(folder),
    }


def _files(folder: Path) -> list[str]:
    """Every file of a run folder but its ``run.json``, subfolders included, as paths relative to it."""
    return sorted(
        p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p != folder / "run.json"
    )


def _driver(folder: Path) -> tuple[str | None, str | None]:
    """The GPU driver version and the file it was read from: nvidia-smi's line in a log first (what the
    machine said), else a Markdown's "driver N" (what a person wrote); (None, None) where no file has it."""
    for path in [*sorted(folder.rglob("*.log")), *sorted(folder.rglob("*.md"))]:
        match = DRIVER.search(path.read_text(encoding="utf-8", errors="replace"))
        if match:
            return match.group(1), path.relative_to(folder).as_posix()
    return None, None


def _modified_tree(folder: Path) -> list[str]:
    """Result files a run folder's own text says were measured on a tree with uncommitted changes.

    A result's header (its first six lines) whose ``git`` field carries more than a hex sha (the bench
    scripts write ``--git-sha`` there): that file and the CSV of the same stem, which the same call
    wrote; a file whose first six lines say it ran with a change made or patched by hand; the outputs a
    run README's table lists for a script that ran against a ``.patch``.
    """
    found: set[str] = set()
    for path in sorted([*folder.rglob("*.md"), *folder.rglob("*.txt")]):
        opening = "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[:6])
        marked = any(suffix for _sha, suffix in GIT_FIELD.findall(opening))
        if marked or re.search(r"\b(?:made|patched) by hand\b", opening):
            found.add(path.relative_to(folder).as_posix())
            if marked and path.with_suffix(".csv").is_file():
                found.add(path.with_suffix(".csv").relative_to(folder).as_posix())
        if path.name == "README.md":
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                row = PATCH_ROW.match(line.strip())
                for output in re.findall(r"`([^`]+)`", row.group(1)) if row else []:
                    if (path.parent / output).is_file():
                        found.add((path.parent / output).relative_to(folder).as_posix())
    return sorted(found)


def _other_commits(folder: Path, commit: str) -> list[str]:
    """Commits other than the folder's that its result files say they were measured at (``git <sha>``
    in a result table's header): a run that timed a branch or an A/B beside its own commit."""
    found: list[str] = []
    for path in sorted([*folder.glob("*.md"), *folder.glob("*.txt")]):
        for match in re.finditer(r"\bgit ([0-9a-f]{7,40})\b", path.read_text(encoding="utf-8", errors="replace")):
            sha = match.group(1)[:7]
            if not commit.startswith(sha) and sha not in found:
                found.append(sha)
    return found


def run_folders() -> list[Path]:
    return sorted((p for p in RUNS.iterdir() if p.is_dir() and FOLDER.match(p.name)), key=lambda p: p.name)


def runs_block(records: list[dict]) -> str:
    lines = [
        "| run | commit | device | driver | torch / Triton | stages | GPU tests | selection rows | MoE-layer rows |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        tests_cell = _tests_cell(r["tests"])
        stages = ", ".join(r["stages"]) or "-"
        also = "".join(f" (files also at `{sha}`)" for sha in r["also_measured_at"])
        if r["modified_tree"]:
            count = len(r["modified_tree"])
            also += f" ({count} file{'s' if count > 1 else ''} on a modified tree)"
        lines.append(
            f"| [{r['date']}](gpu/{r['folder']}/) | `{r['commit']}`{also} | {r['device'] or '-'} | "
            f"{r['driver'] or '-'} | "
            f"{r['torch'] or '-'} / {r['triton'] or '-'} | {stages} | {tests_cell} | {r['selection_rows']} | "
            f"{r['moe_layer_rows']} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- selection
def _selection_runs(records: list[dict]) -> list[dict]:
    """Runs with one ``selection.csv`` of every router: the ones the selection table compares."""
    out = []
    for r in records:
        path = RUNS / r["folder"] / "selection.csv"
        if path.exists():
            rows = selection_table.load(path)
            if {row["model"] for row in rows} >= set(selection_table.ROUTERS):
                out.append({**r, "rows": rows})
    return out


def selection_block(records: list[dict]) -> str:
    runs = _selection_runs(records)
    latest, before = runs[-1], runs[-2] if len(runs) > 1 else None
    lines = [
        f"Added cost `selection_us - none_us` (µs) at `{latest['commit']}` ({latest['date']}, "
        f"[run](gpu/{latest['folder']}/)), every call with the serving plugin's metrics row; in brackets the "
        + (f"same cell at `{before['commit']}`" if before else "previous run")
        + ". Bold: within the 2 µs goal. `none` is the fused top-k alone (absolute µs).",
        "",
        selection_table.table(latest["rows"], before["rows"] if before else None),
    ]
    if before:
        bands = ((1, 8), (32,), (64, 128, 256, 512))
        lines += ["", "Change from the run before, per band of T: "]
        lines[-1] += "; ".join(selection_table.differences(latest["rows"], before["rows"], bands)) + "."
    return "\n".join(lines)


GREEDY_RANKINGS = ("moe-spec-coverage", "moe-spec-coact")


def goals_block(records: list[dict]) -> str:
    """How far the latest complete selection run is from the goals, per router: ``none`` <= 3 µs, the
    added cost <= 2 µs (by T band), LYNX flat in T above one tile, the selection <= 3% of every layer
    of at least 70 µs, and the distance to the 1% stretch."""
    latest = _selection_runs(records)[-1]
    rows = latest["rows"]
    lines = [
        f"At `{latest['commit']}` (its selection stage, every call with the metrics row). A range is over "
        "the rows of that router; *rules*: every policy but LYNX and the two calibrated greedy rankings "
        "(coverage, co-activation), which have their own lines.",
        "",
        "| goal | " + " | ".join(selection_table.ROUTERS.values()) + " |",
        "|---|" + "---|" * len(selection_table.ROUTERS),
    ]

    def per_router(cell) -> str:
        return " | ".join(cell([r for r in rows if r["model"] == model]) for model in selection_table.ROUTERS)

    def none_cell(mine):
        medians = [
            statistics.median([r["none_us"] for r in mine if r["T"] == t]) for t in sorted({r["T"] for r in mine})
        ]
        met = "met" if max(medians) <= 3.0 else "not met"
        return f"{met}: median per T {min(medians):.2f}-{max(medians):.2f} µs"

    def added_cell(band, policies):
        def cell(mine):
            values = [r["added_us"] for r in mine if r["T"] in band and policies(r["policy"])]
            if not values:
                return "-"
            met = sorted({r["policy"] for r in mine if r["T"] in band and policies(r["policy"]) and r["added_us"] <= 2})
            low, high = f"{min(values):.1f}", f"{max(values):.1f}"
            head = (low if low == high else f"{low}-{high}") + " µs"
            return head + (f"; met by {', '.join(met)}" if met else "")

        return cell

    def rules(policy):
        return policy != "lynx" and policy not in GREEDY_RANKINGS

    def share_cell(mine):
        large = [r for r in mine if r["layer_us"] >= selection_table.LARGE_LAYER_US and r["policy"] != "none"]
        if not large:
            return "-"
        shares = [r["selection_us"] / r["layer_us"] for r in large]
        within = sum(share <= 0.03 for share in shares)
        return f"{within} of {len(large)} rows ({100 * min(shares):.1f}-{100 * max(shares):.1f}%)"

    def stretch_cell(policies):
        def cell(mine):
            worst = []
            for policy in {r["policy"] for r in mine if policies(r["policy"])}:
                large = [r for r in mine if r["policy"] == policy and r["layer_us"] >= selection_table.LARGE_LAYER_US]
                if large:
                    worst.append(max(r["selection_us"] - selection_table.STRETCH_SHARE * r["layer_us"] for r in large))
            return "-" if not worst else f"{min(worst):.1f}-{max(worst):.1f} µs"

        return cell

    above = (32, 64, 128, 256, 512)
    lines += [
        "| `none` <= 3 µs | " + per_router(none_cell) + " |",
        "| added <= 2 µs, T=1, rules | " + per_router(added_cell((1,), rules)) + " |",
        "| added, T=8, rules | " + per_router(added_cell((8,), rules)) + " |",
        "| added, T=32-512, rules | " + per_router(added_cell(above, rules)) + " |",
        "| LYNX, T=1 / T=32-512 (flat in T?) | "
        + " | ".join(
            added_cell((1,), lambda p: p == "lynx")([r for r in rows if r["model"] == m])
            + " / "
            + added_cell(above, lambda p: p == "lynx")([r for r in rows if r["model"] == m])
            for m in selection_table.ROUTERS
        )
        + " |",
        "| calibrated rankings, T=1 / T=32-512 | "
        + " | ".join(
            added_cell((1,), lambda p: p in GREEDY_RANKINGS)([r for r in rows if r["model"] == m])
            + " / "
            + added_cell(above, lambda p: p in GREEDY_RANKINGS)([r for r in rows if r["model"] == m])
            for m in selection_table.ROUTERS
        )
        + " |",
        "| selection <= 3% of every layer >= 70 µs | " + per_router(share_cell) + " |",
        "| distance to the 1% stretch, rules, worst T | " + per_router(stretch_cell(rules)) + " |",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- MoE layer
def _fused_topk_gap(folder: Path) -> dict[tuple[str, int], float]:
    """(router, T) -> median of ``topk_us - none_us`` over a run's selection rows: what a torch-op
    top-k costs over the fused one."""
    gaps: dict[tuple[str, int], list[float]] = {}
    for path in sorted(folder.glob("selection*.csv")):
        for row in _read_csv(path):
            gaps.setdefault((row["model"], int(row["T"])), []).append(float(row["topk_us"]) - float(row["none_us"]))
    return {key: statistics.median(values) for key, values in gaps.items()}


def moe_rows(folder: Path) -> list[dict]:
    """A run's MoE-layer rows with the speed-up against a fused top-k.

    Measured where the run's baseline was one (``baseline`` column); otherwise estimated from the same
    run's selection rows, or not estimable (``fused`` None), with ``no_estimate`` saying why:
    ``"no-row"`` (no selection row of the router at that T) or ``"other-topk"`` (the selection rows
    time another top-k than the layer's, :data:`OTHER_TOPK`).  ``fused_us`` is the fused baseline's
    time (measured or estimated), ``repeat_gap_us`` how far the baseline timed again in the same case
    (``baseline_repeat_us``) is from its first timing.
    """
    gap = _fused_topk_gap(folder)
    rows = []
    for path in sorted(folder.glob("moe_layer*.csv")):
        for row in _read_csv(path):
            pruned, base, tokens = float(row["pruned_us"]), float(row["baseline_us"]), int(row["T"])
            router = SELECTION_MODEL.get(row["model"], row["model"])
            no_estimate = None
            if row.get("baseline"):  # the baseline routed by a fused top-k
                fused_us, estimated = base, False
                torch_topk = (
                    float(row["baseline_torch_topk_us"]) / pruned if row.get("baseline_torch_topk_us") else None
                )
            else:
                torch_topk, estimated = base / pruned, True
                router_gap = gap.get((router, tokens))
                if router in OTHER_TOPK:
                    fused_us, no_estimate = None, "other-topk"
                elif router_gap is None:
                    fused_us, no_estimate = None, "no-row"
                else:
                    fused_us = base - router_gap
            repeat = row.get("baseline_repeat_us")
            rows.append(
                {
                    "model": row["model"],
                    "phase": row["phase"],
                    "T": tokens,
                    "policy": row["policy"],
                    "fused": None if fused_us is None else fused_us / pruned,
                    "torch": torch_topk,
                    "estimated": estimated,
                    "no_estimate": no_estimate,
                    "pruned_us": pruned,
                    "fused_us": fused_us,
                    "repeat_gap_us": abs(float(repeat) - base) if repeat else None,
                }
            )
    return rows


def topk_timed_twice(folder: Path) -> dict[tuple[str, int], float]:
    """(router, T) -> the spread of a run's timings of one torch-op top-k: the selection benchmark times
    it once per phase (its decode rows, ``D`` = 1, and its verify rows, ``D`` = 4, of the same T) and per
    file; every row of one (file, phase) carries the same ``topk_us``.  Only (router, T) timed twice."""
    timings: dict[tuple[str, int], dict[tuple[str, str], float]] = {}
    for path in sorted(folder.glob("selection*.csv")):
        for row in _read_csv(path):
            key = (row["model"], int(row["T"]))
            timings.setdefault(key, {})[(path.name, row.get("D", ""))] = float(row["topk_us"])
    return {key: max(v.values()) - min(v.values()) for key, v in timings.items() if len(v) > 1}


def _range(values: list[float], digits: int = 2) -> str:
    return "-" if not values else f"{min(values):.{digits}f}-{max(values):.{digits}f}"


POLICY_COLUMNS = ("xshare", "moe-spec", "xshare-spec", "lynx", "xshare-ep")


def _not_estimated(rows: list[dict]) -> str:
    """``n/a``, marked ``†`` where a row is not estimable because its run timed another top-k."""
    return "n/a†" if any(row["no_estimate"] == "other-topk" for row in rows) else "n/a"


def moe_layer_block(records: list[dict]) -> str:
    lines = [
        "Speed-up of the pruned MoE layer (unpruned / pruned time, the range over T and settings) against the "
        "unpruned layer routed by a fused top-k, what a user runs. \\*: estimated, the run's baseline routed "
        "with torch ops, less its median `topk_us - none_us` at that router and T. n/a: no selection row at "
        f"that T; n/a†: not estimable, {OTHER_TOPK_NOTE}. *rows*: in brackets those with no fused figure, left "
        "out of the ranges and of *< 1x* (rows slower than the fused baseline). *torch*: against the torch-op "
        "top-k's layer.",
        "",
        "| run | model | phase | rows | " + " | ".join(POLICY_COLUMNS) + " | torch | < 1x |",
        "|---|---|---|---:|" + "---|" * len(POLICY_COLUMNS) + "---|---:|",
    ]
    for r in records:
        rows = moe_rows(RUNS / r["folder"])
        groups: dict[tuple, list[dict]] = {}
        for row in rows:
            groups.setdefault((row["model"], row["phase"]), []).append(row)
        for (model, phase), members in groups.items():
            cells = []
            for policy in POLICY_COLUMNS:
                mine = [m for m in members if m["policy"] == policy]
                fused = [m["fused"] for m in mine if m["fused"] is not None]
                star = "\\*" if fused and any(m["estimated"] for m in mine) else ""
                cells.append(_range(fused) + star if fused else (_not_estimated(mine) if mine else "-"))
            torch_topk = [m["torch"] for m in members if m["torch"] is not None]
            estimable = [m for m in members if m["fused"] is not None]
            slower = str(sum(m["fused"] < 1.0 for m in estimable)) if estimable else _not_estimated(members)
            missing = len(members) - len(estimable)
            count = f"{len(members)} ({missing})" if missing else str(len(members))
            lines.append(
                f"| `{r['commit']}` | {MODEL_NAMES.get(model, model)} | {phase} | {count} | "
                + " | ".join(cells)
                + f" | {_range(torch_topk)} | {slower} |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- README
def _us(values: list[float]) -> str:
    return _range(values, 1) if f"{min(values):.1f}" != f"{max(values):.1f}" else f"{min(values):.1f}"


def _below_one(layer: list[dict], folder: Path) -> str:
    """The rows of one run slower than the fused baseline: how many, how far, and the noise of the
    estimate there (the same torch-op top-k timed twice, those rows' unpruned layer timed twice)."""
    estimable = [row for row in layer if row["fused"] is not None]
    slower = [row for row in estimable if row["fused"] < 1.0]
    if not slower:
        return f"No row below 1.0x (of {len(estimable)})."
    text = (
        f"Below 1.0x ({len(slower)} of {len(estimable)}): {_range([row['fused'] for row in slower])}x, "
        f"{_us([row['pruned_us'] - row['fused_us'] for row in slower])} µs slower"
    )
    twice = topk_timed_twice(folder)
    noise = [v for (router, _t), v in twice.items() if router not in OTHER_TOPK]
    repeats = [row["repeat_gap_us"] for row in slower if row["repeat_gap_us"] is not None]
    if any(row["estimated"] for row in slower) and noise:
        text += f"; the same torch top-k timed twice in that run differs by up to {max(noise):.1f} µs"
        if len(repeats) == len(slower):
            text += f", those rows' unpruned layer by {_us(repeats)} µs"
    return text + "."


def readme_block(records: list[dict]) -> str:
    """The latest timed commit's selection cost and MoE-layer speed-ups, one line per router."""
    runs = _selection_runs(records)
    latest = runs[-1]
    # the MoE layer at the latest run whose MoE-layer stage reached every model
    every = {*selection_table.ROUTERS, *SELECTION_MODEL} - {"deepseek-v3"}
    complete = [r for r in records if {row["model"] for row in moe_rows(RUNS / r["folder"])} >= every]
    widest = complete[-1]
    layer = moe_rows(RUNS / widest["folder"])
    lines = [
        f"Selection cost over a fused top-k (µs per layer call, the range over the policies except the two "
        f"calibrated greedy rankings) at `{latest['commit']}`, and the pruned MoE layer's speed-up at "
        f"`{widest['commit']}` (the latest run with every model's layer), on one NVIDIA H200. Every "
        "figure is generated from [docs/gpu/](docs/gpu/) by `scripts/results.py`.",
        "",
        "| router | `none` µs, T=1 | added µs, T=1 | T=8 | T=512 | MoE-layer speed-up, fused top-k baseline "
        "| torch top-k baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    greedy = {"moe-spec-coverage", "moe-spec-coact"}
    left_out: list[str] = []
    for model, name in selection_table.ROUTERS.items():
        rows = [row for row in latest["rows"] if row["model"] == model and row["policy"] not in greedy]

        def added(tokens: int, rows=rows) -> str:
            values = [row["added_us"] for row in rows if row["T"] == tokens]
            return _range(values, 1)

        none = [row["none_us"] for row in latest["rows"] if row["model"] == model and row["T"] == 1]
        models = {model} | {k for k, v in SELECTION_MODEL.items() if v == model}
        speed = [row for row in layer if row["model"] in models]
        fused = [row["fused"] for row in speed if row["fused"] is not None]
        if fused:
            star = "\\*" if any(row["estimated"] for row in speed) else ""
            slower = sum(value < 1.0 for value in fused)
            speed_cell = f"{_range(fused)}{star} ({slower} of {len(fused)} < 1.0x)"
            if len(fused) < len(speed):
                left_out.append(f"{len(fused)} of {len(speed)} {name} rows")
        else:
            speed_cell = _not_estimated(speed) if speed else "-"
        torch_topk = [row["torch"] for row in speed if row["torch"] is not None]
        lines.append(
            f"| {name} | {statistics.median(none):.1f} | {added(1)} | {added(8)} | {added(512)} | "
            f"{speed_cell} | {_range(torch_topk)} |"
        )
    lines += [
        "",
        "\\* estimated: the run's torch-op baseline less its `topk_us - none_us`, at a T with a selection row"
        + (f" ({'; '.join(left_out)})" if left_out else "")
        + ". "
        + _below_one(layer, RUNS / widest["folder"]),
    ]
    if any(row["no_estimate"] == "other-topk" for row in layer):
        lines += ["", f"† not estimable: {OTHER_TOPK_NOTE}."]
    return "\n".join(lines)


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


def docker_block(_records: list[dict]) -> str:
    """Per Docker smoke run: where it ran, each step's seconds, the images' sizes."""
    lines = []
    for folder in sorted(DOCKER_RUNS.iterdir()) if DOCKER_RUNS.is_dir() else []:
        run = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        how = "base reused from an earlier run" if run["base_reused"] else "everything built"
        daemon = "daemon started by the run" if run["daemon_started_by_run"] else "daemon already running"
        log = folder / "smoke.log"
        installed = (
            re.findall(r"installing Debian packages: (.+)", log.read_text(encoding="utf-8")) if log.is_file() else []
        )
        if installed:
            daemon += f", Debian packages installed by the run: {', '.join(installed)}"
        lines += [
            f"**`{folder.name}`**: {run['status']} in {run['total_seconds']} s at `{run['commit']}` ({how}; "
            f"{run['cores']} cores; Docker {run['docker']}, {run['storage_driver']}; {daemon}).",
            "",
            "| step | seconds |",
            "|---|---|",
            *(f"| {step['step']} | {step['seconds']} |" for step in run["steps"]),
            "",
        ]
        sizes = run["image_bytes"]
        base = next((size for name, size in sizes.items() if name.startswith("xshare-smoke/cpu-base:")), None)
        image = next((size for name, size in sizes.items() if name.startswith("xshare-smoke/xshare-sglang:")), None)
        described = [f"`{name.split(':')[0]}` {_gigabytes(size)}" for name, size in sizes.items()]
        if base is not None and image is not None:
            described.append(f"the project's layers {(image - base) / 1e6:.0f} MB")
        lines += ["Image sizes (`docker image inspect`, 10^9 bytes): " + ", ".join(described) + ".", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the blocks
BLOCKS = {
    "runs": runs_block,
    "selection": selection_block,
    "goals": goals_block,
    "moe-layer": moe_layer_block,
    "readme": readme_block,
    "docker": docker_block,
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- results:{name} -->", f"<!-- /results:{name} -->"


def replace_block(document: str, name: str, body: str) -> str:
    begin, end = _markers(name)
    if begin not in document or end not in document:
        raise ValueError(f"no {begin} ... {end} markers")
    head, rest = document.split(begin, 1)
    return head + begin + "\n" + body.strip("\n") + "\n" + end + rest.split(end, 1)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a run.json or a block differs")
    args = parser.parse_args(argv)
    records = [run_record(folder) for folder in run_folders()]
    drift = []
    for record in records:
        path = RUNS / record["folder"] / "run.json"
        text = json.dumps(record, indent=1) + "\n"
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                drift.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text, encoding="utf-8")
    documents: dict[str, str] = {}
    for name, make in BLOCKS.items():
        doc = DOCS[name]
        documents.setdefault(doc, (ROOT / doc).read_text(encoding="utf-8"))
        documents[doc] = replace_block(documents[doc], name, make(records))
    for doc, text in documents.items():
        if (ROOT / doc).read_text(encoding="utf-8") != text:
            if args.check:
                drift.append(doc)
            else:
                (ROOT / doc).write_text(text, encoding="utf-8")
    if drift:
        print("generated figures out of date (run python3 scripts/results.py): " + ", ".join(drift))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
