"""Summarize an A/B run from its raw records: paired speed-ups per concurrency and accuracy deltas.

Comparisons are *paired by repetition*: in repetition r, a candidate's throughput is divided by the
baseline's throughput of the same repetition (the two ran within one round of the arms), and the report gives the
median of those ratios with their range over repetitions.  A repetition where either side failed adds
no pair.  Accuracy deltas are paired the same way, in points of GSM8K accuracy.

Everything here reads only ``runs.jsonl``, so ``--report DIR`` rebuilds the summary of a finished or
interrupted run.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def read_runs(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``runs.jsonl`` file (a folder means its ``runs.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        path = path / "runs.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such file (expected the runs.jsonl of an A/B run)")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
    return rows


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


@dataclass(frozen=True)
class Spread:
    """Median and range of paired values over repetitions."""

    median: float | None
    low: float | None
    high: float | None
    pairs: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(_median(values), min(values, default=None), max(values, default=None), len(values))


@dataclass(frozen=True)
class ServingRow:
    """One arm at one dataset and concurrency.

    Attributes
    ----------
    output_throughput : float or None
        Median over repetitions of the client's output tokens per second.
    throughput_low, throughput_high : float or None
        Its lowest and highest value over repetitions.
    throughput_delta : Spread
        Paired ``candidate / baseline - 1`` (fractions; the baseline's own row has no pairs).
    median_tpot_ms, tpot_delta
        The same for the median time per output token (negative delta = faster).
    accept_length : float or None
        Mean over repetitions of the server's average speculative accept length (None without
        speculative decoding).
    activated_experts : float or None
        Mean over repetitions of the plugin's activated experts per layer call (pruned arms only).
    verify_activated_experts : float or None
        The same for speculative verify calls alone (pruned arms of a speculative server only).
    repetitions : int
        Successful runs.
    """

    dataset: str
    concurrency: int
    arm: str
    baseline: bool
    output_throughput: float | None
    throughput_low: float | None
    throughput_high: float | None
    throughput_delta: Spread
    median_tpot_ms: float | None
    tpot_delta: Spread
    accept_length: float | None
    activated_experts: float | None
    repetitions: int
    verify_activated_experts: float | None = None


@dataclass(frozen=True)
class AccuracyRow:
    """GSM8K accuracy of one arm: mean over repetitions, and paired difference to the baseline in points."""

    arm: str
    baseline: bool
    accuracy: float | None
    delta_points: Spread
    invalid: float | None
    repetitions: int


@dataclass(frozen=True)
class Summary:
    model_path: str | None
    arms: list[str]
    baseline: str | None
    repeats: int
    serving: list[ServingRow]
    accuracy: list[AccuracyRow]
    failures: list[str] = field(default_factory=list)
    versions: dict[str, Any] = field(default_factory=dict)
    git_sha: str | None = None
    server_version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _paired(candidate: dict[int, float], baseline: dict[int, float], relative: bool) -> list[float]:
    out = []
    for repeat in sorted(set(candidate) & set(baseline)):
        if relative:
            if baseline[repeat] > 0:
                out.append(candidate[repeat] / baseline[repeat] - 1.0)
        else:
            out.append(candidate[repeat] - baseline[repeat])
    return out


def _number(metrics: dict[str, Any] | None, key: str) -> float | None:
    value = (metrics or {}).get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def summarize(rows: list[dict[str, Any]]) -> Summary:
    """Build the summary of one A/B run from its records (see :func:`read_runs`)."""
    arms: list[str] = []
    baseline = None
    for row in rows:
        if row.get("arm") not in arms:
            arms.append(row["arm"])
        if row.get("baseline"):
            baseline = row["arm"]
    # value[(dataset, concurrency, arm)][metric][repeat]
    serving: dict[tuple, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    accuracy: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    failures = []
    server_version = None
    for row in rows:
        status = row.get("status")
        if row["record"] == "session":
            server_version = server_version or row.get("server_version")
            if status in ("failed", "skipped"):
                failures.append(f"repetition {row['repeat']}, arm {row['arm']}: {status}: {row.get('error')}")
            continue
        if status != "ok":
            if status == "failed":
                where = f"{row.get('dataset')} c={row.get('concurrency')}" if row["record"] == "serving" else "GSM8K"
                failures.append(f"repetition {row['repeat']}, arm {row['arm']}, {where}: failed: {row.get('error')}")
            continue
        metrics = row.get("metrics") or {}
        if row["record"] == "serving":
            cell = serving[(row["dataset"], row["concurrency"], row["arm"])]
            for key in ("output_throughput", "median_tpot_ms", "accept_length"):
                value = _number(metrics, key)
                if value is not None:
                    cell[key][row["repeat"]] = value
            for key in ("activated_experts", "verify_activated_experts"):
                value = _number(row.get("pruner_metrics"), key)
                if value is not None:
                    cell[key][row["repeat"]] = value
        elif row["record"] == "accuracy":
            for key in ("accuracy", "invalid"):
                value = _number(metrics, key)
                if value is not None:
                    accuracy[row["arm"]][key][row["repeat"]] = value
    serving_rows = []
    for dataset, concurrency in sorted({(d, c) for d, c, _ in serving}, key=lambda k: (k[0], k[1])):
        base = serving.get((dataset, concurrency, baseline), {}) if baseline else {}
        for arm in arms:
            cell = serving.get((dataset, concurrency, arm))
            if cell is None:
                continue
            is_base = arm == baseline
            tput = cell.get("output_throughput", {})
            tpot = cell.get("median_tpot_ms", {})
            serving_rows.append(
                ServingRow(
                    dataset=dataset,
                    concurrency=concurrency,
                    arm=arm,
                    baseline=is_base,
                    output_throughput=_median(list(tput.values())),
                    throughput_low=min(tput.values(), default=None),
                    throughput_high=max(tput.values(), default=None),
                    throughput_delta=Spread.of(
                        [] if is_base else _paired(tput, base.get("output_throughput", {}), True)
                    ),
                    median_tpot_ms=_median(list(tpot.values())),
                    tpot_delta=Spread.of([] if is_base else _paired(tpot, base.get("median_tpot_ms", {}), True)),
                    accept_length=_mean(list(cell.get("accept_length", {}).values())),
                    activated_experts=_mean(list(cell.get("activated_experts", {}).values())),
                    repetitions=len(tput),
                    verify_activated_experts=_mean(list(cell.get("verify_activated_experts", {}).values())),
                )
            )
    accuracy_rows = []
    base_acc = accuracy.get(baseline, {}).get("accuracy", {}) if baseline else {}
    for arm in arms:
        if arm not in accuracy:
            continue
        acc = accuracy[arm].get("accuracy", {})
        is_base = arm == baseline
        accuracy_rows.append(
            AccuracyRow(
                arm=arm,
                baseline=is_base,
                accuracy=_mean(list(acc.values())),
                delta_points=Spread.of([] if is_base else [100.0 * d for d in _paired(acc, base_acc, False)]),
                invalid=_mean(list(accuracy[arm].get("invalid", {}).values())),
                repetitions=len(acc),
            )
        )
    first = rows[0] if rows else {}
    return Summary(
        model_path=first.get("model_path"),
        arms=arms,
        baseline=baseline,
        repeats=max((row.get("repeat", 0) for row in rows), default=0),
        serving=serving_rows,
        accuracy=accuracy_rows,
        failures=failures,
        versions=first.get("versions") or {},
        git_sha=first.get("git_sha"),
        server_version=server_version,
    )


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _spread(spread: Spread, scale: float = 1.0, unit: str = "") -> str:
    """``median[unit] [low, high] (n=pairs)``, values times ``scale``; a dash without pairs."""
    if spread.pairs == 0:
        return "–"
    text = f"{scale * spread.median:+.1f}{unit}"
    if spread.pairs > 1:
        text += f" [{scale * spread.low:+.1f}, {scale * spread.high:+.1f}]"
    return text + f" (n={spread.pairs})"


def _arm_label(arm: str, baseline: bool) -> str:
    return f"{arm} (baseline)" if baseline and arm != "baseline" else arm


def render_markdown(summary: Summary) -> str:
    """The Markdown report of :func:`summarize`."""
    lines = [f"# A/B summary: {summary.model_path or 'model'}", ""]
    versions = ", ".join(f"{k} {v}" for k, v in summary.versions.items() if v)
    lines.append(
        f"Arms: {', '.join(summary.arms)} (baseline: {summary.baseline or 'none'}); repetitions: {summary.repeats}, "
        "the order of the arms rotated by one each repetition."
    )
    lines.append(
        f"Client: {versions or 'versions unknown'}; server SGLang {summary.server_version or 'unknown'}; "
        f"xshare-sglang commit {summary.git_sha or 'unknown'}."
    )
    lines.append("")
    lines.append(
        "Δ = median over repetitions of (candidate / baseline − 1), each pair from one repetition; "
        "[low, high] = range over repetitions, n = pairs. Throughput = output tokens/s of SGLang's benchmark "
        "client; TPOT = its median time per output token (negative Δ is faster)."
    )
    datasets = list(dict.fromkeys(row.dataset for row in summary.serving))
    for dataset in datasets:
        lines += ["", f"## Serving: {dataset}", ""]
        verify = any(row.verify_activated_experts is not None for row in summary.serving if row.dataset == dataset)
        lines.append(
            "| concurrency | arm | output tok/s | Δ throughput | median TPOT ms | Δ TPOT | accept length | "
            "activated experts |" + (" verify-phase activated experts |" if verify else "")
        )
        lines.append("|---:|---|---:|---|---:|---|---:|---:|" + ("---:|" if verify else ""))
        for row in summary.serving:
            if row.dataset != dataset:
                continue
            lines.append(
                f"| {row.concurrency} | {_arm_label(row.arm, row.baseline)} | "
                f"{_fmt(row.output_throughput)} | {_spread(row.throughput_delta, 100, '%')} | "
                f"{_fmt(row.median_tpot_ms, 2)} | "
                f"{_spread(row.tpot_delta, 100, '%')} | {_fmt(row.accept_length, 2)} | {_fmt(row.activated_experts)} |"
                + (f" {_fmt(row.verify_activated_experts)} |" if verify else "")
            )
    if summary.accuracy:
        lines += ["", "## Accuracy: GSM8K (SGLang's few-shot evaluation, shipped test split)", ""]
        lines.append("| arm | accuracy | Δ points vs baseline | invalid answers | repetitions |")
        lines.append("|---|---:|---|---:|---:|")
        for row in summary.accuracy:
            lines.append(
                f"| {_arm_label(row.arm, row.baseline)} | {_fmt(row.accuracy, 3)} | "
                f"{_spread(row.delta_points)} | {_fmt(row.invalid, 3)} | {row.repetitions} |"
            )
    lines += ["", "## Failures", ""]
    lines += [f"- {failure}" for failure in summary.failures] or ["None."]
    return "\n".join(lines) + "\n"
