"""What the plugin was asked to do: a ``PrunerConfig`` plus the plugin's own serving settings.

One environment variable, :data:`ENV_VAR`, carries the JSON of :class:`PluginSettings` to every
SGLang process.  The server flags write it; ``Engine(...)`` users and benchmark harnesses set it
themselves before the engine starts::

    XSHARE_MOE_PRUNER_CONFIG='{"policy": "xshare", "k0": 2, "budget": 12, "log_interval": 200}'

The JSON object holds the ``PrunerConfig`` fields and the plugin settings (:data:`PLUGIN_FIELDS`)
side by side; unknown keys are an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import PrunerConfig

ENV_VAR = "XSHARE_MOE_PRUNER_CONFIG"
DEFAULT_LOG_INTERVAL = 200
PLUGIN_FIELDS = ("log_interval",)


@dataclass(frozen=True)
class PluginSettings:
    """The pruner config and how the plugin reports on it.

    Attributes
    ----------
    pruner : PrunerConfig
    log_interval : int
        Read the per-layer metrics from the device every this many target forwards in a pruned
        phase, log one line and update the Prometheus gauges; 0 turns both off.
    """

    pruner: PrunerConfig = field(default_factory=PrunerConfig)
    log_interval: int = DEFAULT_LOG_INTERVAL

    def __post_init__(self) -> None:
        if isinstance(self.log_interval, bool) or not isinstance(self.log_interval, int) or self.log_interval < 0:
            raise ValueError(f"log_interval={self.log_interval!r} is invalid: must be an integer >= 0")

    @property
    def enabled(self) -> bool:
        return self.pruner.policy != "none"

    def to_dict(self) -> dict[str, Any]:
        return {**self.pruner.to_dict(), "log_interval": self.log_interval}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PluginSettings:
        plugin = {k: data[k] for k in PLUGIN_FIELDS if k in data}
        pruner = {k: v for k, v in data.items() if k not in PLUGIN_FIELDS}
        return cls(pruner=PrunerConfig.from_dict(pruner), **plugin)

    @classmethod
    def load(cls, spec: str) -> PluginSettings:
        """From JSON text or the path of a JSON file."""
        text = spec
        if not spec.lstrip().startswith("{"):
            if not os.path.isfile(spec):
                raise ValueError(f"{spec!r} is neither a JSON object nor an existing JSON file")
            with open(spec) as handle:
                text = handle.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("the JSON must be an object of PrunerConfig fields")
        return cls.from_dict(data)


def settings_from_env(environ: Mapping[str, str] | None = None) -> PluginSettings | None:
    """The settings in :data:`ENV_VAR`, or None when it is unset or empty.

    Raises
    ------
    ValueError
        When the variable holds something invalid; the message names the variable.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        return PluginSettings.load(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_VAR}: {exc}") from None
