"""Adding the pruner's flags, with their help text, to SGLang's argument parser.

Why: the flags must exist in ``python -m sglang.launch_server --help`` and parse there.  How: every
flag defaults to ``None`` on the parser, so that only the flags a user actually typed override
``--moe-pruner-config`` and the environment (:mod:`.flag_merge`); the help text shows the effective
defaults.  Each flag checks its value in :class:`~.flag_errors.CheckedValue`, so a bad value is
refused in one line.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..config import POLICIES, PrunerConfig
from ..spec.echo.settings import DEFAULT_LOG_EVERY as DEFAULT_ECHO_LOG_EVERY
from ..spec.echo.settings import DEFAULT_LOG_MAX_RECORDS as DEFAULT_ECHO_LOG_MAX_RECORDS
from .flag_errors import CheckedValue
from .flag_table import (
    CONFIG_FLAG,
    ECHO_FLAGS,
    FIELD_FLAGS,
    FLAG_PREFIX,
    GUARD_FLAGS,
    LOG_INTERVAL_FLAG,
    METRICS_EVERY_FLAG,
    TRACE_FLAGS,
    VERIFY_FLAG,
    non_negative_int,
    positive_int,
    positive_real,
    real_number,
)
from .settings import (
    DEFAULT_GUARD_MARGIN,
    DEFAULT_GUARD_SECONDS,
    DEFAULT_LOG_INTERVAL,
    DEFAULT_METRICS_EVERY,
    DEFAULT_TRACE_EVERY,
    DEFAULT_TRACE_MAX_MB,
    ENV_VAR,
    GUARDS,
)


def _choices_metavar(choices: Sequence[str]) -> str:
    """How argparse shows a flag's choices in the help text."""
    return "{" + ",".join(choices) + "}"


_DEFAULTS = PrunerConfig()


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
        action=CheckedValue,
        allowed=POLICIES,
        metavar=_choices_metavar(POLICIES),
        default=None,
        help="expert-pruning policy (default: none, the pruner is off)",
    )
    for spec in FIELD_FLAGS:
        metavar = spec.metavar or {real_number: "X", non_negative_int: "N", positive_int: "N"}.get(spec.type)
        if metavar is None and spec.choices is not None:
            metavar = _choices_metavar(spec.choices)
        group.add_argument(
            spec.flag,
            action=CheckedValue,
            convert=spec.type,
            allowed=spec.choices,
            default=None,
            metavar=metavar,
            help=f"{spec.help} (default: {_default_text(spec.field)})",
        )
    group.add_argument(
        VERIFY_FLAG,
        action=CheckedValue,
        allowed=POLICIES,
        metavar=_choices_metavar(POLICIES),
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
        action=CheckedValue,
        convert=non_negative_int,
        default=None,
        metavar="N",
        help=f"log and export pruning metrics every N pruned forwards, 0 = never (default: {DEFAULT_LOG_INTERVAL})",
    )
    group.add_argument(
        METRICS_EVERY_FLAG,
        action=CheckedValue,
        convert=positive_int,
        default=None,
        metavar="N",
        help="add the pruning metrics of one pruned forward in N; the others skip their cost in the selection "
        f"kernels, and the logged and exported means are over the sampled forwards (default: {DEFAULT_METRICS_EVERY}, "
        "every forward)",
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
        ("trace_every", positive_int, "N", f"record one eligible forward in N (default: {DEFAULT_TRACE_EVERY})"),
        (
            "trace_max_mb",
            positive_int,
            "MB",
            f"stop recording when the trace files reach MB MiB (default: {DEFAULT_TRACE_MAX_MB})",
        ),
    )
    _add_options(group, TRACE_FLAGS, trace_options)
    group.add_argument(
        GUARD_FLAGS["guard"],
        action=CheckedValue,
        allowed=GUARDS,
        metavar=_choices_metavar(GUARDS),
        default=None,
        help="auto: at start-up, time the MoE layers unpruned and pruned for every real-token bucket the server "
        "runs and prune only where pruning is faster by the margin; off: prune every call (default: off)",
    )
    guard_options = (
        (
            "guard_margin",
            real_number,
            "X",
            f"share of the unpruned time pruning must save in a bucket to stay on, in [0, 1) "
            f"(default: {DEFAULT_GUARD_MARGIN:g})",
        ),
        (
            "guard_seconds",
            positive_real,
            "S",
            f"most start-up seconds the guard may spend; buckets not timed enough stay unpruned "
            f"(default: {DEFAULT_GUARD_SECONDS:g})",
        ),
        (
            "guard_trace",
            str,
            "PATH",
            "xshare-trace file or folder (--moe-pruner-trace-dir) whose router logits the guard times with "
            "(default: the calibration file's counts if the config names one, else the model's routers on "
            "hidden states drawn from its embeddings)",
        ),
    )
    _add_options(group, GUARD_FLAGS, guard_options)
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
            positive_real,
            "X",
            "draft nodes per request per verify step, on average over the batch (default: "
            "--speculative-num-draft-tokens minus 1, the static tree's count)",
        ),
        ("default_width", positive_int, "N", "nodes per depth for requests that pass their gates (default: 1)"),
        (
            "max_width",
            positive_int,
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
        ("log_every", positive_int, "N", f"log one verify step in N (default: {DEFAULT_ECHO_LOG_EVERY})"),
        (
            "log_max_records",
            positive_int,
            "N",
            f"stop logging after N steps (default: {DEFAULT_ECHO_LOG_MAX_RECORDS})",
        ),
    )
    _add_options(echo, ECHO_FLAGS, echo_options)


def _add_options(group, flags: dict[str, str], options) -> None:
    """Add ``(field, type, metavar, help)`` rows as flags defaulting to None (only typed flags override)."""
    for field, kind, metavar, text in options:
        convert = None if kind is str else kind
        group.add_argument(flags[field], action=CheckedValue, convert=convert, default=None, metavar=metavar, help=text)
