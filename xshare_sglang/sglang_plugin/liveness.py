"""Proof that the hooks are in place: walk each target's wrapper chain looking for our hook.

SGLang logs and swallows failures to apply a hook, and a hook that is not in place means the server
silently serves unpruned (or never prunes inside CUDA graphs).  ``HookRegistry`` wraps a target in
closures that hold the hook function; a target counts as hooked when our function is found in the
closure of one of the wrappers reachable through ``__wrapped__``.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Iterable
from types import ModuleType


def _current(target: str):
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if isinstance(raw, (classmethod, staticmethod)):
        raw = raw.__func__
    return raw


def is_hooked(target: str, hook) -> bool:
    """Whether ``hook`` is wrapped around / after / before ``target`` right now."""
    try:
        func = _current(target)
    except (ImportError, AttributeError, ValueError):
        return False
    seen = set()
    while func is not None and id(func) not in seen:
        seen.add(id(func))
        for cell in getattr(func, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        func = getattr(func, "__wrapped__", None)
    return False


def unhooked(modules: Iterable[ModuleType]) -> list[str]:
    """Targets of the given hook modules whose hook is not in place."""
    return [module.TARGET for module in modules if not is_hooked(module.TARGET, module.hook)]
