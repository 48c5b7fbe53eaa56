"""The ``--moe-pruner*`` command-line flags: one per ``PrunerConfig`` field, plus the config file,
the log interval and the policy of speculative verify forwards.

Why this module: it is the name the hooks, the tools and the tests have always imported the flags
by.  How: it holds nothing of its own and re-exports the public names of the modules that define
them; code in the package imports from those modules directly:

* :mod:`.flag_table`: the flags' names, their value checks and :func:`flag_for_field`;
* :mod:`.flag_parser`: :func:`add_flags`, the flags with their help text on SGLang's parser (every
  flag defaults to ``None``, so that only the flags a user typed override the config and the
  environment);
* :mod:`.flag_merge`: :func:`typed_settings` / :class:`TypedSettings`, what was typed merged once
  and validated once into the frozen settings, an error naming the flag, the config flag or the
  environment variable at fault;
* :mod:`.flag_errors`: :func:`usage_error` and :class:`CheckedValue`, a refused value ending the
  launch as argparse would (exit code 2) with one line on stderr and no usage text;
* :mod:`.launch_command`: :func:`typed_settings_of_command`, the settings of a reported launch
  command.
"""

from __future__ import annotations

from .flag_errors import HELP_HINT, LAUNCH_PROG, CheckedValue, usage_error
from .flag_merge import TypedSettings, settings_from_args, typed_settings
from .flag_parser import add_flags
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
    FlagSpec,
    flag_for_field,
)
from .launch_command import launch_command_words, typed_settings_of_command

__all__ = [
    "CONFIG_FLAG",
    "ECHO_FLAGS",
    "FIELD_FLAGS",
    "FLAG_PREFIX",
    "GUARD_FLAGS",
    "HELP_HINT",
    "LAUNCH_PROG",
    "LOG_INTERVAL_FLAG",
    "METRICS_EVERY_FLAG",
    "TRACE_FLAGS",
    "VERIFY_FLAG",
    "CheckedValue",
    "FlagSpec",
    "TypedSettings",
    "add_flags",
    "flag_for_field",
    "launch_command_words",
    "settings_from_args",
    "typed_settings",
    "typed_settings_of_command",
    "usage_error",
]
