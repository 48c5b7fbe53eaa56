"""Whether a layer's MoE backend can take a dropped slot (expert id ``-1``).

The pruner drops a slot when a token has fewer kept experts than top-k (and on CUDA-graph padding
rows).  Most of SGLang 0.5.23's CUDA MoE runners skip ``-1`` ids, so the dropped expert is never read:
Triton (``moe_align_block_size`` puts ``-1`` in a bucket of its own, whose blocks write zeros),
DeepGEMM, CUTLASS fp8, FlashInfer CUTLASS / TRT-LLM and Marlin; so do the standard and DeepEP
dispatchers.  Others index their expert tables with every id:

* SGLang's CPU expert loop (``moe_forward_native``) fails with "index -1 is out of bounds", which
  kills the scheduler and with it the whole server, and miscounts a row that holds one expert twice;
* the CPU AMX kernel (``fused_experts_cpu``) counts experts without a bounds check;
* aiter (ROCm): SGLang itself avoids ``-1`` there (illegal memory access);
* Ascend and XPU kernels: not known, SGLang never writes ``-1`` on NPU.

For those the rewrite gives each dropped slot a valid expert of weight 0 instead (``fill_dropped``):
no row holds an expert twice (FlashInfer's small-batch routing also races on duplicates), the output
is unchanged, and the batch reads at most ``top_k - |keep|`` extra experts.  An unknown backend
gets the fill: it is always correct, at worst slower than ``-1``.
"""

from __future__ import annotations

from typing import Any

import torch

#: Resolved runner backends (``FusedMoE.runner_backend``) whose kernels skip ``-1`` ids.
MINUS_ONE_RUNNERS = (
    "triton",
    "deep_gemm",
    "cutlass",
    "flashinfer_cutlass",
    "flashinfer_trtllm",
    "flashinfer_trtllm_routed",
    "experimental_sgl_trtllm",
    "marlin",
    "experimental_sgl_marlin",
)


def _runner_backend(experts: Any) -> str:
    """The layer's resolved MoE runner (``auto`` resolves per layer inside SGLang)."""
    backend = getattr(experts, "runner_backend", None)
    if backend is None:
        config = getattr(experts, "moe_runner_config", None)
        backend = getattr(config, "runner_backend", None)
    if backend is None:
        from sglang.srt.layers.moe.utils import get_moe_runner_backend

        backend = get_moe_runner_backend()
    return str(getattr(backend, "value", backend))


def dropped_slots_filled(experts: Any) -> tuple[bool, str]:
    """(fill, why) for one ``FusedMoE`` module: fill is True when ``-1`` must not reach its backend."""
    from sglang.srt.utils import is_cpu, is_hip, is_npu, is_xpu

    weights = getattr(experts, "w13_weight", None)
    if is_cpu() or (isinstance(weights, torch.Tensor) and weights.device.type == "cpu"):
        return True, "SGLang's CPU MoE paths index experts with every slot"
    if is_npu() or is_xpu():
        return True, "SGLang's NPU/XPU MoE kernels are not known to skip -1 slots"
    backend = _runner_backend(experts)
    if backend in MINUS_ONE_RUNNERS and not (is_hip() and backend != "triton"):
        return False, f"the {backend} MoE runner skips -1 slots"
    return True, f"the {backend} MoE runner is not known to skip -1 slots"
