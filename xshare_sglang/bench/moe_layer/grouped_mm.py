"""The ``torch._grouped_mm`` MoE backend: :class:`GroupedMMMoE`, used when SGLang's kernel file is
not found or fails its check."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..moe_align import align_tokens
from .shapes import Shape


class GroupedMMMoE:
    """``torch._grouped_mm`` over the slots sorted by expert (offsets per expert; empty groups do no work)."""

    name = "grouped_mm"

    def __init__(self) -> None:
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
        self.source = f"torch._grouped_mm (torch {torch.__version__})"
        self._arange: dict[tuple[int, str], torch.Tensor] = {}

    def config_label(self, num_tokens: int, shape: Shape) -> str:
        return "-"

    def __call__(self, x, ids, weights, w13, w2, offset: int, config: dict | None = None) -> torch.Tensor:
        num_tokens, top_k = ids.shape
        numel, num_local, inter = ids.numel(), w13.shape[0], w2.shape[2]
        sorted_ids, _, bounds = align_tokens(ids, 1, num_local, offset, expert_ids=False)
        order = sorted_ids.long()
        offs = bounds[1 : num_local + 1]
        h = torch._grouped_mm(x.index_select(0, order // top_k), w13.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w2.transpose(1, 2), offs=offs)
        key = (numel, str(x.device))
        if key not in self._arange:
            self._arange[key] = torch.arange(numel, device=x.device, dtype=torch.int32)
        live = (self._arange[key] < bounds[num_local])[:, None]  # rows past the last expert are not computed
        y = torch.where(live, y * weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype), 0)
        out = torch.empty_like(y).index_copy_(0, order, y)
        return out.view(num_tokens, top_k, -1).sum(1)
