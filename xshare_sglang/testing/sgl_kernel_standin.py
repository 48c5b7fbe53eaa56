"""What the two ``sgl_kernel`` stand-ins share: the op that raises, and the real wheel's ``scalar_type.py``.

``standin/sgl_kernel`` (the CPU engine's stand-in, :mod:`.cpu_server`) and ``cuda_standin/sgl_kernel``
(the lent GPU machine's, :mod:`.gpu_server`) both

* answer an ``sgl_kernel`` name they do not implement with an op that raises ``NotImplementedError``
  naming it when called (:func:`unavailable`; each stand-in words its own message);
* take ``scalar_types`` from the pure-Python ``scalar_type.py`` of the real wheel, found on
  ``sys.path`` beside the stand-in (:func:`wheel_scalar_type_file`) and executed as the stand-in's
  ``scalar_type`` submodule (:func:`load_scalar_type`).

Standard library only: each stand-in's ``_ops.py`` loads this file by its path (the folder above the
stand-in's own), as ``post_import.py`` is loaded, because a stand-in folder is put on ``PYTHONPATH`` or
copied (``scripts/docker/cpu-base.Dockerfile`` copies the CPU one, with this file beside it) where
``xshare_sglang`` need not be importable.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)


def unavailable(name: str, message: str, module: str) -> Callable[..., None]:
    """An op a stand-in does not implement: calling it raises.

    Parameters
    ----------
    name : str
        The op's name in ``sgl_kernel`` (the op's ``__name__``).
    message : str
        The ``NotImplementedError`` message, naming the op.
    module : str
        The op's ``__module__``: the stand-in module that hands it out.

    Returns
    -------
    callable
        Takes any arguments and raises ``NotImplementedError(message)``.
    """

    def op(*args, **kwargs):
        raise NotImplementedError(message)

    op.__name__ = op.__qualname__ = name
    op.__module__ = module
    return op


def wheel_scalar_type_file(package_dir: Path) -> Path | None:
    """The first ``sgl_kernel/scalar_type.py`` on ``sys.path`` outside ``package_dir`` (the stand-in's
    own folder), or None when there is none."""
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "sgl_kernel" / "scalar_type.py"
        if candidate.parent != package_dir and candidate.is_file():
            return candidate
    return None


def load_scalar_type(package: str, path: Path) -> ModuleType:
    """Execute ``path`` as the submodule ``<package>.scalar_type`` (registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(f"{package}.scalar_type", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
