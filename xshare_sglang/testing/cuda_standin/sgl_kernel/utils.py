"""``sgl_kernel.utils`` of the CUDA stand-in: the one helper SGLang 0.5.23 calls from it on this path.

``is_arch_support_pdl`` is imported by ``sglang/srt/layers/attention/triton_backend.py:71`` and called
when the triton attention backend is built (``triton_backend.py:340``) to decide whether its Triton
kernels are launched with programmatic dependent launch.
"""

from __future__ import annotations

import torch


def is_arch_support_pdl() -> bool:
    """Whether the current CUDA device supports programmatic dependent launch (compute capability 9.0
    or newer); ``False`` on ROCm, MUSA, without a device, or when the capability cannot be read."""
    if getattr(torch.version, "hip", None) or getattr(torch.version, "musa", None):
        return False
    try:
        major, _minor = torch.cuda.get_device_capability(torch.cuda.current_device())
    except Exception:
        return False
    return major >= 9
