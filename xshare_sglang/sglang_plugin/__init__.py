"""SGLang plugin: ``python -m sglang.launch_server ... --moe-pruner xshare``.

SGLang calls :func:`register` (entry point group ``sglang.srt.plugins``) in every process it starts.
It registers the command-line hooks everywhere; where the pruner is on (the config arrives in the
``XSHARE_MOE_PRUNER_CONFIG`` environment variable, which the flags set before SGLang spawns its
schedulers), it also registers the routing hooks, applies them at once and checks they are in place:
SGLang logs and swallows plugin errors, so a pruner that was asked for and cannot run stops the
process (``SystemExit``) instead of serving unpruned.
"""

from __future__ import annotations

import logging
import os

from .settings import ADAPTIVE_ENV_VAR, ENV_VAR, PluginSettings, settings_from_env

logger = logging.getLogger(__name__)

#: Processes that never run the model: routing hooks there would only import MoE code for nothing.
AUXILIARY_PROCESS_TITLES = ("sglang::detokenizer", "sglang::data_parallel_controller", "sglang::tokenizer_worker")

_registered = False


def _auxiliary_process() -> bool:
    try:
        import setproctitle
    except ImportError:
        return False
    return setproctitle.getproctitle().startswith(AUXILIARY_PROCESS_TITLES)


def register() -> None:
    """SGLang plugin entry point: cheap, idempotent, imports SGLang's modules only when needed."""
    global _registered
    if _registered:
        return
    _registered = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks, liveness

    for module in hooks.CLI_HOOKS:
        HookRegistry.register(module.TARGET, module.hook, HookType(module.KIND))
    try:
        settings = settings_from_env()
    except ValueError as exc:
        logger.error("moe-pruner: %s", exc)
        raise SystemExit(2) from None
    if settings is None or not settings.active or _auxiliary_process():
        return
    wanted = ()
    if settings.enabled or settings.trace_dir is not None:
        wanted += hooks.ROUTING_HOOKS
        if os.environ.get(ADAPTIVE_ENV_VAR) == "1":
            wanted += hooks.ADAPTIVE_HOOKS
    if settings.echo_active:
        wanted += hooks.ECHO_HOOKS
    for module in wanted:
        HookRegistry.register(module.TARGET, module.hook, HookType(module.KIND))
    # Applied now rather than by SGLang right after the plugins ran, so that a hook that did not
    # apply is seen here, where failing is still possible.
    HookRegistry.apply_hooks()
    missing = liveness.unhooked(wanted)
    if missing:
        logger.error("moe-pruner: could not hook %s; refusing to run unpruned", ", ".join(missing))
        raise SystemExit(2)
    logger.info("moe-pruner: routing hooks in place (%s)", settings.summary())
    cost = settings.selection_cost_warning()
    if cost is not None:
        logger.warning("moe-pruner: %s", cost)


__all__ = ["ENV_VAR", "PluginSettings", "register", "settings_from_env"]
