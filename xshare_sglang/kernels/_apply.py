"""Triton kernel that writes masked router logits and correction bias (jit code only).

Launched from ``apply.py``; the reference is ``xshare_sglang.policies.apply.mask_router_inputs``.
"""

import triton
import triton.language as tl


@triton.jit
def apply_mask_kernel(
    logits_ptr,
    stride_t,
    stride_e,
    out_ptr,
    out_stride_t,
    out_stride_e,
    keep_ptr,
    bias_ptr,
    bias_out_ptr,
    num_tokens,
    num_experts,
    mask_value,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    keep = tl.load(keep_ptr + e, mask=e_ok, other=0) != 0
    rows = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    ok = (rows < num_tokens)[:, None] & e_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_t + e[None, :] * stride_e, mask=ok).to(tl.float32)
    y = tl.where(keep[None, :], x, mask_value)  # float32 holds every input value and the mask exactly
    out_ptrs = out_ptr + rows[:, None] * out_stride_t + e[None, :] * out_stride_e
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=ok)
    if HAS_BIAS:
        if pid == 0:
            bias = tl.load(bias_ptr + e, mask=e_ok).to(tl.float32)
            masked_bias = tl.where(keep, bias, mask_value)
            tl.store(bias_out_ptr + e, masked_bias.to(bias_out_ptr.dtype.element_ty), mask=e_ok)
