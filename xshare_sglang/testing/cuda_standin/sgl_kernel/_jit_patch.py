"""Replace SGLang's JIT-compiled CUDA ops by the stand-in's torch ops, as their modules are imported.

SGLang 0.5.23 compiles many of its CUDA ops on first use (``sglang/kernels/ops/...``, through
``tvm_ffi`` and ``nvcc`` over ``.cuh`` sources that the device bundle does not carry).  The modules
themselves are plain Python and import fine; their callers bind the op functions by name at import
time (``from sglang.kernels.ops.attention.rope import apply_rope_with_cos_sin_cache_inplace``), so
the functions must be swapped *before* any caller imports them.  :func:`install` has the shared
post-import hook (``xshare_sglang/testing/post_import.py``) set the listed attributes of each module of
:data:`JIT_REPLACEMENTS` to the stand-in's functions right after the module executes.
``sitecustomize.py`` beside the ``sgl_kernel`` stand-in calls it in every Python process started with
that folder on ``PYTHONPATH`` (the launcher, the scheduler and detokenizer subprocesses).

Probes that ask whether a JIT op can be built are answered ``False`` where SGLang then falls back to
a path the stand-in serves (the fused in-place q/k norm, the Hugging Face-style RMS norm kernel).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path

from . import _ops

logger = logging.getLogger(__name__)

#: The name of this patcher's finder on ``sys.meta_path`` (installed once).
FINDER_NAME = "xshare-cuda-jit-ops"


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


def install() -> None:
    """Patch the modules of :data:`JIT_REPLACEMENTS` right after each executes
    (``xshare_sglang/testing/post_import.py``, loaded by path), and those already imported now."""
    path = Path(__file__).resolve().parents[2] / "post_import.py"
    spec = importlib.util.spec_from_file_location("xshare_post_import", path)
    post_import = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(post_import)
    post_import.install(FINDER_NAME, dict.fromkeys(JIT_REPLACEMENTS, patch_module))
