"""Run at start-up by every Python process with the CUDA stand-in folder on ``PYTHONPATH``.

Installs the replacement of SGLang's JIT-compiled ops by the ``sgl_kernel`` stand-in's torch ops
(``sgl_kernel/_jit_patch.py``) and the empty stand-ins of unused modules (``_module_standins.py``).
A failure is logged, never raised: a broken stand-in must not stop unrelated Python programs started
from the same environment.
"""

from __future__ import annotations

import logging

try:
    import _module_standins
    from sgl_kernel import _jit_patch

    _module_standins.install()
    _jit_patch.install()
except Exception:  # pragma: no cover - reported, never fatal
    logging.getLogger(__name__).exception("xshare CUDA stand-in: not installed")
