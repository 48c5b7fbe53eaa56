"""The table of the pruner's command-line flags: their names, the value checks, and the flag of
each setting.

Why: the parser (:mod:`.flag_parser`), the merge of what was typed (:mod:`.flag_merge`) and the
checks that name a flag in their messages (:mod:`.mode_checks`, :mod:`.echo_checks`) must agree on
every flag's name.  How: one ``--moe-pruner-*`` flag per ``PrunerConfig`` field
(:data:`FIELD_FLAGS`), plus the named flags of the policy, the config, the log interval, the metrics
sampling, the trace, the guard and ECHO; :func:`flag_for_field` maps a setting back to its flag.
The value checks raise ``argparse.ArgumentTypeError`` naming what is allowed, which
:class:`~.flag_errors.CheckedValue` turns into one line.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from ..config import BUDGET_ALLOCATIONS, COVERAGES, PHASES, RANKINGS, SCOPES, SCORES

FLAG_PREFIX = "--moe-pruner"
CONFIG_FLAG = "--moe-pruner-config"
LOG_INTERVAL_FLAG = "--moe-pruner-log-interval"
METRICS_EVERY_FLAG = "--moe-pruner-metrics-every"
VERIFY_FLAG = "--moe-pruner-verify"
#: ECHO's flags, named outside SGLang's ``--speculative-*`` space (an upstream proposal uses
#: ``--speculative-echo-threshold``), so that neither can shadow the other.
ECHO_FLAGS = {
    "calibration": "--xshare-echo-calibration",
    "budget": "--xshare-echo-budget",
    "default_width": "--xshare-echo-default-width",
    "max_width": "--xshare-echo-max-width",
    "log_dir": "--xshare-echo-log-dir",
    "log_every": "--xshare-echo-log-every",
    "log_max_records": "--xshare-echo-log-max-records",
}
GUARD_FLAGS = {
    "guard": "--moe-pruner-guard",
    "guard_margin": "--moe-pruner-guard-margin",
    "guard_seconds": "--moe-pruner-guard-seconds",
    "guard_trace": "--moe-pruner-guard-trace",
}
TRACE_FLAGS = {
    "trace_dir": "--moe-pruner-trace-dir",
    "trace_every": "--moe-pruner-trace-every",
    "trace_max_mb": "--moe-pruner-trace-max-mb",
}


def non_negative_int(text: str) -> int:
    """An integer >= 0, or ``argparse.ArgumentTypeError``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1, or ``argparse.ArgumentTypeError``."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def real_number(text: str) -> float:
    """A number, or ``argparse.ArgumentTypeError``."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_real(text: str) -> float:
    """A number > 0, or ``argparse.ArgumentTypeError``."""
    value = real_number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _phases(text: str) -> tuple[str, ...]:
    phases = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list drawn from {', '.join(PHASES)}, got {text!r}"
        )
    return phases


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    field: str
    type: Callable[[str], Any] | None
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return f"{FLAG_PREFIX}-{self.field.replace('_', '-')}"

    @property
    def dest(self) -> str:
        """Attribute name argparse stores the value under."""
        return f"moe_pruner_{self.field}"


FIELD_FLAGS: tuple[FlagSpec, ...] = (
    FlagSpec("k0", non_negative_int, "warm-up: every real token's top-k0 experts are always kept"),
    FlagSpec("budget", non_negative_int, "experts the batch-level greedy step adds (xshare, xshare-spec)"),
    FlagSpec("request_budget", non_negative_int, "experts each request's greedy step adds (xshare-spec)"),
    FlagSpec("rank_budget", non_negative_int, "per-GPU budget of the EP-balanced rounds (xshare-ep)"),
    FlagSpec(
        "max_experts",
        positive_int,
        "expert budget B of moe-spec (required there); a hard cap on the kept experts for any other policy",
    ),
    FlagSpec("tau", real_number, "xshare-threshold keeps this share of the batch's score mass, in (0, 1]"),
    FlagSpec("score", None, "per-token score that aggregates sum (default: the policy's)", SCORES),
    FlagSpec("coverage", None, "route inside the kept set by substitution or truncation", COVERAGES),
    FlagSpec(
        "ranking",
        None,
        "moe-spec ranks by router scores, by calibration counts (static), or by router scores discounted by "
        "calibration co-activation (coactivation)",
        RANKINGS,
    ),
    FlagSpec(
        "static_ranking_path",
        str,
        "calibration JSON file (xshare-sglang calibrate) for --moe-pruner-ranking static/coactivation and "
        "--moe-pruner-budget-allocation calibrated",
        metavar="PATH",
    ),
    FlagSpec("alpha", real_number, "LYNX bin scale (bins are 1/alpha wide in logit units), > 0"),
    FlagSpec("beta", positive_int, "LYNX lowest bin index, >= 1"),
    FlagSpec(
        "phases",
        _phases,
        f"comma-separated forward phases to prune, from {', '.join(PHASES)}",
        metavar="PHASES",
    ),
    FlagSpec("min_tokens", non_negative_int, "prune only layer calls with at least this many real tokens"),
    FlagSpec("max_tokens", positive_int, "prune only layer calls with at most this many real tokens"),
    FlagSpec(
        "scope",
        None,
        "moe-spec in speculative verify: one expert budget for the whole batch, or one per request's draft tree",
        SCOPES,
    ),
    FlagSpec(
        "depth_decay",
        real_number,
        "speculative verify: a draft node at depth d votes with weight X**d, in (0, 1]; nodes that can "
        "never be accepted do not vote",
    ),
    FlagSpec(
        "budget_allocation",
        None,
        "moe-spec: the same --moe-pruner-max-experts in every layer (uniform), or per-layer budgets averaging it, "
        "set from the calibration file's budget curves (calibrated)",
        BUDGET_ALLOCATIONS,
    ),
)


def flag_for_field(field: str) -> str:
    """The command-line flag that sets a config field (for error messages)."""
    if field == "policy":
        return FLAG_PREFIX
    if field == "log_interval":
        return LOG_INTERVAL_FLAG
    if field == "metrics_every":
        return METRICS_EVERY_FLAG
    if field in TRACE_FLAGS:
        return TRACE_FLAGS[field]
    if field in GUARD_FLAGS:
        return GUARD_FLAGS[field]
    if field.startswith("echo."):
        return ECHO_FLAGS[field[len("echo.") :]]
    return f"{FLAG_PREFIX}-{field.replace('_', '-')}"
