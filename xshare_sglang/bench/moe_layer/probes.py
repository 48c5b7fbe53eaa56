"""Device probes and the roofline they give: copy bandwidth (:func:`measure_bandwidth`), the bf16
matmul rate (:func:`measure_matmul_tflops`), and one layer call's roofline (:func:`roofline_us`)."""

from __future__ import annotations

import statistics
import time

import torch

from ..common import sync
from .shapes import Shape


def _seconds_per_run(device, run, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run()`` after 3 warm-up calls: CUDA events on a GPU,
    a wall clock elsewhere (a figure of the smoke run only)."""
    for _ in range(3):
        run()
    sync()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t0)
    return samples


def measure_bandwidth(device, nbytes: int, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of ``repeats``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    samples = _seconds_per_run(device, lambda: dst.copy_(src), repeats)
    moved = 2 * src.numel() * 2
    return statistics.median(moved / seconds / 1e9 for seconds in samples)


def measure_matmul_tflops(device, dtype, n: int, repeats: int = 20) -> float:
    """Dense ``[n, n] @ [n, n]`` matmul rate in TFLOP/s (``2·n³`` per product), median of ``repeats``:
    the compute peak this run's roofline uses (cuBLAS on a square bf16 GEMM; on CPU a figure of the
    smoke run only)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    samples = _seconds_per_run(device, lambda: torch.matmul(a, b, out=out), repeats)
    return statistics.median(2 * n**3 / seconds / 1e12 for seconds in samples)


def roofline_us(activated: float, slots: float, shape: Shape, bandwidth_gbps: float, peak_tflops: float) -> float:
    """``max(weight bytes / bandwidth, FLOPs / peak)`` in µs: the read of the activated experts' weights,
    or the slots' two GEMMs at the measured bf16 matmul rate, whichever takes longer.

    Parameters
    ----------
    activated : float
        Experts read (this rank's, mean over inputs).
    slots : float
        Routed (token, expert) slots computed (mean over inputs).
    shape : Shape
        Gives bytes per expert and FLOPs per slot.
    bandwidth_gbps, peak_tflops : float
        Measured in the same run (:func:`measure_bandwidth`, :func:`measure_matmul_tflops`).
    """
    memory_us = activated * shape.expert_bytes / (bandwidth_gbps * 1e3)
    compute_us = slots * shape.slot_flops / (peak_tflops * 1e6)
    return max(memory_us, compute_us)


def _bound(activated: float, slots: float, shape: Shape, bandwidth_gbps: float, peak_tflops: float) -> str:
    """Which term of :func:`roofline_us` is larger: ``memory`` or ``compute``."""
    memory_us = activated * shape.expert_bytes / (bandwidth_gbps * 1e3)
    return "memory" if memory_us >= slots * shape.slot_flops / (peak_tflops * 1e6) else "compute"
