"""Empty stand-ins for modules SGLang's server path imports but a Qwen3-MoE test server never uses.

The lent GPU machine lacks some packages that SGLang 0.5.23 imports unconditionally at module level
(``IPython`` in ``sglang/utils.py``, for one) yet never calls on the path of
``xshare_sglang.testing.gpu_server``.  Carrying their wheels would cost bundle space; instead
:class:`StandinFinder` answers ``import NAME`` (and any ``NAME.sub``) for the top-level names of
:data:`STANDIN_MODULES`, only where the real package cannot be found, with an empty package whose
attributes are placeholder classes: they can be imported, subclassed and named in annotations, and
raise ``NotImplementedError`` naming themselves when instantiated or called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import types

logger = logging.getLogger(__name__)

#: Top-level modules stood in for (when absent), each with the SGLang 0.5.23 import that needs it.
STANDIN_MODULES: dict[str, str] = {
    "IPython": "sglang/utils.py:25 (from IPython.display import HTML, display; notebook helpers)",
    "datasets": "sglang/benchmark/datasets/mmmu.py:8 (the benchmark client's MMMU set; random ids need none)",
    "gguf": "sglang/srt/layers/quantization/gguf.py:10 (GGUF checkpoints only)",
    "xgrammar": (
        "sglang/srt/function_call/inkling_detector.py:6 (structured output; served with --grammar-backend none)"
    ),
    "soundfile": "sglang/srt/entrypoints/openai/audio_chunking.py:24 (audio transcription)",
    "tvm_ffi": "sglang/kernels/ops/communication/all_reduce.py:7 (JIT kernels; the ops used are replaced)",
}

#: Packages whose missing *submodules* are stood in for (the package itself is real or a stand-in).
STANDIN_SUBMODULES_OF: dict[str, str] = {
    "sgl_kernel": "CUDA branches import op submodules at module level (e.g. sglang/srt/layers/quantization/"
    "gguf.py:49 from sgl_kernel.quantization import ...); the ops are never called on this server's path",
}


class _Placeholder(type):
    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(f"{cls.__module__}.{cls.__name__} is a stand-in of xshare_sglang.testing")

    def __getattr__(cls, name: str):
        # Class-level constants read at import time (``gguf.GGMLQuantizationType.Q4_0``): placeholders too.
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(cls.__module__, f"{cls.__name__}.{name}")
        setattr(cls, name, value)
        return value


def _any_schema(cls, source, handler):
    """Pydantic models that name a placeholder in a field accept any value there."""
    from pydantic_core import core_schema

    return core_schema.any_schema()


def _placeholder(module: str, name: str) -> type:
    return _Placeholder(name, (), {"__module__": module, "__get_pydantic_core_schema__": classmethod(_any_schema)})


class _StandinModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _StandinLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = _StandinModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        logger.debug("stand-in module %s", module.__name__)


class StandinFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: reached only when no real finder found the module."""

    def find_spec(self, fullname, path, target=None):
        top = fullname.split(".")[0]
        if top not in STANDIN_MODULES and not (top in STANDIN_SUBMODULES_OF and "." in fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, _StandinLoader(), is_package=True)


def install() -> None:
    """Append :class:`StandinFinder` to ``sys.meta_path`` (once)."""
    if not any(isinstance(f, StandinFinder) for f in sys.meta_path):
        sys.meta_path.append(StandinFinder())
