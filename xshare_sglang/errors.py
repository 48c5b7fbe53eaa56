"""``ConfigError``: a bad setting, and the setting it is about.

Every check of the pruner's settings (``PrunerConfig``, the calibration file, the plugin's serving
settings, ECHO's) raises this, a ``ValueError`` that carries the dotted name of the setting it
blames: ``"k0"``, ``"verify.max_experts"`` (inside the verify phase's override), ``"echo.budget"``.
Whoever read the settings from somewhere (command-line flags, a JSON config, an environment
variable) maps that name back to where the value came from, without reading the message.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A setting that cannot be accepted.

    Parameters
    ----------
    setting : str
        Dotted name of the setting at fault; ``""`` when the whole input is (text that is not JSON).
    message : str
        What is wrong, for a person.

    Attributes
    ----------
    setting : str
    detail : str
        The message as the innermost check wrote it, before :meth:`within` put context in front:
        what to print after the name of the one flag that set ``setting``.
    """

    def __init__(self, setting: str, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting
        self.detail = message if detail is None else detail

    def within(self, prefix: str, label: str | None = None) -> ConfigError:
        """The same error seen from the enclosing setting ``prefix``; ``label`` starts the message."""
        setting = f"{prefix}.{self.setting}" if self.setting else prefix
        return ConfigError(setting, f"{label}: {self}" if label else str(self), detail=self.detail)

    def named(self, source: str, *, exact: bool = False) -> ConfigError:
        """The same error blamed on ``source`` (a flag or variable) at the start of the message; with
        ``exact`` (``source`` set exactly this setting) the flag is followed by :attr:`detail` alone."""
        return ConfigError(self.setting, f"{source}: {self.detail if exact else self}", detail=self.detail)


def invalid(owner: str, setting: str, value: Any, allowed: str) -> ConfigError:
    """``owner.setting=value is invalid: allowed``, blaming ``setting``."""
    return ConfigError(setting, f"{owner}.{setting}={value!r} is invalid: {allowed}")
