"""Patch a module right after it executes: the one import hook both test stand-ins use.

SGLang's callers bind some functions by name when their own module imports (``from ... import f``), so
a stand-in must replace ``f`` in its module before any caller imports it.  :func:`install` puts a
:class:`PostImportFinder` first on ``sys.meta_path``: it finds the named modules through the rest of
``sys.meta_path`` and wraps their loaders, so each module's patch runs right after the module's code.

Standard library only: the stand-ins load this file by its path (``spec_from_file_location``), from
the ``sitecustomize.py`` that runs in every Python process started with a stand-in folder on
``PYTHONPATH``, without importing this package (whose ``__init__`` imports torch).
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Mapping
from types import ModuleType


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], object]):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of ``patches`` through the rest of ``sys.meta_path`` and wraps their loaders.

    Parameters
    ----------
    name : str
        Who installs it (one finder per name on ``sys.meta_path``).
    patches : mapping of module name to callable
        Called with the module right after it executes.
    """

    def __init__(self, name: str, patches: Mapping[str, Callable[[ModuleType], object]]):
        self.name = name
        self.patches = dict(patches)

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install(name: str, patches: Mapping[str, Callable[[ModuleType], object]]) -> None:
    """Put a :class:`PostImportFinder` for ``patches`` first on ``sys.meta_path``, unless one named
    ``name`` is there already, and patch the listed modules already imported."""
    if not any(getattr(finder, "name", None) == name for finder in sys.meta_path):
        sys.meta_path.insert(0, PostImportFinder(name, patches))
    for module_name, patch in patches.items():
        if module_name in sys.modules:
            patch(sys.modules[module_name])
