"""Torch versions of the CUDA ops SGLang 0.5.23 calls for a bf16 Qwen3-MoE server on its CUDA path.

Every op here runs on any device (no custom kernel, no host synchronisation, so CUDA graphs can capture
it) and follows the calling convention of the op it replaces: the same positional arguments, results
written in place where the CUDA op writes them.  Call sites served, in SGLang 0.5.23 (paths under
``sglang/``) with ``--attention-backend triton --sampling-backend pytorch --moe-runner-backend triton``:

=================================  ===================================================================
op                                 call site
=================================  ===================================================================
``rmsnorm``                        ``srt/layers/layernorm.py:631`` (``RMSNorm.forward_cuda``, no residual;
                                   also the per-head q/k norm of ``srt/models/utils.py`` ``apply_qk_norm``)
``fused_add_rmsnorm``              ``srt/layers/layernorm.py:628`` (with residual); JIT twin
                                   ``kernels/ops/layernorm/norm.py`` ``fused_add_rmsnorm`` (layernorm.py:611)
``gemma_rmsnorm``,                 ``srt/layers/layernorm.py:1143-1147`` (imported at layernorm.py:102;
``gemma_fused_add_rmsnorm``        not called by Qwen3-MoE, kept because the import is unconditional)
``silu_and_mul``                   ``srt/layers/moe/moe_runner/triton_utils/fused_moe.py:797/810`` (JIT
                                   ``kernels/ops/activation/activation.py:228``, imported at fused_moe.py:61)
                                   and ``srt/layers/activation.py`` ``SiluAndMul.forward_cuda`` (the dense MLP)
``gelu_and_mul``,                  ``srt/layers/activation.py:60-62`` (AOT) and ``:64-70`` (JIT twins)
``gelu_tanh_and_mul``
``apply_rope_with_cos_sin_cache_`` ``srt/layers/rotary_embedding/base.py:468`` (``RotaryEmbedding.forward_cuda``
``inplace``                        for head sizes 64/128/256/512; JIT op of ``kernels/ops/attention/rope.py:213``)
``rotary_embedding``               ``srt/layers/rotary_embedding/base.py:134`` (the fallback kernel for other
                                   head sizes; JIT ``kernels/ops/attention/rope.py:108``)
``topk_softmax``                   ``srt/layers/moe/topk.py:233-236`` via ``kernels/ops/moe/__init__.py:171``
                                   (registry op ``moe.topk_softmax``, JIT backend
                                   ``kernels/ops/moe/moe_topk_softmax.py:64`` on CUDA).  Imported, but
                                   SGLang's CUDA ``fused_topk`` (``topk.py:1296``) routes softmax top-k
                                   through its own Triton ``moe_fused_gate`` instead, which runs as is
``moe_align_block_size``           ``srt/layers/moe/moe_runner/triton_utils/moe_align_block_size.py:195``
                                   via ``kernels/ops/moe/__init__.py:134`` (registry target
                                   ``sgl_kernel:moe_align_block_size``; batches of more than 64 slots, the
                                   smaller ones take SGLang's own Triton ``moe_align_small_numel``)
``moe_sum_reduce``                 ``srt/layers/moe/moe_runner/triton_utils/fused_moe.py:1020/1051`` (imported at :59;
                                   top-k > 2 with more tokens than the Triton reduce handles)
=================================  ===================================================================

Any other name SGLang imports from ``sgl_kernel`` resolves to :func:`unavailable`, which raises
``NotImplementedError`` naming the op when called.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _load_shared() -> ModuleType:
    """``xshare_sglang/testing/sgl_kernel_standin.py`` (what both stand-ins share), loaded by its path from
    the folder above this stand-in's: the stand-in runs where ``xshare_sglang`` need not be importable."""
    path = Path(__file__).resolve().parents[2] / "sgl_kernel_standin.py"
    spec = importlib.util.spec_from_file_location("xshare_sgl_kernel_standin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shared = _load_shared()


def unavailable(name: str) -> Callable[..., None]:
    """An op SGLang imports on its CUDA path that the stand-in does not implement: calling it raises.

    Parameters
    ----------
    name : str
        The op's name in ``sgl_kernel``; the error names it.
    """

    return shared.unavailable(
        name,
        f"sgl_kernel.{name} is not implemented by xshare_sglang.testing's CUDA stand-in "
        "(the feature that calls it cannot run in a GPU test server)",
        __name__,
    )


# --------------------------------------------------------------------------------------------- norms


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps)`` over the last axis, in float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    """``result``, copied into ``out`` (and ``out`` returned) when the caller gave one."""
    if out is None:
        return result
    return out.copy_(result)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """RMS norm: ``out = input / RMS(input) * weight``, computed in float32.

    Parameters
    ----------
    input : torch.Tensor
        ``[T, H]``.
    weight : torch.Tensor
        ``[H]``.
    eps : float
        Added to the mean square.
    out : torch.Tensor, optional
        ``[T, H]`` buffer to write; a new one otherwise.
    enable_pdl : bool, optional
        Ignored (a launch option of the CUDA kernel).

    Returns
    -------
    torch.Tensor
        ``[T, H]`` in ``input``'s dtype.
    """
    return _into(out, (_rms(input, eps) * weight.float()).to(input.dtype))


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
    *,
    cast_x_before_out_mul: bool = False,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * weight``.

    Parameters
    ----------
    input : torch.Tensor
        ``[T, H]``; overwritten with the normalised sum.
    residual : torch.Tensor
        ``[T, H]``; overwritten with the sum (rounded to its dtype before it is normalised, as SGLang's
        native path does).
    weight : torch.Tensor
        ``[H]``.
    eps : float
        Added to the mean square.
    enable_pdl : bool, optional
        Ignored.
    cast_x_before_out_mul : bool
        The JIT twin's Hugging Face variant: cast the normalised sum to the activation dtype before the
        weight multiply.
    """
    residual.copy_(input.float() + residual.float())
    normed = _rms(residual, eps)
    if cast_x_before_out_mul:
        input.copy_(weight * normed.to(input.dtype))
    else:
        input.copy_(normed * weight.float())


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Gemma's RMS norm: ``input / RMS(input) * (1 + weight)``; shapes as :func:`rmsnorm`."""
    return _into(out, (_rms(input, eps) * (1.0 + weight.float())).to(input.dtype))


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * (1 + weight)``."""
    residual.copy_(input.float() + residual.float())
    input.copy_(_rms(residual, eps) * (1.0 + weight.float()))


# ---------------------------------------------------------------------------------------- activation


def _act_and_mul(act: Callable[[torch.Tensor], torch.Tensor], name: str):
    def op(
        input: torch.Tensor,
        out: torch.Tensor | None = None,
        expert_ids: torch.Tensor | None = None,
        expert_step: int = 1,
        **kwargs,
    ) -> torch.Tensor:
        if expert_ids is not None or any(v is not None for v in kwargs.values()):
            raise NotImplementedError(f"the CUDA stand-in's {name} has no expert-filtered variant")
        half = input.shape[-1] // 2
        xf = input.float()
        result = (act(xf[..., :half]) * xf[..., half:]).to(input.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"""``{name}``: ``act(input[..., :d]) * input[..., d:]`` with ``d = input.shape[-1] // 2``.

    Parameters
    ----------
    input : torch.Tensor
        ``[..., 2d]``.
    out : torch.Tensor, optional
        ``[..., d]`` buffer to write; a new one otherwise.
    expert_ids, expert_step, **kwargs
        The JIT twin's expert-filtered variant; only its default (no filtering) is supported.

    Returns
    -------
    torch.Tensor
        ``[..., d]`` in ``input``'s dtype, computed in float32.
    """
    return op


silu_and_mul = _act_and_mul(F.silu, "silu_and_mul")
gelu_and_mul = _act_and_mul(lambda x: F.gelu(x, approximate="none"), "gelu_and_mul")
gelu_tanh_and_mul = _act_and_mul(lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh_and_mul")


# ------------------------------------------------------------------------------------------- rotary


def _rotate_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> None:
    """Rotate the first ``2 * cos.shape[-1]`` features of every head of ``x`` in place.

    ``x`` is ``[T, heads, head_size]``; ``cos`` and ``sin`` are ``[T, rot / 2]`` float32.
    """
    rot = 2 * cos.shape[-1]
    part = x[..., :rot].float()
    c, s = cos[:, None, :], sin[:, None, :]
    if is_neox:
        a, b = part[..., : rot // 2], part[..., rot // 2 :]
        rotated = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    else:
        a, b = part[..., 0::2], part[..., 1::2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    x[..., :rot] = rotated.to(x.dtype)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotary position embedding of ``query`` and ``key``, in place.

    Parameters
    ----------
    positions : torch.Tensor
        ``[T]`` integer positions.
    query : torch.Tensor
        ``[T, heads * head_size]`` or ``[T, heads, head_size]``.
    key : torch.Tensor or None
        Same layout as ``query`` with its own head count; ``None`` rotates the query only.
    head_size : int
        Features per head; the first ``cos_sin_cache.shape[-1]`` of them are rotated.
    cos_sin_cache : torch.Tensor
        ``[max_position, rot]``: ``rot / 2`` cosines then ``rot / 2`` sines per position.
    is_neox : bool
        Rotate the two halves of the rotated features (GPT-NeoX) or adjacent pairs (GPT-J).
    """
    cos, sin = cos_sin_cache.index_select(0, positions.reshape(-1).long()).float().chunk(2, dim=-1)
    for x in (query, key):
        if x is not None:
            _rotate_heads(x.view(x.shape[0], -1, head_size), cos, sin, is_neox)


def apply_rope_with_cos_sin_cache_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    is_neox: bool,
    rope_dim: int = 0,
    fused_args=None,
) -> None:
    """SGLang's JIT rope entry point: rotate ``q`` and ``k`` in place, then store K/V when asked.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, q_heads, D]`` (possibly a strided view of the first ``rot`` features of each head).
    k : torch.Tensor
        ``[T, k_heads, D]``.
    cos_sin_cache : torch.Tensor
        ``[max_position, rot]`` float32.
    positions : torch.Tensor
        ``[T]``.
    is_neox : bool
        As in :func:`rotary_embedding`.
    rope_dim : int
        Rotated features; 0 means ``cos_sin_cache.shape[-1]``.
    fused_args : FusedSetKVBufferArg, optional
        When given, the rotated key and ``fused_args.value`` are written to rows ``fused_args.cache_loc``
        of ``fused_args.k_buffer`` and ``fused_args.v_buffer`` (unscaled stores only).
    """
    rot = rope_dim or cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[:, :rot].index_select(0, positions.reshape(-1).long()).float().chunk(2, dim=-1)
    _rotate_heads(q, cos, sin, is_neox)
    _rotate_heads(k, cos, sin, is_neox)
    if fused_args is None:
        return
    if getattr(fused_args, "k_scale", None) is not None or getattr(fused_args, "v_scale", None) is not None:
        raise NotImplementedError("the CUDA stand-in's rope stores K/V unscaled only")
    loc = fused_args.cache_loc.long()
    k_buf, v_buf = fused_args.k_buffer, fused_args.v_buffer
    k_buf.view(k_buf.shape[0], -1)[loc] = k.reshape(k.shape[0], -1).to(k_buf.dtype)
    v_buf.view(v_buf.shape[0], -1)[loc] = fused_args.value.reshape(k.shape[0], -1).to(v_buf.dtype)


# ---------------------------------------------------------------------------------------------- MoE


def topk_softmax(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool = False,
    moe_softcapping: float = 0.0,
    correction_bias: torch.Tensor | None = None,
) -> None:
    """Softmax routing, written in place: the top-k experts of each token and their probabilities.

    Parameters
    ----------
    topk_weights : torch.Tensor
        ``[T, k]`` float32 output: the chosen experts' softmax probabilities (divided by their sum when
        ``renormalize``).
    topk_ids : torch.Tensor
        ``[T, k]`` integer output: the chosen experts, by descending score.
    gating_output : torch.Tensor
        ``[T, E]`` router logits.
    renormalize : bool
        Make each row of weights sum to 1.
    moe_softcapping : float
        When positive, logits become ``cap * tanh(logits / cap)`` first.
    correction_bias : torch.Tensor, optional
        ``[E]``, added to the probabilities for the choice only; the weights stay unbiased.
    """
    logits = gating_output.float()
    if moe_softcapping > 0:
        logits = moe_softcapping * torch.tanh(logits / moe_softcapping)
    probs = torch.softmax(logits, dim=-1)
    scores = probs if correction_bias is None else probs + correction_bias.float()
    ids = torch.topk(scores, topk_ids.shape[-1], dim=-1).indices
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids)


def moe_align_block_size(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    cumsum_buffer: torch.Tensor,
    pad_sorted_token_ids: bool = False,
    ignore_invalid_expert: bool = False,
) -> None:
    """Group the (token, slot) pairs by expert in block-padded runs, in place (SGLang's "+1" convention).

    Expert ``e`` of ``topk_ids`` goes to bucket ``e + 1``, so a dropped slot (``-1``) lands in bucket 0,
    whose blocks get expert id ``-1`` and are skipped by the fused MoE kernel.  Buckets are laid out in
    order, each padded to a multiple of ``block_size``; inside a bucket the pairs keep their flat order.

    Parameters
    ----------
    topk_ids : torch.Tensor
        ``[T, k]`` expert ids, ``-1`` for a dropped slot.
    num_experts : int
        The bucket count ``B = E + 1``.
    block_size : int
        Rows per block of the fused MoE GEMM.
    sorted_token_ids : torch.Tensor
        ``[P]`` int32 output: flat pair indices by bucket, padding slots hold ``T * k``.
    experts_ids : torch.Tensor
        ``[P / block_size]`` int32 output: each used block's expert (bucket - 1); later entries untouched.
    num_tokens_post_pad : torch.Tensor
        ``[1]`` (or more) int32 output: the padded total in element 0.
    cumsum_buffer : torch.Tensor
        ``[>= B + 1]`` int32 output: the bucket start offsets, then the total.
    pad_sorted_token_ids : bool
        Fill the whole of ``sorted_token_ids`` with ``T * k`` first (SGLang always asks for it); without
        it only the used region's padding is written.
    ignore_invalid_expert : bool
        A different contract (no "+1" bucket); not supported.
    """
    if ignore_invalid_expert:
        raise NotImplementedError("the CUDA stand-in's moe_align_block_size has no ignore_invalid_expert mode")
    device = topk_ids.device
    flat = topk_ids.reshape(-1)
    numel = flat.numel()
    bucket = (flat.long() + 1).clamp_(0, num_experts - 1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    starts = ends - padded
    total = ends[-1]

    order = torch.argsort(bucket, stable=True)
    in_order = bucket[order]
    rank = torch.arange(numel, device=device) - (counts.cumsum(0) - counts)[in_order]
    position = starts[in_order] + rank
    if pad_sorted_token_ids:
        sorted_token_ids.fill_(numel)
    else:
        slots = torch.arange(sorted_token_ids.numel(), device=device)
        sorted_token_ids.masked_fill_(slots < total, numel)
    sorted_token_ids.scatter_(0, position, order.to(sorted_token_ids.dtype))

    block_start = torch.arange(experts_ids.numel(), device=device) * block_size
    owner = torch.searchsorted(ends, block_start, right=True).clamp_(max=num_experts - 1)
    experts_ids.copy_(torch.where(block_start < total, owner - 1, experts_ids.long()).to(experts_ids.dtype))
    num_tokens_post_pad[:1].copy_(total.reshape(1).to(num_tokens_post_pad.dtype))
    cumsum_buffer[: num_experts + 1].copy_(torch.cat((starts, total.reshape(1))).to(cumsum_buffer.dtype))


def moe_sum_reduce(input: torch.Tensor, output: torch.Tensor, routed_scaling_factor: float) -> None:
    """Sum each token's expert outputs, scaled, into ``output`` (in place).

    Parameters
    ----------
    input : torch.Tensor
        ``[T, k, H]`` per-slot expert outputs.
    output : torch.Tensor
        ``[T, H]``: ``routed_scaling_factor * input.sum(1)``, accumulated in float32.
    routed_scaling_factor : float
        Scale of the sum.
    """
    output.copy_(input.float().sum(dim=1) * routed_scaling_factor)
