"""One meaning per device: the single place where the package turns a device name into the device
it compares and keys by.

``torch.device("cuda")`` names "the current CUDA device" but compares unequal to a tensor's
``cuda:0``; keys built from ``str(device)`` split one device into two.  Every comparison, cache key
and workspace of the package goes through :func:`canonical_device` instead.
"""

from __future__ import annotations

import torch


def canonical_device(device: torch.device | str | int) -> torch.device:
    """The device ``device`` names, with an index wherever the device type has one.

    A CUDA device without an index is the current CUDA device (``"cuda"`` -> ``cuda:<current>``);
    an integer is a CUDA index, as in torch.  The CPU has no index (``"cpu:0"`` -> ``cpu``).

    Raises
    ------
    RuntimeError
        From torch, for a string that names no device.
    """
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.index is None:
        backend = getattr(torch, device.type, None)
        current = getattr(backend, "current_device", None)
        if current is not None:
            return torch.device(device.type, current())
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` name one device (``"cuda"`` and ``cuda:<current>`` do)."""
    return canonical_device(a) == canonical_device(b)


def stream_key(device: torch.device | str) -> int:
    """Identity of the stream that work for ``device`` is issued on now (0 on the CPU).

    Scratch memory keyed by it is never shared by two streams: calls issued on one stream run one
    after the other, calls on two streams may run at the same time.  Under CUDA-graph capture this
    is the capture stream; the captured graph keeps the scratch it was captured with.
    """
    device = canonical_device(device)
    if device.type != "cuda":
        return 0
    return torch.cuda.current_stream(device).cuda_stream
