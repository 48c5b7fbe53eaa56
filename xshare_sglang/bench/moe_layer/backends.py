"""Which MoE backends a run may use (:func:`resolve_backends`), and the checks a backend and the
token alignment pass against the float32 reference before anything is timed."""

from __future__ import annotations

import torch

from ..common import sync
from ..moe_align import align_reference, align_tokens
from .grouped_mm import GroupedMMMoE
from .reference import reference_moe, rel_err, route_topk
from .sglang_fused import KERNEL_FILE, SglangFusedMoE, find_sglang_root
from .shapes import Shape


def check_backend(backend, shape: Shape, weights, device, dtype, gen) -> float:
    """Worst relative error of the backend against the reference on one random routing (decode, T=16).

    On CUDA the call is also captured in a CUDA graph and replayed, as the timed runs do.
    """
    w13, w2 = weights[0]
    tokens = 16
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(tokens, shape.num_experts, generator=gen, device=device)
    ids, w = route_topk(logits, shape.top_k, shape.scoring)
    ids[0, 0] = -1  # a dropped slot must be skipped
    ref = reference_moe(x, ids, w, w13, w2, 0)
    err = rel_err(backend(x, ids, w, w13, w2, 0), ref)
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            backend(x, ids, w, w13, w2, 0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = backend(x, ids, w, w13, w2, 0)
        captured.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        sync()
        err = max(err, rel_err(captured, ref))
        del graph
    return err


def check_alignment(shape: Shape, device, gen) -> bool:
    """``align_tokens`` equals ``align_reference`` on a random routing with dropped and remote slots."""
    for tokens, block_m in ((13, 1), (13, 16), (1, 16)):  # (1, 16): fewer slots than buckets
        ids = torch.randint(-1, shape.num_experts, (tokens, shape.top_k), generator=gen, device=device)
        ids = ids.to(torch.int32)
        sorted_ids, expert_ids, bounds = align_tokens(ids, block_m, shape.local_experts, 0)
        ref_sorted, ref_experts, ref_bounds = align_reference(ids, block_m, shape.local_experts, 0)
        used = int(ref_bounds[-1])
        if not torch.equal(bounds.cpu(), ref_bounds) or not torch.equal(sorted_ids[:used].cpu(), ref_sorted):
            return False
        if not torch.equal(expert_ids[: used // block_m].cpu(), ref_experts):
            return False
    return True


def resolve_backends(choice: str, sglang_root: str | None) -> tuple[list, list[str]]:
    """Backends to try, in order of preference, and why any could not be built."""
    found, notes = [], []
    if choice in ("auto", "sglang"):
        root = find_sglang_root(sglang_root)
        if root is None:
            notes.append(f"sglang: no {KERNEL_FILE} under --sglang-root, an installed sglang or .sgl/sglang")
        else:
            try:
                found.append(SglangFusedMoE(root))
            except Exception as exc:  # any load failure: the next backend
                notes.append(f"sglang: loading {root / KERNEL_FILE} failed: {type(exc).__name__}: {exc}")
    if choice in ("auto", "grouped_mm"):
        try:
            found.append(GroupedMMMoE())
        except Exception as exc:
            notes.append(f"grouped_mm: {exc}")
    return found, notes
