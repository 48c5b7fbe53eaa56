"""``select_keep_mask``: the keep mask of DESIGN section 4 computed by Triton kernels.

Same inputs and meaning as :func:`xshare_sglang.select_experts_mask` (the torch reference), plus
``out`` and ``workspace`` so that a call inside a CUDA graph allocates nothing and never talks to the
host.  Launch shapes depend only on the shapes of the inputs and on the config, which CUDA-graph
capture fixes; the real-token count may be a device tensor the caller refills before each replay.

Where the kernels do not cover a case (CPU tensors without ``TRITON_INTERPRET=1``, E > 512,
top_k > 16, D > 64, LYNX with beta > 14, more than 2**22 tokens, another dtype) the call goes to the
torch reference and a warning says so once per reason.  The answer is the same either way.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ..config import PrunerConfig
from ..policies.api import select_experts_mask, select_with_aggregate, validate_selection_args
from ..policies.moe_spec import static_values

logger = logging.getLogger(__name__)

MAX_EXPERTS = 512
MAX_TOP_K = 16
MAX_TOKENS_PER_REQUEST = 64
MAX_LYNX_BETA = 14
MAX_TOKENS = 1 << 22  # keeps aggregates (<= T * 2**24) exact as float64 keys
MAX_PARTS = 64  # token-pass programs: bounds the finalize kernel's reduction
BLOCK_BINS = 16  # LYNX bins 0..beta plus one carry digit
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_MODES = {
    "oea": "MODE_WARM",
    "xshare": "MODE_GREEDY_WARM",
    "xshare-spec": "MODE_GREEDY_BASE",
    "xshare-threshold": "MODE_THRESHOLD",
    "xshare-ep": "MODE_RANK_ROUNDS",
    "lynx": "MODE_GIVEN",
}
_reported: set[str] = set()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unsupported_reason(logits: torch.Tensor, cfg: PrunerConfig, *, top_k: int, tokens_per_request: int) -> str | None:
    """Why the kernels cannot serve this call, or None when they can."""
    if not (logits.is_cuda or (_interpreting() and logits.device.type == "cpu")):
        return f"logits on {logits.device.type} (the kernels need CUDA, or TRITON_INTERPRET=1 on CPU)"
    if logits.dtype not in SUPPORTED_DTYPES:
        return f"logits dtype {logits.dtype} (supported: float32, bfloat16, float16)"
    num_tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS:
        return f"E={num_experts} experts (the kernels support up to {MAX_EXPERTS})"
    if top_k > MAX_TOP_K:
        return f"top_k={top_k} (the kernels support up to {MAX_TOP_K})"
    if num_tokens > MAX_TOKENS:
        return f"T={num_tokens} tokens (the kernels support up to {MAX_TOKENS})"
    if _per_request(cfg) and tokens_per_request > MAX_TOKENS_PER_REQUEST:
        return f"tokens_per_request={tokens_per_request} (the kernels support up to {MAX_TOKENS_PER_REQUEST})"
    if cfg.policy == "lynx" and cfg.beta > MAX_LYNX_BETA:
        return f"lynx beta={cfg.beta} (the kernels support up to {MAX_LYNX_BETA})"
    return None


def _per_request(cfg: PrunerConfig) -> bool:
    """Whether the token pass builds per-request sets (xshare-spec, moe-spec with scope=request)."""
    return cfg.policy == "xshare-spec" or (cfg.policy == "moe-spec" and cfg.scope == "request")


@dataclass(frozen=True)
class LaunchPlan:
    """How the token pass splits one call: static for a given (T, D, E, policy)."""

    num_parts: int  # programs of the token pass
    rows_per_request: int  # rows one "request" loop iteration covers
    requests_per_program: int
    chunk_rows: int  # rows loaded per tile
    block_experts: int


def plan_launch(num_tokens: int, num_experts: int, tokens_per_request: int, per_request: bool) -> LaunchPlan:
    """Split T tokens over at most :data:`MAX_PARTS` programs; requests never straddle programs."""
    block_experts = max(16, _next_pow2(num_experts))
    tile_rows = max(1, min(16, 2048 // block_experts))  # keep a tile near 2048 elements
    if per_request:
        num_requests = max(1, -(-num_tokens // tokens_per_request))
        requests_per_program = -(-num_requests // MAX_PARTS)
        num_parts = -(-num_requests // requests_per_program)
        return LaunchPlan(
            num_parts,
            tokens_per_request,
            requests_per_program,
            min(tile_rows, _next_pow2(tokens_per_request)),
            block_experts,
        )
    rows = max(tile_rows, -(-max(num_tokens, 1) // MAX_PARTS))
    rows = -(-rows // tile_rows) * tile_rows
    num_parts = max(1, -(-num_tokens // rows))
    return LaunchPlan(num_parts, rows, 1, tile_rows, block_experts)


class SelectionWorkspace:
    """Scratch memory of :func:`select_keep_mask` for one device and expert count.

    Allocate it before CUDA-graph capture and pass it to every call (one workspace may serve every
    layer: calls on one stream run one after the other).  About ``64 * E * 80`` bytes.

    Parameters
    ----------
    num_experts : int
    device : torch.device or str
    """

    def __init__(self, num_experts: int, device: torch.device | str) -> None:
        self.num_experts = num_experts
        self.device = torch.device(device)
        parts = MAX_PARTS
        kw = dict(device=self.device)
        self.agg_part = torch.zeros(parts, num_experts, dtype=torch.int64, **kw)
        self.warm_part = torch.zeros(parts, num_experts, dtype=torch.int8, **kw)
        self.base_part = torch.zeros(parts, num_experts, dtype=torch.int8, **kw)
        self.lynx_counts = torch.zeros(parts, num_experts, BLOCK_BINS, dtype=torch.int32, **kw)
        self.lynx_digits = torch.zeros(num_experts, BLOCK_BINS, dtype=torch.int64, **kw)
        self.lynx_s_rank = torch.zeros(num_experts, dtype=torch.int32, **kw)
        self.prim = torch.zeros(num_experts, dtype=torch.float64, **kw)
        self.flag = torch.zeros(num_experts, dtype=torch.int8, **kw)
        self.mass = torch.zeros(num_experts, dtype=torch.int64, **kw)


_workspaces: dict[tuple[str, int], SelectionWorkspace] = {}


def default_workspace(num_experts: int, device: torch.device) -> SelectionWorkspace:
    """A workspace shared by calls that pass none; created once per (device, E) and never freed, so a
    CUDA graph captured with it stays valid."""
    key = (str(device), num_experts)
    if key not in _workspaces:
        _workspaces[key] = SelectionWorkspace(num_experts, device)
    return _workspaces[key]


def _fallback(
    reason: str,
    logits: torch.Tensor,
    cfg: PrunerConfig,
    out: torch.Tensor | None,
    stats_out: torch.Tensor | None,
    **kwargs,
):
    if reason not in _reported:
        _reported.add(reason)
        logger.warning("moe-pruner selection uses the torch reference: %s", reason)
    if stats_out is None:
        keep = select_experts_mask(logits, cfg, **kwargs)
    else:
        keep, aggregate = select_with_aggregate(logits, cfg, **kwargs)
        stats_out[0] = torch.where(keep, aggregate, 0).sum()
        stats_out[1] = aggregate.sum()
    if out is None:
        return keep
    out.copy_(keep)
    return out


def select_keep_mask(
    logits: torch.Tensor,
    cfg: PrunerConfig,
    *,
    top_k: int,
    tokens_per_request: int = 1,
    num_valid_tokens: int | torch.Tensor | None = None,
    expert_to_rank: torch.Tensor | None = None,
    scoring: str = "softmax",
    out: torch.Tensor | None = None,
    workspace: SelectionWorkspace | None = None,
    layer_id: int | None = None,
    stats_out: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep mask of one MoE layer call, computed on the device by Triton kernels.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32 / bfloat16 / float16
    cfg : PrunerConfig
    top_k, tokens_per_request, num_valid_tokens, expert_to_rank, scoring, layer_id, token_weights
        As in :func:`xshare_sglang.select_experts_mask`.
    out : Tensor, shape [E], bool, optional
        Written in place and returned; pass one inside CUDA graphs.
    workspace : SelectionWorkspace, optional
        Scratch memory; default: one shared per (device, E), created on first use.
    stats_out : Tensor, shape [2], int64, optional
        Receives the aggregate score of the kept experts and of all experts (fixed point, the
        policy's score over the real tokens): their ratio is the share of score mass kept.

    Returns
    -------
    Tensor, shape [E], bool
    """
    validate_selection_args(
        logits,
        cfg,
        top_k=top_k,
        tokens_per_request=tokens_per_request,
        expert_to_rank=expert_to_rank,
        scoring=scoring,
        token_weights=token_weights,
    )
    num_tokens, num_experts = logits.shape
    if out is not None and (out.shape != (num_experts,) or out.dtype != torch.bool or out.device != logits.device):
        raise ValueError(f"out must be a bool tensor of shape ({num_experts},) on {logits.device}")
    if stats_out is not None and (stats_out.shape != (2,) or stats_out.dtype != torch.int64):
        raise ValueError("stats_out must be an int64 tensor of shape (2,)")
    if cfg.policy == "none":
        keep = torch.ones(num_experts, dtype=torch.bool, device=logits.device) if out is None else out.fill_(True)
        if stats_out is not None:
            stats_out.zero_()
        return keep
    reason = unsupported_reason(logits, cfg, top_k=top_k, tokens_per_request=tokens_per_request)
    if reason is not None:
        return _fallback(
            reason,
            logits,
            cfg,
            out,
            stats_out,
            top_k=top_k,
            tokens_per_request=tokens_per_request,
            num_valid_tokens=num_valid_tokens,
            expert_to_rank=expert_to_rank,
            scoring=scoring,
            layer_id=layer_id,
            token_weights=token_weights,
        )

    from . import _select  # imports triton

    ws = workspace if workspace is not None else default_workspace(num_experts, logits.device)
    if ws.num_experts != num_experts or ws.device != logits.device:
        raise ValueError(
            f"workspace is for E={ws.num_experts} on {ws.device}, the call has E={num_experts} on {logits.device}"
        )
    if out is None:
        out = torch.empty(num_experts, dtype=torch.bool, device=logits.device)

    nv_tensor = isinstance(num_valid_tokens, torch.Tensor)
    nv_ptr = num_valid_tokens if nv_tensor else logits
    nv_arg = num_tokens if (num_valid_tokens is None or nv_tensor) else int(num_valid_tokens)
    score = cfg.effective_score
    has_cap = cfg.max_experts is not None and cfg.policy != "moe-spec"
    static = cfg.policy == "moe-spec" and cfg.ranking == "static"
    # aggregates are needed by every rule except oea, static moe-spec and lynx; by the cap; by stats
    need_agg = (cfg.policy not in ("oea", "lynx") and not static) or has_cap or stats_out is not None
    per_request = _per_request(cfg)
    request_top = cfg.policy == "moe-spec"  # scope=request: each request's plain top-B
    has_weights = token_weights is not None
    weights = token_weights.contiguous() if has_weights else logits
    plan = plan_launch(num_tokens, num_experts, tokens_per_request, per_request)

    if need_agg or cfg.policy not in ("lynx", "moe-spec"):
        # per-program aggregates and warm-up sets (lynx needs aggregates only for its cap)
        _select.token_pass_kernel[(plan.num_parts,)](
            logits,
            logits.stride(0),
            logits.stride(1),
            num_tokens,
            num_experts,
            nv_ptr,
            nv_arg,
            ws.agg_part,
            ws.warm_part,
            ws.base_part,
            plan.rows_per_request,
            plan.requests_per_program,
            cfg.k0 if cfg.policy not in ("moe-spec", "lynx") else 0,
            top_k,
            min(cfg.max_experts if request_top else cfg.request_budget, num_experts),
            weights,
            HAS_NV_PTR=nv_tensor,
            NEED_SCORES=need_agg,
            SCORE_TOPK=score == "topk",
            SIGMOID=scoring == "sigmoid",
            PER_REQUEST=per_request,
            REQUEST_TOP=request_top,
            HAS_WEIGHTS=has_weights,
            BLOCK_E=plan.block_experts,
            CHUNK_T=plan.chunk_rows,
            num_warps=4,
        )
    if cfg.policy == "lynx":
        _launch_lynx(logits, cfg, top_k, nv_ptr, nv_arg, nv_tensor, ws, plan, weights, has_weights)

    if request_top and per_request:
        mode, count = "MODE_GIVEN", 0
    elif cfg.policy == "moe-spec":
        mode, count = ("MODE_TOP_VALUES" if static else "MODE_TOP_AGG"), cfg.max_experts
    else:
        mode, count = _MODES[cfg.policy], cfg.budget
    values = static_values(cfg, layer_id, logits.device) if static else ws.prim
    group = expert_to_rank if expert_to_rank is not None else ws.flag
    block_e = plan.block_experts
    _select.finalize_kernel[(1,)](
        ws.agg_part,
        ws.warm_part,
        ws.base_part,
        0 if static and not need_agg else plan.num_parts,  # static moe-spec alone reads no partials
        values,
        group,
        nv_ptr,
        nv_arg,
        num_tokens,
        ws.prim,
        ws.flag,
        ws.mass,
        out,
        stats_out if stats_out is not None else ws.mass,
        num_experts,
        min(count, num_experts + 1),
        float(cfg.tau),
        cfg.rank_budget,
        cfg.max_experts if has_cap else 0,
        cfg.min_tokens if cfg.min_tokens is not None else 0,
        cfg.max_tokens if cfg.max_tokens is not None else MAX_TOKENS,
        HAS_NV_PTR=nv_tensor,
        MODE=getattr(_select, mode).value,
        HAS_CAP=has_cap,
        HAS_RANGE=cfg.min_tokens is not None or cfg.max_tokens is not None,
        HAS_STATS=stats_out is not None,
        NEED_AGG=need_agg,
        NEED_BASE=per_request or cfg.policy == "lynx",
        BLOCK_E=block_e,
        CHUNK=max(1, min(32, 4096 // block_e)),
        SEARCH_STEPS=block_e.bit_length() + 1,
        num_warps=8 if block_e >= 256 else 4,
    )
    return out


def _launch_lynx(logits, cfg, top_k, nv_ptr, nv_arg, nv_tensor, ws, plan, weights, has_weights) -> None:
    """The LYNX launches that precede the finalize kernel: bin counts, exact s ranks, picks."""
    from . import _lynx

    num_tokens, num_experts = logits.shape
    grid = (plan.num_parts,)
    rows = dict(
        logits_ptr=logits,
        stride_t=logits.stride(0),
        stride_e=logits.stride(1),
        num_tokens=num_tokens,
        num_experts=num_experts,
        n_valid_ptr=nv_ptr,
        n_valid_arg=nv_arg,
        rows_per_program=plan.rows_per_request,
        alpha=float(cfg.alpha),
        beta=cfg.beta,
        weights_ptr=weights,
        HAS_NV_PTR=nv_tensor,
        HAS_WEIGHTS=has_weights,
        BLOCK_E=plan.block_experts,
        CHUNK_T=plan.chunk_rows,
        num_warps=4,
    )
    _lynx.lynx_count_kernel[grid](counts_part_ptr=ws.lynx_counts, BLOCK_BINS=BLOCK_BINS, **rows)
    _lynx.lynx_rank_kernel[(1,)](
        ws.lynx_counts,
        plan.num_parts,
        nv_ptr,
        nv_arg,
        num_tokens,
        ws.lynx_digits,
        ws.lynx_s_rank,
        num_experts,
        cfg.beta,
        HAS_NV_PTR=nv_tensor,
        BLOCK_E=plan.block_experts,
        BLOCK_BINS=BLOCK_BINS,
        CHUNK=max(1, min(32, 4096 // plan.block_experts)),
        num_warps=4,
    )
    _lynx.lynx_pick_kernel[grid](s_rank_ptr=ws.lynx_s_rank, base_part_ptr=ws.base_part, top_k=top_k, **rows)
