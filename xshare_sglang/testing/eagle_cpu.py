"""EAGLE speculative decoding on SGLang's CPU engine, for test servers only.

Why: SGLang 0.5.23 runs EAGLE-3 on CPU only with the ``intel_amx`` attention backend, which needs
SGLang's C++ CPU kernels and AMX (and is silently switched to ``torch_native`` on other hosts).  The
``torch_native`` backend that the CPU test server uses lacks two things EAGLE needs:

* target verify: ``TorchNativeAttnBackend.forward_extend`` gets ``ForwardMode.TARGET_VERIFY`` batches
  (``layers/attention/base_attn_backend.py``), but it needs ``extend_prefix_lens`` (None there) and
  applies a causal mask instead of the draft tree's ``spec_info.custom_mask``;
* multi-step draft decode: ``speculative/draft_utils.py``'s ``DraftBackendFactory`` has no
  ``torch_native`` entry and raises "EAGLE is not supported in decode attention backend torch_native".

How: :func:`register` (the ``sglang.srt.plugins`` entry point of the ``xshare-cpu-testing``
distribution metadata that lives next to the ``sgl_kernel`` stand-in, so SGLang finds it exactly when
the stand-in folder is on ``sys.path``, i.e. in ``xshare_sglang.testing.cpu_server`` processes) adds
two hooks through SGLang's own :class:`~sglang.srt.plugins.hook_registry.HookRegistry`:

* AROUND ``TorchNativeAttnBackend.forward_extend``: a TARGET_VERIFY batch goes to
  :func:`tree_verify_attention` (per request: SDPA of the N draft tokens over the committed prefix plus
  the N draft tokens, mask ``[prefix all visible | N x N tree mask]``); every other mode runs the
  original unchanged;
* AROUND ``DraftBackendFactory._create_backend``: the backend maps get a ``torch_native`` entry,
  :class:`TorchNativeMultiStepDraftBackend` for the per-step draft decode and a plain
  ``TorchNativeAttnBackend`` for draft extend.

Scope: greedy verify (SGLang verifies greedily on CPU anyway), ``--page-size 1``, no sliding window,
no overlap scheduler, no CUDA graphs, ``QLEN_ONLY`` tree masks (SGLang's CPU default).  Slow (Python
loops per request) and never meant for production.

Removable when SGLang's ``torch_native`` backend gains TARGET_VERIFY with ``custom_mask`` and a
``torch_native`` entry in ``DraftBackendFactory`` (i.e. SGLang supports EAGLE on its CPU engine without
AMX); then drop this module, the ``xshare_cpu_testing-*.dist-info`` folder of ``testing/standin`` and
its package-data glob.
"""

from __future__ import annotations

import logging
import os

import torch
from torch.nn.functional import scaled_dot_product_attention

logger = logging.getLogger(__name__)

_BACKEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
FORWARD_EXTEND_TARGET = _BACKEND + ".forward_extend"
FACTORY_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory._create_backend"

_registered = False
_announced = False


# ---------------------------------------------------------------------------------------- verify
def tree_verify_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    num_draft: int,
    *,
    scaling: float | None,
    enable_gqa: bool,
    v_head_dim: int | None = None,
) -> torch.Tensor:
    """Attention of the verify tokens of a TARGET_VERIFY batch (their K/V already in the cache).

    ``query`` is ``[bs * N, heads, head_dim]``, request-major; ``prefix_lens[b]`` is the committed
    length of request ``b``, whose N draft tokens sit at ``req_to_token[rpi[b], prefix:prefix + N]``;
    ``tree_mask`` is SGLang's QLEN_ONLY ``custom_mask`` (``bs * N * N`` bools, row q of block b says
    which draft tokens draft token q sees), not read when N is 1.  Returns ``[bs * N, heads, v_head_dim]``.
    """
    bs = prefix_lens.shape[0]
    n = num_draft
    if n == 1:
        # a one-node tree (adaptive speculation at 0 steps) sees its whole prefix and itself; SGLang then
        # passes an all-True mask of whatever size it had at hand (eagle_worker_v2's trivial verify input)
        blocks = torch.ones((bs, 1, 1), dtype=torch.bool, device=query.device)
    elif tree_mask.numel() != bs * n * n:
        raise ValueError(
            f"tree verify on torch_native expects a QLEN_ONLY mask of {bs}*{n}*{n} entries, got {tree_mask.numel()}"
        )
    else:
        blocks = tree_mask.view(bs, n, n).to(torch.bool)
    heads = query.shape[1]
    out = query.new_empty((query.shape[0], heads, v_head_dim or v_cache.shape[-1]))
    for b in range(bs):
        prefix = int(prefix_lens[b])
        slots = req_to_token[req_pool_indices[b], : prefix + n]
        key = k_cache[slots].movedim(0, 1).to(query.dtype)  # [kv_heads, L, d]
        value = v_cache[slots].movedim(0, 1).to(query.dtype)
        mask = torch.cat([blocks.new_ones((n, prefix)), blocks[b]], dim=1)  # [N, L]
        q = query[b * n : (b + 1) * n].movedim(0, 1)  # [heads, N, d]
        o = scaled_dot_product_attention(
            q[None], key[None], value[None], attn_mask=mask, scale=scaling, enable_gqa=enable_gqa
        )
        out[b * n : (b + 1) * n] = o[0].movedim(1, 0)
    return out


def _forward_extend_with_verify(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    """AROUND hook: TARGET_VERIFY batches get the tree mask, every other batch the original."""
    if not forward_batch.forward_mode.is_target_verify():
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache)
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if layer.is_cross_attention or (layer.sliding_window_size is not None and layer.sliding_window_size > -1):
        raise NotImplementedError("CPU tree verify: cross attention and sliding windows are not supported")
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v
        )
    spec_info = forward_batch.spec_info
    out = tree_verify_attention(
        q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim),
        backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
        backend.token_to_kv_pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens,
        spec_info.custom_mask,
        spec_info.draft_token_num,
        scaling=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        v_head_dim=layer.v_head_dim,
    )
    return out.reshape(out.shape[0], -1)


# ------------------------------------------------------------------------------ multi-step draft
def expand_draft_req_to_token(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, topk: int, num_steps: int
) -> torch.Tensor:
    """One ``req_to_token`` row per draft candidate (``bs * topk`` rows, request-major).

    SGLang allocates request b's draft slots contiguously after its prefix, candidate t's ``num_steps``
    slots at columns ``[seq_len + t * num_steps, seq_len + (t + 1) * num_steps)`` (see
    ``eagle_utils.per_step_draft_out_cache_loc``).  Candidate row ``(b, t)`` is request b's row with
    candidate t's slots moved to columns ``[seq_len, seq_len + num_steps)``, so a decode over the
    first ``seq_len + step + 1`` columns sees the prefix and that candidate's draft tokens so far.
    """
    rows = req_to_token[req_pool_indices.long()].repeat_interleave(topk, dim=0)
    for b, seq_len in enumerate(seq_lens.tolist()):
        for t in range(topk):
            start = seq_len + t * num_steps
            rows[b * topk + t, seq_len : seq_len + num_steps] = req_to_token[
                req_pool_indices[b], start : start + num_steps
            ]
    return rows


def _draft_step_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class TorchNativeDraftStepBackend(TorchNativeAttnBackend):
        """``TorchNativeAttnBackend`` for one draft decode step of ``bs * topk`` candidate rows."""

        def __init__(self, model_runner):
            super().__init__(model_runner)
            self.draft_decode_metadata = None  # (req_to_token rows, seq_lens, row indices)

        def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, rpi, seq_lens, *a, **kw):
            if self.draft_decode_metadata is not None:
                req_to_token, seq_lens, rpi = self.draft_decode_metadata
            return super()._run_sdpa_forward_decode(
                query, output, k_cache, v_cache, req_to_token, rpi, seq_lens, *a, **kw
            )

    return TorchNativeDraftStepBackend


class TorchNativeMultiStepDraftBackend:
    """The ``num_steps - 1`` per-step draft decode backends of EAGLE on ``torch_native``."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int) -> None:
        step_class = _draft_step_backend_class()
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [step_class(model_runner) for _ in range(speculative_num_steps - 1)]
        self.device = model_runner.device

    def init_forward_metadata(self, forward_batch) -> None:
        first = self.attn_backends[0]
        rows = expand_draft_req_to_token(
            first.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.topk,
            self.speculative_num_steps,
        )
        row_ids = torch.arange(rows.shape[0], device=rows.device)
        base = forward_batch.seq_lens.repeat_interleave(self.topk)
        for step, backend in enumerate(self.attn_backends):
            backend.init_forward_metadata(forward_batch)
            backend.draft_decode_metadata = (rows, base + step + 1, row_ids)


def _create_backend_with_torch_native(original, factory, backend_name, backend_map, *args, **kwargs):
    """AROUND hook on ``DraftBackendFactory._create_backend``: add a ``torch_native`` entry."""
    _announce()
    if "torch_native" not in backend_map:
        stamps_children = kwargs.get("stamps_children", args[1] if len(args) > 1 else False)
        if stamps_children:  # the multi-step draft decode container

            def make():
                return "torch_native", TorchNativeMultiStepDraftBackend(
                    factory.draft_model_runner, factory.topk, factory.speculative_num_steps
                )
        else:  # draft extend

            def make():
                from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

                return "torch_native", TorchNativeAttnBackend(factory.draft_model_runner)

        backend_map = {**backend_map, "torch_native": make}
    return original(factory, backend_name, backend_map, *args, **kwargs)


# ------------------------------------------------------------------------------------- register
def register() -> None:
    """``sglang.srt.plugins`` entry point: hook the two patches in, on the CPU engine only, once."""
    global _registered
    if _registered or os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(FORWARD_EXTEND_TARGET, _forward_extend_with_verify, HookType.AROUND)
    HookRegistry.register(FACTORY_TARGET, _create_backend_with_torch_native, HookType.AROUND)
    _registered = True


def _announce() -> None:
    """Log the one line saying what is patched, once per process, when EAGLE sets up its draft backends
    (``register`` runs before SGLang configures logging in its scheduler, so a line there is lost)."""
    global _announced
    if not _announced:
        _announced = True
        logger.info(
            "xshare CPU testing: EAGLE on torch_native patched (tree-masked TARGET_VERIFY in %s; "
            "torch_native multi-step draft decode and draft extend backends via %s)",
            FORWARD_EXTEND_TARGET,
            FACTORY_TARGET,
        )
