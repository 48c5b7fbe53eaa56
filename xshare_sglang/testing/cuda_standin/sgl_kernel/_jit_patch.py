"""Replace SGLang's JIT-compiled CUDA ops by the stand-in's torch ops, as their modules are imported.

SGLang 0.5.23 compiles many of its CUDA ops on first use (``sglang/kernels/ops/...``, through
``tvm_ffi`` and ``nvcc`` over ``.cuh`` sources that the device bundle does not carry).  The modules
themselves are plain Python and import fine; their callers bind the op functions by name at import
time (``from sglang.kernels.ops.attention.rope import apply_rope_with_cos_sin_cache_inplace``), so
the functions must be swapped *before* any caller imports them.  :func:`install` puts a finder first
on ``sys.meta_path`` that, right after one of the modules of :data:`JIT_REPLACEMENTS` executes, sets
the listed attributes to the stand-in's functions.  ``sitecustomize.py`` beside the ``sgl_kernel``
stand-in calls it in every Python process started with that folder on ``PYTHONPATH`` (the launcher,
the scheduler and detokenizer subprocesses).

Probes that ask whether a JIT op can be built are answered ``False`` where SGLang then falls back to
a path the stand-in serves (the fused in-place q/k norm, the Hugging Face-style RMS norm kernel).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
from collections.abc import Callable

from . import _ops

logger = logging.getLogger(__name__)


def _never(*args, **kwargs) -> bool:
    """A capability probe answered "no": SGLang then takes its non-JIT path."""
    return False


#: module -> {attribute: replacement}; each entry is a JIT op (or its probe) on the Qwen3-MoE path.
JIT_REPLACEMENTS: dict[str, dict[str, Callable]] = {
    "sglang.kernels.ops.activation.activation": {
        "silu_and_mul": _ops.silu_and_mul,
        "gelu_and_mul": _ops.gelu_and_mul,
        "gelu_tanh_and_mul": _ops.gelu_tanh_and_mul,
    },
    "sglang.kernels.ops.attention.rope": {
        "apply_rope_with_cos_sin_cache_inplace": _ops.apply_rope_with_cos_sin_cache_inplace,
        "rotary_embedding": _ops.rotary_embedding,
    },
    "sglang.kernels.ops.moe.moe_topk_softmax": {"topk_softmax": _ops.topk_softmax},
    "sglang.kernels.ops.layernorm.norm": {
        "fused_add_rmsnorm": _ops.fused_add_rmsnorm,
        "can_use_fused_inplace_qknorm": _never,
    },
    "sglang.kernels.ops.layernorm.rmsnorm_hf": {"is_supported_rmsnorm_hf_hidden_size": _never},
    "sglang.kernels.ops.attention.fused_qknorm_rope": {"can_use_fused_qk_norm_rope": _never},
}


def patch_module(module) -> list[str]:
    """Set the replacements of :data:`JIT_REPLACEMENTS` on an executed ``module``.

    Returns
    -------
    list of str
        The attributes replaced (a name the module does not define is skipped and logged: the table
        then no longer matches this SGLang release).
    """
    done = []
    for name, replacement in JIT_REPLACEMENTS.get(module.__name__, {}).items():
        if not hasattr(module, name):
            logger.warning("CUDA stand-in: %s has no attribute %s to replace", module.__name__, name)
            continue
        setattr(module, name, replacement)
        done.append(name)
    return done


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        patch_module(module)


class JitPatchFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`JIT_REPLACEMENTS` through the rest of ``sys.meta_path`` and wraps
    their loaders so that the replacements follow each module's execution."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in JIT_REPLACEMENTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Put :class:`JitPatchFinder` first on ``sys.meta_path`` (once) and patch modules already imported."""
    if not any(isinstance(f, JitPatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, JitPatchFinder())
    for name in JIT_REPLACEMENTS:
        if name in sys.modules:
            patch_module(sys.modules[name])
