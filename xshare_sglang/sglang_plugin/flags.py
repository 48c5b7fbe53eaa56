"""The ``--moe-pruner*`` command-line flags: one per ``PrunerConfig`` field, plus the config file,
the log interval and the policy of speculative verify forwards.

Every flag defaults to ``None`` on the parser, so that only the flags a user actually typed override
``--moe-pruner-config`` and the environment; the help text shows the effective defaults.  What was
typed is merged once (:func:`typed_settings`) and validated once into the frozen settings; an error
names the flag, the config flag or the environment variable that set the value at fault.

A refused value ends the launch as argparse would (exit code 2), but with one line on stderr and
none of the parser's usage text, which for SGLang's parser runs to hundreds of lines: the flags
check their values in :class:`CheckedValue` instead of argparse's ``type=`` / ``choices=``, and the
launch hook reports through :func:`usage_error`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from ..config import BUDGET_ALLOCATIONS, COVERAGES, PHASES, POLICIES, RANKINGS, SCOPES, SCORES, PrunerConfig
from ..errors import ConfigError
from ..spec.echo.settings import DEFAULT_LOG_EVERY as DEFAULT_ECHO_LOG_EVERY
from ..spec.echo.settings import DEFAULT_LOG_MAX_RECORDS as DEFAULT_ECHO_LOG_MAX_RECORDS
from .settings import (
    DEFAULT_GUARD_MARGIN,
    DEFAULT_GUARD_SECONDS,
    DEFAULT_LOG_INTERVAL,
    DEFAULT_METRICS_EVERY,
    DEFAULT_TRACE_EVERY,
    DEFAULT_TRACE_MAX_MB,
    ENV_VAR,
    GUARDS,
    PluginSettings,
    read_json_object,
)

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
#: The program name SGLang's launcher parses under, and where its flags are listed.
LAUNCH_PROG = "sglang serve"
HELP_HINT = "see python -m sglang.launch_server --help"


def usage_error(message: str, prog: str = LAUNCH_PROG) -> NoReturn:
    """End the launch for a bad setting: one line ``prog: error: message; see ... --help`` on stderr
    and exit code 2, as argparse's ``error`` but without the usage text.

    Parameters
    ----------
    message : str
        Names the flag, the value and what is allowed; line breaks in it are joined into one line.
    prog : str
        The program name the line starts with.

    Raises
    ------
    SystemExit
        Always, with code 2.
    """
    line = re.sub(r"\s*\n\s*", " ", message.strip())
    sys.stderr.write(f"{prog}: error: {line}; {HELP_HINT}\n")
    sys.stderr.flush()
    raise SystemExit(2)


class CheckedValue(argparse.Action):
    """Store a flag's value after the flag's own check, refusing a bad value in one line.

    Stands in for argparse's ``type=`` and ``choices=``, whose failures make the parser print its
    whole usage text before the error.  The message keeps argparse's wording
    (``argument --moe-pruner-k0: must be >= 0, got -1``).  A parser built with
    ``exit_on_error=False`` gets the :class:`argparse.ArgumentError` instead.

    Parameters
    ----------
    convert : callable, optional
        Turns the typed text into the value; raises ``argparse.ArgumentTypeError`` or ``ValueError``
        naming what is allowed.  None keeps the text.
    allowed : sequence of str, optional
        The values accepted, after ``convert``.
    """

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        convert: Callable[[str], Any] | None = None,
        allowed: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.convert = convert
        self.allowed = tuple(allowed) if allowed is not None else None

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        try:
            value = values if self.convert is None else self.convert(values)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            self._refuse(parser, str(exc))
        if self.allowed is not None and value not in self.allowed:
            choices = ", ".join(repr(choice) for choice in self.allowed)
            self._refuse(parser, f"invalid choice: {value!r} (choose from {choices})")
        setattr(namespace, self.dest, value)

    def _refuse(self, parser: argparse.ArgumentParser, reason: str) -> NoReturn:
        error = argparse.ArgumentError(self, reason)
        if not getattr(parser, "exit_on_error", True):
            raise error
        usage_error(str(error), getattr(parser, "prog", None) or LAUNCH_PROG)


def _choices_metavar(choices: Sequence[str]) -> str:
    """How argparse shows a flag's choices in the help text."""
    return "{" + ",".join(choices) + "}"


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
        action=CheckedValue,
        allowed=POLICIES,
        metavar=_choices_metavar(POLICIES),
        default=None,
        help="expert-pruning policy (default: none, the pruner is off)",
    )
    for spec in FIELD_FLAGS:
        metavar = spec.metavar or {_real: "X", _non_negative_int: "N", _positive_int: "N"}.get(spec.type)
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
        convert=_non_negative_int,
        default=None,
        metavar="N",
        help=f"log and export pruning metrics every N pruned forwards, 0 = never (default: {DEFAULT_LOG_INTERVAL})",
    )
    group.add_argument(
        METRICS_EVERY_FLAG,
        action=CheckedValue,
        convert=_positive_int,
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
        ("trace_every", _positive_int, "N", f"record one eligible forward in N (default: {DEFAULT_TRACE_EVERY})"),
        (
            "trace_max_mb",
            _positive_int,
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
            _real,
            "X",
            f"share of the unpruned time pruning must save in a bucket to stay on, in [0, 1) "
            f"(default: {DEFAULT_GUARD_MARGIN:g})",
        ),
        (
            "guard_seconds",
            _positive_real,
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
        convert = None if kind is str else kind
        group.add_argument(flags[field], action=CheckedValue, convert=convert, default=None, metavar=metavar, help=text)


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


@dataclasses.dataclass
class TypedSettings:
    """The plugin's settings as typed, before validation: one mapping, with where each key came from.

    Sources merge in rising priority (:func:`typed_settings`): the environment variable, then
    ``--moe-pruner-config``, then each explicit flag.  A source replaces the top-level keys it sets
    (a phase override or the ``echo`` object as a whole); a flag of a nested setting
    (``--moe-pruner-verify``, ``--xshare-echo-*``) replaces that one key inside it.

    Attributes
    ----------
    data : dict
        The merged JSON object that :meth:`PluginSettings.from_dict` reads.
    sources : dict of str to str
        Dotted key (``"k0"``, ``"verify.policy"``, ``"echo"``) -> the flag or variable that set it.
    """

    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def update(self, mapping: Mapping[str, Any], source: str) -> None:
        """Let ``source`` set every top-level key of ``mapping``, replacing what lower sources set there."""
        for key, value in mapping.items():
            self.data[key] = value
            self.sources = {k: v for k, v in self.sources.items() if k != key and not k.startswith(f"{key}.")}
            self.sources[key] = source

    def set(self, key: str, value: Any, source: str) -> None:
        """Let ``source`` set one key; ``"outer.inner"`` sets ``inner`` inside the object ``outer``."""
        outer, _, inner = key.partition(".")
        if not inner:
            self.update({key: value}, source)
            return
        nested = self.data.get(outer, {})
        if isinstance(nested, Mapping):  # else the bad object's own error is the one to report
            self.data[outer] = {**nested, inner: value}
        self.sources[key] = source

    def blame(self, setting: str) -> tuple[str, bool]:
        """Where ``setting`` came from: ``(flag or variable, whether it set exactly that setting)``.

        A setting nobody set inside an object someone did (a phase override) is blamed on that
        object's source; an object blamed as a whole, on the source of a key inside it; a setting
        nobody set at all (a default another choice conflicts with), on its own flag.
        """
        if setting in self.sources:
            return self.sources[setting], True
        parts = setting.split(".")
        for end in range(len(parts) - 1, 0, -1):
            outer = ".".join(parts[:end])
            if outer in self.sources:
                return self.sources[outer], False
        inside = [source for key, source in self.sources.items() if key.startswith(f"{setting}.")]
        if inside:
            return inside[0], False
        return (flag_for_field(setting) if setting else FLAG_PREFIX), True

    def build(self) -> PluginSettings:
        """Validate into :class:`PluginSettings`; a :class:`ConfigError` names the flag or variable at fault."""
        try:
            return PluginSettings.from_dict(self.data)
        except ConfigError as exc:
            source, exact = self.blame(exc.setting)
            raise exc.named(source, exact=exact) from None


def typed_settings(
    args: argparse.Namespace,
    environment: Mapping[str, Any] | None = None,
    *,
    read_config: Callable[[str], Mapping[str, Any]] = read_json_object,
) -> TypedSettings | None:
    """The settings ``args`` (and the environment's JSON object) ask for, merged; None when neither
    asks for anything.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed by a parser that :func:`add_flags` extended.
    environment : mapping, optional
        The JSON object of :data:`ENV_VAR`.
    read_config : callable
        Reads the value of ``--moe-pruner-config`` into a JSON object.

    Raises
    ------
    ConfigError
        ``--moe-pruner-config`` cannot be read; the message starts with the flag.
    """
    typed = TypedSettings()
    if environment:
        typed.update(environment, ENV_VAR)
    config_text = getattr(args, "moe_pruner_config", None)
    if config_text is not None:
        try:
            typed.update(read_config(config_text), CONFIG_FLAG)
        except ConfigError as exc:
            # a file the message does not name is named after the flag; typed JSON text is not repeated
            quiet = config_text.lstrip().startswith("{") or config_text in str(exc)
            raise exc.named(CONFIG_FLAG if quiet else f"{CONFIG_FLAG} {config_text}") from None
    flags = [(spec.field, spec.dest, spec.flag) for spec in FIELD_FLAGS]
    flags += [("policy", "moe_pruner", FLAG_PREFIX), ("log_interval", "moe_pruner_log_interval", LOG_INTERVAL_FLAG)]
    flags += [("metrics_every", "moe_pruner_metrics_every", METRICS_EVERY_FLAG)]
    flags += [(field, f"moe_pruner_{field}", flag) for field, flag in {**TRACE_FLAGS, **GUARD_FLAGS}.items()]
    flags += [(f"echo.{field}", f"xshare_echo_{field}", flag) for field, flag in ECHO_FLAGS.items()]
    flags += [("verify.policy", "moe_pruner_verify", VERIFY_FLAG)]
    for key, dest, flag in flags:
        value = getattr(args, dest, None)
        if value is not None:
            typed.set(key, value, flag)
    return typed if typed.sources else None


def settings_from_args(args: argparse.Namespace, environment: Mapping[str, Any] | None = None) -> PluginSettings | None:
    """The validated settings of the typed flags over ``--moe-pruner-config`` over the environment.

    Returns None when nothing asked for the pruner (no flag, no config, no environment).

    Raises
    ------
    ConfigError
        With the flag (or variable) to blame at the start of the message.
    """
    typed = typed_settings(args, environment)
    return None if typed is None else typed.build()


def launch_command_words(command: str) -> list[str]:
    """The arguments of a launch command as SGLang reports it (``/server_info``'s ``launch_command``).

    SGLang joins the arguments with single spaces and no quoting, so a JSON value typed for
    ``--moe-pruner-config`` appears with its spaces: a word (or a ``--flag=`` value) that starts a
    JSON object runs to the object's end.  Shell quotes around a word are removed.
    """
    decoder = json.JSONDecoder()
    words: list[str] = []
    pos = 0
    while (match := _WORD_START.search(command, pos)) is not None:
        start = match.start()
        flag = _FLAG_EQUALS.match(command, start)
        value_start = flag.end() if flag else start
        if command.startswith(("'", '"'), value_start):
            quote = command[value_start]
            close = command.find(quote, value_start + 1)
            if close > 0:
                words.append(command[start:value_start] + command[value_start + 1 : close])
                pos = close + 1
                continue
        if command.startswith("{", value_start):
            try:
                _, end = decoder.raw_decode(command, value_start)
            except ValueError:
                pass
            else:
                words.append(command[start:end])
                pos = end
                continue
        end = _WORD_END.search(command, start)
        pos = end.start() if end else len(command)
        words.append(command[start:pos])
    return words


_WORD_START = re.compile(r"\S")
_WORD_END = re.compile(r"\s")
_FLAG_EQUALS = re.compile(r"--[\w-]+=")


def typed_settings_of_command(command: str) -> TypedSettings | None:
    """What a launch command's own pruner flags ask for (:func:`typed_settings`), read as the server
    read them; None when they ask for nothing.  The environment of the server is not known here.

    Raises
    ------
    ConfigError
        The flags do not parse, or ``--moe-pruner-config`` names a file (on the server's machine) or
        holds text that is not a JSON object.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_flags(parser)
    try:
        args, _ = parser.parse_known_args(launch_command_words(command))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ConfigError("", f"the pruner's flags do not parse ({exc})") from None
    return typed_settings(args, read_config=_json_text_only)


def _json_text_only(text: str) -> dict[str, Any]:
    if not text.lstrip().startswith("{"):
        raise ConfigError("", f"{text} names a file on the server's machine, which is not read from here")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict):
        raise ConfigError("", "holds text that is not read as a JSON object")
    return data
