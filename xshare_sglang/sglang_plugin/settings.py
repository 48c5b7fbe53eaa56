"""What the plugin was asked to do: a ``PrunerConfig`` plus the plugin's own serving settings.

One environment variable, :data:`ENV_VAR`, carries the JSON of :class:`PluginSettings` to every
SGLang process.  The server flags write it; ``Engine(...)`` users and benchmark harnesses set it
themselves before the engine starts::

    XSHARE_MOE_PRUNER_CONFIG='{"policy": "xshare", "k0": 2, "budget": 12, "log_interval": 200}'

The JSON object holds the ``PrunerConfig`` fields and the plugin settings (:data:`PLUGIN_FIELDS`)
side by side; unknown keys are an error.  A key named after a phase (``decode``, ``verify``,
``extend``, ``mixed``) holds ``PrunerConfig`` fields that replace the top-level ones in that phase
only, e.g. ``xshare`` at decode and ``xshare-spec`` at speculative verify::

    {"policy": "xshare", "k0": 1, "budget": 8,
     "verify": {"policy": "xshare-spec", "request_budget": 2, "budget": 4}}

The key ``echo`` holds the ECHO draft-tree scheduler's settings (:class:`EchoSettings`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..break_even import DEFAULT_MARGIN
from ..config import DEFAULT_PHASES, PHASES, PrunerConfig
from ..errors import ConfigError
from ..spec.echo.settings import EchoSettings

ENV_VAR = "XSHARE_MOE_PRUNER_CONFIG"
#: Set to "1" by the launch (``server_args_from_cli_args``) for a server started with
#: ``--speculative-adaptive``: its processes then also hook SGLang's adaptive speculation.
ADAPTIVE_ENV_VAR = "XSHARE_SPECULATIVE_ADAPTIVE"
DEFAULT_LOG_INTERVAL = 200
#: Every pruned forward adds its layer calls' metrics (the kernels then pay for them on every call).
DEFAULT_METRICS_EVERY = 1
DEFAULT_TRACE_EVERY = 16
DEFAULT_TRACE_MAX_MB = 512
GUARDS = ("off", "auto")
DEFAULT_GUARD_MARGIN = DEFAULT_MARGIN
DEFAULT_GUARD_SECONDS = 30.0
# What the greedy moe-spec rankings cost per layer call, as measured (H200, Qwen3-30B-A3B router,
# commit 67f1999, docs/bench_selection.md): the other policies add 0.2-15 µs.  b87aff9 cut coverage's
# per-pick work from T rows to about T * top_k / E; until a GPU times it the warning quotes 67f1999
GREEDY_COSTS = {
    "coverage": "24 µs per MoE layer call at 1 token, 210 at 32 and 2957 at 512 (it grows with the batch)",
    "coactivation": "17-23 µs per MoE layer call at 1-512 tokens",
}
PLUGIN_FIELDS = (
    "log_interval",
    "metrics_every",
    "trace_dir",
    "trace_every",
    "trace_max_mb",
    "guard",
    "guard_margin",
    "guard_seconds",
    "guard_trace",
    "test_fault_file",
    "test_guard_pruned",
)


@dataclass(frozen=True)
class PluginSettings:
    """The pruner config and how the plugin reports on it.

    Attributes
    ----------
    pruner : PrunerConfig
    log_interval : int
        Read the per-layer metrics from the device every this many target forwards in a pruned
        phase, log one line and update the Prometheus gauges; 0 turns both off, and the layer calls then
        add no metrics at all (the kernels compile without them).
    metrics_every : int
        Add the metrics of one pruned forward in this many (>= 1): the others' layer calls skip the
        metrics' work on the device (the scores some rules compute only for the retained mass, the
        activated-expert count), and the means the report gives are over the sampled forwards.  1
        (default): every forward.
    trace_dir : str or None
        Record router logits of sampled decode / verify forwards into this folder as
        ``xshare-trace`` files (see ``xshare_sglang.replay.trace``); None records nothing.
    trace_every : int
        Record one eligible forward in this many (>= 1).
    trace_max_mb : int
        Stop recording once the folder's trace files reach this many MiB (>= 1).
    guard : {"off", "auto"}
        ``auto``: at start-up, time the model's MoE layers unpruned and pruned for every real-token
        bucket the server runs, and prune only the buckets where pruning is faster by
        ``guard_margin`` (:mod:`xshare_sglang.break_even`).  ``off`` (default): prune every call the
        config covers.
    guard_margin : float
        In [0, 1): the share of the unpruned time pruning must save in a bucket to stay on.
    guard_seconds : float
        The most start-up time the guard may spend (> 0); buckets it could not time enough stay off.
    guard_trace : str or None
        An ``xshare-trace`` file or folder whose recorded router logits the guard times with; None:
        the calibration file's counts when the config names one, else the model's own routers on
        hidden states drawn from its embeddings.
    echo : EchoSettings
        ECHO scheduling of EAGLE draft trees and its calibration log (off by default).
    test_fault_file : str or None
        For tests only: while a file exists at this path, every expert selection raises, so that a
        live server's fallback to unpruned routing can be shown.  None (the default) checks nothing.
    test_guard_pruned : tuple of (phase, tokens) or None
        For tests only, with ``guard='auto'``: the guard still times every bucket, but then prunes
        exactly these buckets and no other, so that a live server shows both kinds of bucket.
    """

    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    log_interval: int = DEFAULT_LOG_INTERVAL
    metrics_every: int = DEFAULT_METRICS_EVERY
    trace_dir: str | None = None
    trace_every: int = DEFAULT_TRACE_EVERY
    trace_max_mb: int = DEFAULT_TRACE_MAX_MB
    guard: str = "off"
    guard_margin: float = DEFAULT_GUARD_MARGIN
    guard_seconds: float = DEFAULT_GUARD_SECONDS
    guard_trace: str | None = None
    phase_overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    echo: EchoSettings = field(default_factory=EchoSettings)
    test_fault_file: str | None = None
    test_guard_pruned: tuple[tuple[str, int], ...] | None = None
    _phase_configs: dict[str, PrunerConfig] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.log_interval, bool) or not isinstance(self.log_interval, int) or self.log_interval < 0:
            raise ConfigError("log_interval", f"log_interval={self.log_interval!r} is invalid: must be an integer >= 0")
        for name in ("metrics_every", "trace_every", "trace_max_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"{name}={value!r} is invalid: must be an integer >= 1")
        if self.log_interval == 0 and self.metrics_every != DEFAULT_METRICS_EVERY:
            raise ConfigError(
                "metrics_every",
                f"metrics_every={self.metrics_every} has no effect with log_interval=0, which turns the metrics off",
            )
        self._check_guard()
        for name in ("trace_dir", "guard_trace", "test_fault_file"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"{name}={value!r} is invalid: must be a path")
        if self.trace_dir is None:
            for name, default in (("trace_every", DEFAULT_TRACE_EVERY), ("trace_max_mb", DEFAULT_TRACE_MAX_MB)):
                if getattr(self, name) != default:
                    raise ConfigError(
                        name, "trace_every=/trace_max_mb= have no effect without trace_dir: set trace_dir too"
                    )
        overrides = {}
        for phase, delta in dict(self.phase_overrides).items():
            if phase not in PHASES:
                raise ConfigError(phase, f"phase override {phase!r} is invalid: allowed phases are {', '.join(PHASES)}")
            if not isinstance(delta, Mapping):
                raise ConfigError(
                    phase, f"{phase}: must be an object of PrunerConfig fields, got {type(delta).__name__}"
                )
            if "phases" in delta:
                raise ConfigError(
                    f"{phase}.phases", f"{phase}.phases: set the pruned phases at the top level, not inside a phase"
                )
            if phase not in self.pruner.phases:
                raise ConfigError(
                    phase,
                    f"{phase}: an override was given for phase {phase!r}, which is not pruned "
                    f"(phases={','.join(self.pruner.phases)}); add it to phases",
                )
            overrides[phase] = dict(delta)
        object.__setattr__(self, "phase_overrides", overrides)
        configs = {}
        for phase in self.pruner.phases:
            if phase not in overrides:
                configs[phase] = self.pruner
                continue
            try:
                PrunerConfig.check_field_names(overrides[phase])
                configs[phase] = dataclasses.replace(self.pruner, **overrides[phase])
            except ConfigError as exc:
                raise exc.within(phase, f"{phase} phase") from None
        object.__setattr__(self, "_phase_configs", configs)
        if self.guard == "auto" and not self.enabled:
            raise ConfigError("guard", "guard='auto' has nothing to time: no phase runs a policy other than none")

    def _check_guard(self) -> None:
        if self.guard not in GUARDS:
            raise ConfigError("guard", f"guard={self.guard!r} is invalid: choose one of {', '.join(GUARDS)}")
        for name, low, high in (("guard_margin", 0.0, 1.0), ("guard_seconds", 0.0, math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(name, f"{name}={value!r} is invalid: must be a finite number")
            if not (low <= value < high if name == "guard_margin" else value > low):
                allowed = "must lie in [0, 1)" if name == "guard_margin" else "must be > 0"
                raise ConfigError(name, f"{name}={value!r} is invalid: {allowed}")
            object.__setattr__(self, name, float(value))
        if self.test_guard_pruned is not None:
            pairs = self.test_guard_pruned
            ok = isinstance(pairs, (list, tuple)) and all(
                isinstance(p, (list, tuple)) and len(p) == 2 and p[0] in PHASES and type(p[1]) is int for p in pairs
            )
            if not ok or self.guard != "auto":
                raise ConfigError(
                    "test_guard_pruned",
                    f"test_guard_pruned={pairs!r} is invalid: a list of [phase, tokens] pairs, with guard='auto'",
                )
            object.__setattr__(self, "test_guard_pruned", tuple((phase, tokens) for phase, tokens in pairs))
        if self.guard == "off":
            defaults = (("guard_margin", DEFAULT_GUARD_MARGIN), ("guard_seconds", DEFAULT_GUARD_SECONDS))
            for name, default in (*defaults, ("guard_trace", None)):
                if getattr(self, name) != default:
                    raise ConfigError(name, f"{name}= has no effect with guard='off': set guard='auto' too")

    def config_for(self, phase: str | None) -> PrunerConfig | None:
        """The config that applies in ``phase``; None when that phase is not pruned."""
        cfg = self._phase_configs.get(phase) if phase is not None else None
        return cfg if cfg is not None and cfg.policy != "none" else None

    def phase_configs(self) -> dict[str, PrunerConfig]:
        """Every pruned phase and its config (policy ``none`` included)."""
        return dict(self._phase_configs)

    @property
    def enabled(self) -> bool:
        """Some phase runs a policy other than ``none``."""
        return any(cfg.policy != "none" for cfg in self._phase_configs.values())

    @property
    def active(self) -> bool:
        """The plugin has work in this server: pruning in some phase, trace recording, or ECHO."""
        return self.enabled or self.trace_dir is not None or self.echo_active

    @property
    def echo_active(self) -> bool:
        """ECHO schedules draft trees or logs their confidences."""
        return self.echo.scheduling or self.echo.logging

    def policy_names(self) -> str:
        """The policies some phase runs, sorted and comma-joined ("none" when no phase prunes).

        This is the ``policy=`` field of the plugin's proof-of-life log line, which the A/B tool checks.
        """
        return ",".join(sorted({cfg.policy for cfg in self._phase_configs.values()} - {"none"})) or "none"

    def selection_cost_warning(self) -> str | None:
        """A warning for logs when a config selects with one of the greedy rankings, whose per-call cost
        is far above the other policies' (and, for coverage, grows with the batch), while the start-up
        guard that would turn pruning off where it is slower is off; None otherwise."""
        if self.guard != "off":
            return None
        configs = [self.pruner, *self._phase_configs.values()]
        rankings = sorted({c.ranking for c in configs if c.policy == "moe-spec" and c.ranking in GREEDY_COSTS})
        if not rankings:
            return None
        costs = "; ".join(f"ranking={r} costs {GREEDY_COSTS[r]}" for r in rankings)
        return (
            f"{costs} on an H200, where the other policies add 0.2-15 µs (docs/bench_selection.md); pass "
            "--moe-pruner-guard auto to have the start-up guard turn pruning off where it is slower"
        )

    def summary(self) -> str:
        """The base config, then each phase whose config differs from it, for logs."""
        text = self.pruner.summary()
        for phase, cfg in self._phase_configs.items():
            if phase in self.phase_overrides:
                text += f" | {phase}: {cfg.summary()}"
        if self.guard != "off":
            text += f" | guard={self.guard} margin={self.guard_margin:g} seconds={self.guard_seconds:g}"
            if self.guard_trace is not None:
                text += f" trace={self.guard_trace}"
        if self.test_fault_file is not None:
            text += f" | test_fault_file={self.test_fault_file} (selection fails while it exists)"
        if self.test_guard_pruned is not None:
            text += f" | test_guard_pruned={list(self.test_guard_pruned)} (the guard's decisions are forced)"
        if self.echo_active:
            text += " | echo: " + ", ".join(f"{k}={v}" for k, v in self.echo.to_dict().items())
        return text

    def to_dict(self) -> dict[str, Any]:
        out = {**self.pruner.to_dict(), "log_interval": self.log_interval}
        if self.metrics_every != DEFAULT_METRICS_EVERY:
            out["metrics_every"] = self.metrics_every
        if self.trace_dir is not None:
            out.update(trace_dir=self.trace_dir, trace_every=self.trace_every, trace_max_mb=self.trace_max_mb)
        if self.guard != "off":
            out.update(guard=self.guard, guard_margin=self.guard_margin, guard_seconds=self.guard_seconds)
            if self.guard_trace is not None:
                out["guard_trace"] = self.guard_trace
        if self.test_fault_file is not None:
            out["test_fault_file"] = self.test_fault_file
        if self.test_guard_pruned is not None:
            out["test_guard_pruned"] = [list(pair) for pair in self.test_guard_pruned]
        out.update({phase: dict(delta) for phase, delta in self.phase_overrides.items()})
        if self.echo.to_dict():
            out["echo"] = self.echo.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PluginSettings:
        """Build from the JSON object described in this module's docstring; unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise ConfigError("", "the JSON must be an object of PrunerConfig fields")
        plugin = {k: data[k] for k in PLUGIN_FIELDS if k in data}
        overrides = {k: data[k] for k in PHASES if k in data}
        pruner = {k: v for k, v in data.items() if k not in PLUGIN_FIELDS and k not in PHASES and k != "echo"}
        try:
            echo = EchoSettings.from_dict(data.get("echo", {}))
        except ConfigError as exc:
            raise exc.within("echo", "echo") from None
        return cls(pruner=PrunerConfig.from_dict(pruner), phase_overrides=overrides, echo=echo, **plugin)

    @classmethod
    def load(cls, spec: str) -> PluginSettings:
        """From JSON text or the path of a JSON file."""
        return cls.from_dict(read_json_object(spec))


def phase_policies(data: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """The policy each pruned phase would run, and the key that sets it (``"policy"`` or
    ``"<phase>.policy"``), from a settings object that is not validated.

    The same resolution as :meth:`PluginSettings.phase_configs` for the policy alone, for settings
    read from afar (a server's launch command), whose files cannot be read here.
    """
    phases = data.get("phases", DEFAULT_PHASES)
    if isinstance(phases, str):
        phases = [phase.strip() for phase in phases.split(",")]
    out = {}
    for phase in PHASES:
        if not isinstance(phases, (list, tuple)) or phase not in phases:
            continue
        override = data.get(phase)
        if isinstance(override, Mapping) and "policy" in override:
            out[phase] = (str(override["policy"]), f"{phase}.policy")
        else:
            out[phase] = (str(data.get("policy", "none")), "policy")
    return out


def read_json_object(spec: str) -> dict[str, Any]:
    """The JSON object in ``spec``: JSON text (starts with ``{``) or the path of a JSON file.

    Raises
    ------
    ConfigError
        Blaming the whole input (setting ``""``) when it is neither, or not an object.
    """
    text = spec
    if not spec.lstrip().startswith("{"):
        if not os.path.isfile(spec):
            raise ConfigError("", f"{spec!r} is neither a JSON object nor an existing JSON file")
        with open(spec) as handle:
            text = handle.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("", "the JSON must be an object of PrunerConfig fields")
    return data


def settings_from_env(environ: Mapping[str, str] | None = None) -> PluginSettings | None:
    """The settings in :data:`ENV_VAR`, or None when it is unset or empty.

    The text is parsed and validated once per process: the plugin's registration, the model-runner
    hook and ECHO's runtime all read the same frozen object.

    Raises
    ------
    ConfigError
        When the variable holds something invalid; the message names the variable.
    """
    return _read_environment(_parse_settings, environ)


def environment_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The JSON object in :data:`ENV_VAR`, not yet validated (the launcher merges flags over it); None
    when the variable is unset or empty.

    Raises
    ------
    ConfigError
        The variable holds no JSON object; the message names the variable.
    """
    return _read_environment(read_json_object, environ)


def _read_environment(parse: Callable[[str], Any], environ: Mapping[str, str] | None) -> Any:
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        return parse(raw)
    except ConfigError as exc:
        raise exc.named(ENV_VAR) from None


@functools.lru_cache(maxsize=4)
def _parse_settings(text: str) -> PluginSettings:
    return PluginSettings.from_dict(read_json_object(text))
