"""ECHO's serving settings: one frozen, validated object (the ``echo`` key of the plugin's JSON config,
or the ``--xshare-echo-*`` flags)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ...errors import ConfigError

DEFAULT_LOG_EVERY = 8
DEFAULT_LOG_MAX_RECORDS = 100_000


@dataclass(frozen=True)
class EchoSettings:
    """How the server schedules and logs EAGLE draft trees.

    Attributes
    ----------
    calibration : str or None
        ``echo-calibrate`` output; setting it turns the ECHO scheduler on.
    budget : float or None
        Draft nodes per request per verify step on average: the batch budget is
        ``floor(budget * requests)``.  None: ``D - 1`` (the static tree's own count).
    default_width : int
        Nodes per depth for requests that pass their gates (>= 1).
    max_width : int or None
        Nodes at the truncation depth for requests that fail one (>= 1); None: the draft top-k.
    log_dir : str or None
        Write sampled (confidence, accepted length) records for ``echo-calibrate`` here.
    log_every : int
        Log one verify step in this many (>= 1).
    log_max_records : int
        Stop logging after this many steps (>= 1).
    """

    calibration: str | None = None
    budget: float | None = None
    default_width: int = 1
    max_width: int | None = None
    log_dir: str | None = None
    log_every: int = DEFAULT_LOG_EVERY
    log_max_records: int = DEFAULT_LOG_MAX_RECORDS

    def __post_init__(self) -> None:
        for name in ("calibration", "log_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, f"{name}={value!r} is invalid: must be a path")
        if self.budget is not None and (
            isinstance(self.budget, bool)
            or not isinstance(self.budget, (int, float))
            or not math.isfinite(self.budget)
            or self.budget <= 0
        ):
            raise ConfigError(
                "budget", f"budget={self.budget!r} is invalid: must be a number > 0 (draft nodes per request)"
            )
        for name in ("default_width", "max_width", "log_every", "log_max_records"):
            value = getattr(self, name)
            if value is None and name == "max_width":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"{name}={value!r} is invalid: must be an integer >= 1")
        defaults = {"budget": None, "default_width": 1, "max_width": None}
        if self.calibration is None and (changed := _changed(self, defaults)):
            raise ConfigError(
                changed, "budget=/default_width=/max_width= have no effect without calibration: set calibration too"
            )
        defaults = {"log_every": DEFAULT_LOG_EVERY, "log_max_records": DEFAULT_LOG_MAX_RECORDS}
        if self.log_dir is None and (changed := _changed(self, defaults)):
            raise ConfigError(changed, "log_every=/log_max_records= have no effect without log_dir: set log_dir too")

    @property
    def scheduling(self) -> bool:
        return self.calibration is not None

    @property
    def logging(self) -> bool:
        return self.log_dir is not None

    def k_max(self, num_requests: int, num_draft_tokens: int) -> int:
        """The batch's budget of draft nodes."""
        per_request = num_draft_tokens - 1 if self.budget is None else min(self.budget, num_draft_tokens - 1)
        return math.floor(per_request * num_requests + 1e-9)

    def to_dict(self) -> dict[str, Any]:
        defaults = EchoSettings()
        return {k: v for k, v in asdict(self).items() if v != getattr(defaults, k)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EchoSettings:
        if not isinstance(data, Mapping):
            raise ConfigError("", f"must be an object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
        return cls(**data)


def _changed(settings: Any, defaults: Mapping[str, Any]) -> str | None:
    """The first of ``defaults``' names whose value in ``settings`` is not its default."""
    return next((name for name, value in defaults.items() if getattr(settings, name) != value), None)
