"""A CPU stand-in for SGLang's ``sgl_kernel`` package: a test and development utility only.

The ``sgl_kernel`` wheels on the registry hold CUDA binaries, so on a machine without a GPU
``import sgl_kernel`` fails and ``python -m sglang.launch_server --device cpu`` cannot start.  Put the
folder *above* this package first on ``PYTHONPATH`` (``xshare_sglang.testing.cpu_server`` does) and
SGLang imports this module instead.  It defines only the names SGLang 0.5.23 imports unconditionally
on its CPU engine path:

* ``scalar_types`` comes from the installed wheel's own pure-Python ``scalar_type.py`` (SGLang's
  quantization code inspects those objects at import time, so an imitation would break start-up);
* the CPU ops SGLang imports by name (KV-cache slot bookkeeping and copies, EAGLE draft-tree
  building and greedy verification) are torch implementations in ``_ops.py``, each tested against
  SGLang's own Triton kernel run under Triton's interpreter.  Serving without speculative decoding
  calls none of them except ``assign_req_to_token_pool_cpu``; EAGLE on CPU needs more than these ops
  (see ``docs/cpu-server.md``).

Names SGLang imports inside ``try/except ImportError`` (``rmsnorm``, the ``allreduce`` submodule, ...)
are deliberately absent, so SGLang takes its own fallbacks.  Never install this in production.
"""

from __future__ import annotations

from pathlib import Path

from ._ops import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)
from ._ops import shared as _shared

__version__ = "0.0.0+xshare-cpu-standin"

STANDIN = True  # lets a caller tell this package from the real one


def _load_wheel_scalar_type():
    """Import ``sgl_kernel/scalar_type.py`` of the installed wheel (pure Python) as a submodule."""
    path = _shared.wheel_scalar_type_file(Path(__file__).resolve().parent)
    if path is None:
        raise ImportError(
            "the sgl_kernel stand-in needs the installed sglang-kernel wheel for scalar_type.py "
            "(pip install sglang installs it)"
        )
    return _shared.load_scalar_type(__name__, path)


scalar_type = _load_wheel_scalar_type()
ScalarType = scalar_type.ScalarType
scalar_types = scalar_type.scalar_types

__all__ = [
    "STANDIN",
    "ScalarType",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "scalar_types",
    "verify_tree_greedy_cpu",
]
