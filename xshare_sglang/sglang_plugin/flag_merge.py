"""What the pruner's flags, ``--moe-pruner-config`` and the environment ask for, merged once and
validated once into the frozen :class:`~.settings.PluginSettings`.

Why: a setting can come from three places, and an error must name the one that set the value at
fault.  How: :func:`typed_settings` merges the sources in rising priority (the environment
variable, then ``--moe-pruner-config``, then each explicit flag) into one :class:`TypedSettings`,
which remembers where each key came from; :meth:`TypedSettings.build` validates it and names the
flag, the config flag or the environment variable in the :class:`~xshare_sglang.errors.ConfigError`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import ConfigError
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
    flag_for_field,
)
from .settings import ENV_VAR, PluginSettings, read_json_object


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
