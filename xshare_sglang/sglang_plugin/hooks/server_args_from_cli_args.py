"""AFTER ``sglang.srt.server_args.ServerArgs.from_cli_args`` (checked: server_args.py:446, 0.5.23).

Why: ``from_cli_args`` copies only declared ``ServerArgs`` fields, so our flags would be dropped
silently; and spawned scheduler processes must learn the config.
How: read our flags from the argparse namespace, merge them over ``--moe-pruner-config`` and the
environment's JSON, validate the result once (also against the serving modes the pruner cannot
honour, see ``mode_checks``), and publish it in ``XSHARE_MOE_PRUNER_CONFIG`` (inherited by every
process SGLang spawns afterwards) and as the bookkeeping attribute ``ServerArgs._moe_pruner_config``
(survives pickling).  An invalid value, or ECHO flags with a speculative configuration ECHO cannot
serve, or a serving mode the pruner cannot make exact, ends the launch with exit code 2 and a
message naming the flags.
Remove when: SGLang lets plugins declare fields of their own on ``ServerArgs``.
"""

from __future__ import annotations

import argparse
import logging
import os

from ..flags import settings_from_args
from ..settings import ENV_VAR, environment_settings

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.server_args.ServerArgs.from_cli_args"
KIND = "after"
ATTRIBUTE = "_moe_pruner_config"


def _usage_error(message: str) -> None:
    """argparse-style failure: 'prog: error: message' on stderr, exit code 2."""
    argparse.ArgumentParser(prog="sglang serve", add_help=False).error(message)


def hook(result, cls, args, *rest, **kwargs):
    try:
        settings = settings_from_args(args, environment_settings())
    except ValueError as exc:  # ConfigError: the message starts with the flag at fault
        _usage_error(str(exc))
    if settings is None:
        return None
    from ..mode_checks import unsupported_mode_reason

    reason = unsupported_mode_reason(result, settings)
    if reason is not None:
        _usage_error(reason)
    if settings.echo_active:
        from ..echo_checks import echo_unsupported_reason

        reason = echo_unsupported_reason(result, settings.echo)
        if reason is not None:
            _usage_error(reason)
    text = settings.to_json()
    os.environ[ENV_VAR] = text
    setattr(result, ATTRIBUTE, text)
    logger.info("moe-pruner configured: %s", settings.summary())
    return None
