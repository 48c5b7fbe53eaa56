"""AFTER ``sglang.srt.server_args.ServerArgs.from_cli_args`` (checked: server_args.py:446, 0.5.23).

Why: ``from_cli_args`` copies only declared ``ServerArgs`` fields, so our flags would be dropped
silently; and spawned scheduler processes must learn the config.
How: read our flags from the argparse namespace, merge them over ``--moe-pruner-config`` and the
environment's JSON, validate the result once (also against the serving modes the pruner cannot
honour, see ``mode_checks``), and publish it in ``XSHARE_MOE_PRUNER_CONFIG`` (inherited by every
process SGLang spawns afterwards; with ``--speculative-adaptive`` also
``XSHARE_SPECULATIVE_ADAPTIVE=1``, so that those processes hook SGLang's adaptive speculation) and
as the bookkeeping attribute ``ServerArgs._moe_pruner_config`` (survives pickling).  An invalid
value, ECHO flags with a speculative configuration ECHO cannot serve, a serving mode the pruner
cannot make exact, or a setting the model's ``config.json`` contradicts (``k0`` above its top-k, a
calibration file of another shape; see ``model_shape``) ends the launch here, before any process is
spawned, with exit code 2 and one line naming the flag.
Remove when: SGLang lets plugins declare fields of their own on ``ServerArgs``.
"""

from __future__ import annotations

import logging
import os

from ..flag_errors import usage_error
from ..flag_merge import typed_settings
from ..settings import ADAPTIVE_ENV_VAR, ENV_VAR, environment_settings

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.server_args.ServerArgs.from_cli_args"
KIND = "after"
ATTRIBUTE = "_moe_pruner_config"


def hook(result, cls, args, *rest, **kwargs):
    try:
        typed = typed_settings(args, environment_settings())
        settings = None if typed is None else typed.build()
    except ValueError as exc:  # ConfigError: the message starts with the flag at fault
        usage_error(str(exc))
    if settings is None:
        return None
    from ..mode_checks import unsupported_mode_reason

    reason = unsupported_mode_reason(result, settings)
    if reason is not None:
        usage_error(reason)
    if settings.echo_active:
        from ..echo_checks import echo_unsupported_reason

        reason = echo_unsupported_reason(result, settings.echo)
        if reason is not None:
            usage_error(reason)
    from ..model_shape import launch_refusal

    reason = launch_refusal(result, settings, typed.blame)
    if reason is not None:
        usage_error(reason)
    text = settings.to_json()
    os.environ[ENV_VAR] = text
    if getattr(result, "speculative_adaptive", False):
        os.environ[ADAPTIVE_ENV_VAR] = "1"
    else:
        os.environ.pop(ADAPTIVE_ENV_VAR, None)
    setattr(result, ATTRIBUTE, text)
    logger.info("moe-pruner configured: %s", settings.summary())
    return None
