"""Bandwidth cost model of an MoE layer call in decode.

Decode-sized MoE calls are bound by reading expert weights from HBM: the floor of one call is
``activated experts x bytes per expert / HBM bandwidth``.  The model ignores
attention, the router, launch overheads and the selection itself, so its speed-up is an upper bound
for the MoE layers and says nothing about the rest of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    """A GPU's peak HBM bandwidth and where the figure comes from."""

    name: str
    hbm_bytes_per_second: float
    source: str


# Vendor peak figures; measured bandwidth is lower (typically 80-90% of peak for large copies).
H100 = Device("H100 SXM", 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3 (SXM5)")
H200 = Device("H200", 4.8e12, "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e")
DEVICES = (H100, H200)


def moe_read_seconds(activated_experts: float, expert_bytes: int, device: Device) -> float:
    """Modeled time of one MoE layer call: the bytes of its activated experts over HBM bandwidth."""
    if activated_experts < 0 or expert_bytes < 0:
        raise ValueError("activated_experts and expert_bytes must be >= 0")
    return activated_experts * expert_bytes / device.hbm_bytes_per_second


def modeled_speedup(baseline_bytes: float, pruned_bytes: float) -> float:
    """Baseline over pruned expert bytes read (the bandwidth model's speed-up of the MoE layers);
    1.0 when nothing is read either way."""
    if pruned_bytes <= 0:
        return 1.0 if baseline_bytes <= 0 else float("inf")
    return baseline_bytes / pruned_bytes


def qwen3_moe_expert_bytes(hidden_size: int, moe_intermediate_size: int, bytes_per_param: float = 2.0) -> int:
    """Bytes of one SwiGLU expert (gate, up and down projections) of a Qwen3-MoE-style model."""
    return int(3 * hidden_size * moe_intermediate_size * bytes_per_param)
