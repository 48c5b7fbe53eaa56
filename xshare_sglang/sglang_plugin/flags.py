"""The ``--moe-pruner*`` command-line flags: one per ``PrunerConfig`` field, plus the config file,
the log interval and the policy of speculative verify forwards.

Every flag defaults to ``None`` on the parser, so that only the flags a user actually typed override
``--moe-pruner-config`` and the environment; the help text shows the effective defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from ..config import BUDGET_ALLOCATIONS, COVERAGES, PHASES, POLICIES, RANKINGS, SCOPES, SCORES, PrunerConfig
from ..spec.echo.settings import DEFAULT_LOG_EVERY as DEFAULT_ECHO_LOG_EVERY
from ..spec.echo.settings import DEFAULT_LOG_MAX_RECORDS as DEFAULT_ECHO_LOG_MAX_RECORDS
from .settings import DEFAULT_LOG_INTERVAL, DEFAULT_TRACE_EVERY, DEFAULT_TRACE_MAX_MB, ENV_VAR, PluginSettings

FLAG_PREFIX = "--moe-pruner"
CONFIG_FLAG = "--moe-pruner-config"
LOG_INTERVAL_FLAG = "--moe-pruner-log-interval"
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
TRACE_FLAGS = {
    "trace_dir": "--moe-pruner-trace-dir",
    "trace_every": "--moe-pruner-trace-every",
    "trace_max_mb": "--moe-pruner-trace-max-mb",
}


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_real(text: str) -> float:
    value = _real(text)
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


_DEFAULTS = PrunerConfig()
FIELD_FLAGS: tuple[FlagSpec, ...] = (
    FlagSpec("k0", _non_negative_int, "warm-up: every real token's top-k0 experts are always kept"),
    FlagSpec("budget", _non_negative_int, "experts the batch-level greedy step adds (xshare, xshare-spec)"),
    FlagSpec("request_budget", _non_negative_int, "experts each request's greedy step adds (xshare-spec)"),
    FlagSpec("rank_budget", _non_negative_int, "per-GPU budget of the EP-balanced rounds (xshare-ep)"),
    FlagSpec(
        "max_experts",
        _positive_int,
        "expert budget B of moe-spec (required there); a hard cap on the kept experts for any other policy",
    ),
    FlagSpec("tau", _real, "xshare-threshold keeps this share of the batch's score mass, in (0, 1]"),
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
    FlagSpec("alpha", _real, "LYNX bin scale (bins are 1/alpha wide in logit units), > 0"),
    FlagSpec("beta", _positive_int, "LYNX lowest bin index, >= 1"),
    FlagSpec(
        "phases",
        _phases,
        f"comma-separated forward phases to prune, from {', '.join(PHASES)}",
        metavar="PHASES",
    ),
    FlagSpec("min_tokens", _non_negative_int, "prune only layer calls with at least this many real tokens"),
    FlagSpec("max_tokens", _positive_int, "prune only layer calls with at most this many real tokens"),
    FlagSpec(
        "scope",
        None,
        "moe-spec in speculative verify: one expert budget for the whole batch, or one per request's draft tree",
        SCOPES,
    ),
    FlagSpec(
        "depth_decay",
        _real,
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


def _default_text(field: str) -> str:
    value = getattr(_DEFAULTS, field)
    if field == "phases":
        return ",".join(value)
    if field == "score":
        return "policy's"
    return "unset" if value is None else str(value)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add every ``--moe-pruner*`` flag to SGLang's parser (idempotent)."""
    if any(FLAG_PREFIX in option for action in parser._actions for option in action.option_strings):
        return
    group = parser.add_argument_group(
        "MoE expert pruning (xshare-sglang)",
        f"Batch-shared expert selection at decode and verify time. Also configurable through the "
        f"{ENV_VAR} environment variable (JSON); explicit flags win over {CONFIG_FLAG}, which wins "
        f"over the environment.",
    )
    group.add_argument(
        FLAG_PREFIX,
        choices=POLICIES,
        default=None,
        help="expert-pruning policy (default: none, the pruner is off)",
    )
    for spec in FIELD_FLAGS:
        metavar = spec.metavar or {_real: "X", _non_negative_int: "N", _positive_int: "N"}.get(spec.type)
        group.add_argument(
            spec.flag,
            type=spec.type,
            choices=spec.choices,
            default=None,
            metavar=metavar,
            help=f"{spec.help} (default: {_default_text(spec.field)})",
        )
    group.add_argument(
        VERIFY_FLAG,
        choices=POLICIES,
        default=None,
        help="policy of speculative verify forwards (EAGLE target verify), e.g. xshare-spec; the other "
        "settings are shared with decode unless the JSON config overrides them under 'verify' "
        "(default: the same policy as decode)",
    )
    group.add_argument(
        CONFIG_FLAG,
        default=None,
        metavar="JSON_OR_PATH",
        help="PrunerConfig as a JSON object or the path of a JSON file",
    )
    group.add_argument(
        LOG_INTERVAL_FLAG,
        type=_non_negative_int,
        default=None,
        metavar="N",
        help=f"log and export pruning metrics every N pruned forwards, 0 = never (default: {DEFAULT_LOG_INTERVAL})",
    )
    trace_options = (
        (
            "trace_dir",
            str,
            "DIR",
            "record the router logits of sampled eager decode/verify forwards into DIR as xshare-trace files for "
            "`xshare-sglang replay` (works with --moe-pruner none; CUDA-graph replays are not recorded, so add "
            "--disable-cuda-graph to record decode)",
        ),
        ("trace_every", _positive_int, "N", f"record one eligible forward in N (default: {DEFAULT_TRACE_EVERY})"),
        (
            "trace_max_mb",
            _positive_int,
            "MB",
            f"stop recording when the trace files reach MB MiB (default: {DEFAULT_TRACE_MAX_MB})",
        ),
    )
    _add_options(group, TRACE_FLAGS, trace_options)
    echo = parser.add_argument_group(
        "ECHO draft-tree scheduling (xshare-sglang)",
        "Elastic verification budget with sparse confidence gating for EAGLE/EAGLE3 trees "
        "(--speculative-eagle-topk > 1). Within SGLang's fixed draft-token layout, nodes outside a "
        "request's allocation are cut from its tree (never accepted) and cast no expert vote.",
    )
    echo_options = (
        ("calibration", str, "PATH", "turn ECHO on with the gates of this `xshare-sglang echo-calibrate` file"),
        (
            "budget",
            _positive_real,
            "X",
            "draft nodes per request per verify step, on average over the batch (default: "
            "--speculative-num-draft-tokens minus 1, the static tree's count)",
        ),
        ("default_width", _positive_int, "N", "nodes per depth for requests that pass their gates (default: 1)"),
        (
            "max_width",
            _positive_int,
            "N",
            "nodes at the truncation depth for requests that fail a gate (default: --speculative-eagle-topk)",
        ),
        (
            "log_dir",
            str,
            "DIR",
            "log sampled draft confidences and accepted lengths into DIR (JSON lines) for `xshare-sglang "
            "echo-calibrate`; run it with ECHO off",
        ),
        ("log_every", _positive_int, "N", f"log one verify step in N (default: {DEFAULT_ECHO_LOG_EVERY})"),
        (
            "log_max_records",
            _positive_int,
            "N",
            f"stop logging after N steps (default: {DEFAULT_ECHO_LOG_MAX_RECORDS})",
        ),
    )
    _add_options(echo, ECHO_FLAGS, echo_options)


def _add_options(group, flags: dict[str, str], options) -> None:
    """Add ``(field, type, metavar, help)`` rows as flags defaulting to None (only typed flags override)."""
    for field, kind, metavar, text in options:
        group.add_argument(flags[field], type=kind, default=None, metavar=metavar, help=text)


def flag_for_field(field: str) -> str:
    """The command-line flag that sets a config field (for error messages)."""
    if field == "policy":
        return FLAG_PREFIX
    if field == "log_interval":
        return LOG_INTERVAL_FLAG
    if field in TRACE_FLAGS:
        return TRACE_FLAGS[field]
    if field.startswith("echo."):
        return ECHO_FLAGS[field[len("echo.") :]]
    return f"{FLAG_PREFIX}-{field.replace('_', '-')}"


def settings_from_args(args: argparse.Namespace, base: PluginSettings | None) -> PluginSettings | None:
    """Merge environment settings, ``--moe-pruner-config`` and explicit flags, in rising priority.

    Returns None when nothing asked for the pruner (no flag, no config, no environment).

    Raises
    ------
    ValueError
        With the flag to blame at the start of the message.
    """
    explicit = {spec.field: getattr(args, spec.dest, None) for spec in FIELD_FLAGS}
    explicit = {k: v for k, v in explicit.items() if v is not None}
    policy = getattr(args, "moe_pruner", None)
    config_text = getattr(args, "moe_pruner_config", None)
    log_interval = getattr(args, "moe_pruner_log_interval", None)
    verify_policy = getattr(args, "moe_pruner_verify", None)
    trace = {field: getattr(args, f"moe_pruner_{field}", None) for field in TRACE_FLAGS}
    trace = {k: v for k, v in trace.items() if v is not None}
    echo = {field: getattr(args, f"xshare_echo_{field}", None) for field in ECHO_FLAGS}
    echo = {k: v for k, v in echo.items() if v is not None}
    nothing = (
        policy is None and config_text is None and not explicit and log_interval is None and not trace and not echo
    )
    if base is None and nothing and verify_policy is None:
        return None
    merged: dict[str, Any] = base.to_dict() if base is not None else {}
    if config_text is not None:
        try:
            merged.update(PluginSettings.load(config_text).to_dict())
        except ValueError as exc:
            raise ValueError(f"{CONFIG_FLAG}: {exc}") from None
    merged.update(explicit)
    if policy is not None:
        merged["policy"] = policy
    if log_interval is not None:
        merged["log_interval"] = log_interval
    merged.update(trace)
    if echo:
        merged["echo"] = {**merged.get("echo", {}), **echo}
    if verify_policy is not None:
        merged["verify"] = {**merged.get("verify", {}), "policy": verify_policy}
    try:
        return PluginSettings.from_dict(merged)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("echo."):
            field = message[len("echo.") :].split("=", 1)[0]
            if field in ECHO_FLAGS:
                raise ValueError(f"{ECHO_FLAGS[field]}: {message[len('echo.') :]}") from None
            raise ValueError(f"{CONFIG_FLAG}: {message}") from None
        if verify_policy is not None and message.startswith(("verify phase: ", "verify: ")):
            raise ValueError(f"{VERIFY_FLAG}: {message}") from None
        if message.startswith(tuple(f"{phase}{sep}" for phase in PHASES for sep in (" phase: ", ": "))):
            raise ValueError(f"{CONFIG_FLAG}: {message}") from None
        for field in ("policy", *PrunerConfig.field_names(), "log_interval", *TRACE_FLAGS):
            if f"PrunerConfig.{field}=" in message or message.startswith(f"{field}="):
                raise ValueError(f"{flag_for_field(field)}: {message}") from None
        raise ValueError(f"{FLAG_PREFIX}: {message}") from None
