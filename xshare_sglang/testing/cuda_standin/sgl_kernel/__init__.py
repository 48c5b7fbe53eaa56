"""A CUDA stand-in for SGLang's ``sgl_kernel`` package: a test utility for a GPU machine without SGLang.

The real ``sgl_kernel`` wheel (about 1.2 GB of CUDA binaries) cannot travel to the lent GPU machine.
Put the folder *above* this package first on ``PYTHONPATH`` (``xshare_sglang.testing.gpu_server``
does) and SGLang 0.5.23 imports this module instead.  It holds:

* torch versions of the ops a bf16 Qwen3-MoE server calls on SGLang's CUDA path with
  ``--attention-backend triton --sampling-backend pytorch --moe-runner-backend triton`` (``_ops.py``
  lists each op with its SGLang call site), each tested on CPU against SGLang's own torch-native or
  Triton twin (``tests/test_cuda_standin.py``);
* the same ops in place of SGLang's JIT-compiled twins (``_jit_patch.py``, installed in every process
  by ``sitecustomize.py`` beside this package);
* ``scalar_types`` from the pure-Python ``scalar_type.py`` of the real wheel: the file named by
  ``XSHARE_SGL_KERNEL_SCALAR_TYPE`` (the device bundle carries it), else the first
  ``sgl_kernel/scalar_type.py`` on ``sys.path`` other than this package;
* every other name SGLang imports from ``sgl_kernel`` as an op that raises ``NotImplementedError``
  naming itself when called (module ``__getattr__``): SGLang's CUDA branches import dozens of ops at
  module level that this server never calls.

Never install this in production.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ._ops import (
    apply_rope_with_cos_sin_cache_inplace,
    fused_add_rmsnorm,
    gelu_and_mul,
    gelu_tanh_and_mul,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    moe_align_block_size,
    moe_sum_reduce,
    rmsnorm,
    rotary_embedding,
    silu_and_mul,
    topk_softmax,
    unavailable,
)
from ._ops import shared as _shared

logger = logging.getLogger(__name__)

__version__ = "0.0.0+xshare-cuda-standin"

STANDIN = "cuda"  # lets a caller tell this package from the real one (and from the CPU stand-in)

#: Environment variable naming the real wheel's ``scalar_type.py``.
SCALAR_TYPE_ENV = "XSHARE_SGL_KERNEL_SCALAR_TYPE"


def _scalar_type_file() -> Path:
    given = os.environ.get(SCALAR_TYPE_ENV)
    if given:
        return Path(given)
    found = _shared.wheel_scalar_type_file(Path(__file__).resolve().parent)
    if found is None:
        raise ImportError(
            f"the CUDA sgl_kernel stand-in needs the real wheel's scalar_type.py: set {SCALAR_TYPE_ENV} "
            "(the device bundle carries it) or install sglang-kernel"
        )
    return found


def _load_scalar_type():
    return _shared.load_scalar_type(__name__, _scalar_type_file())


scalar_type = _load_scalar_type()
ScalarType = scalar_type.ScalarType
scalar_types = scalar_type.scalar_types

#: Names answered by :func:`__getattr__` so far (the ops SGLang imported but this stand-in lacks).
STOOD_IN_AS_UNAVAILABLE: set[str] = set()


def __getattr__(name: str):
    if name.startswith("_") or (Path(__file__).parent / f"{name}.py").is_file():
        # dunders, and this package's own submodules (``from sgl_kernel import utils`` imports the file)
        raise AttributeError(name)
    STOOD_IN_AS_UNAVAILABLE.add(name)
    logger.debug("CUDA stand-in: sgl_kernel.%s is imported but not implemented", name)
    op = unavailable(name)
    globals()[name] = op
    return op


__all__ = [
    "STANDIN",
    "ScalarType",
    "apply_rope_with_cos_sin_cache_inplace",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "moe_align_block_size",
    "moe_sum_reduce",
    "rmsnorm",
    "rotary_embedding",
    "scalar_types",
    "silu_and_mul",
    "topk_softmax",
]
