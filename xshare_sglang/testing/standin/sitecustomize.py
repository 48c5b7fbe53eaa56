"""Run at start-up by every Python process with the CPU stand-in folder on ``PYTHONPATH``.

Installs the stand-in's one wrapper of SGLang code, :mod:`_ep_slots` (expert parallelism on the CPU
engine): a process that never imports SGLang pays only for a finder on ``sys.meta_path``.  A failure
is logged, never raised: a broken stand-in must not stop unrelated Python programs started from the
same environment.
"""

from __future__ import annotations

import logging

try:
    import _ep_slots

    _ep_slots.install()
except Exception:  # pragma: no cover - reported, never fatal
    logging.getLogger(__name__).exception("xshare CPU stand-in: the expert-parallel wrapper is not installed")
