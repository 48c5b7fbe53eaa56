"""Tuning SGLang's fused-MoE block configuration for pruned layer calls (``scripts/tune_pruned_moe.py``).

The idea of SGLang's own tuner (``benchmark/kernels/fused_moe_triton``): for each token count, time
every configuration of a search space on random routing and keep the fastest; write a JSON table
keyed by token count.  Here the routing is the one a pruned layer runs: T tokens, each sending its
top-k to distinct experts among ``kept`` experts only, so each kept expert sees about T·k/kept
tokens.  The table is keyed by (kept, T) and read by the plugin's lookup hook
(:mod:`xshare_sglang.sglang_plugin.pruned_moe_config`).  The kept counts are the static bounds on
|keep| of the benchmark's policy grid (what the hook looks up), or given.  The MoE is SGLang's kernel
as ``bench_moe_layer.py`` loads it (:class:`~xshare_sglang.bench.moe_layer.sglang_fused.SglangFusedMoE`),
timed inside CUDA graphs; every winner is checked against the float32 reference.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..sglang_plugin.pruned_moe_config import keep_bound, pruned_file_name, triton_folder
from .common import time_graph
from .moe_layer import MOE_TOLERANCE, SglangFusedMoE, Shape, policy_grid, reference_moe, rel_err

logger = logging.getLogger(__name__)

#: Per axis, the values tried (``small``: one device call per shape; ``full``: SGLang's breadth).
SPACES = {
    "small": {
        "BLOCK_SIZE_M": (16, 32, 64, 128),
        "BLOCK_SIZE_N": (64, 128, 256),
        "BLOCK_SIZE_K": (64, 128),
        "GROUP_SIZE_M": (1,),
        "num_warps": (4, 8),
        "num_stages": (3,),
    },
    "full": {
        "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
        "BLOCK_SIZE_N": (32, 64, 128, 256),
        "BLOCK_SIZE_K": (64, 128, 256),
        "GROUP_SIZE_M": (1, 16, 32, 64),
        "num_warps": (4, 8),
        "num_stages": (2, 3, 4, 5),
    },
    "smoke": {
        "BLOCK_SIZE_M": (16,),
        "BLOCK_SIZE_N": (32, 64),
        "BLOCK_SIZE_K": (32,),
        "GROUP_SIZE_M": (1,),
        "num_warps": (4,),
        "num_stages": (2,),
    },
}
DEFAULT_SMEM_BYTES = 227 * 1024  # H100 / H200 opt-in shared memory per block


def shared_memory_bytes(config: dict, element_bytes: int = 2) -> int:
    """Shared memory a config's pipelined A and B tiles need: ``stages·(BM·BK + BK·BN)·bytes``."""
    tile = config["BLOCK_SIZE_M"] * config["BLOCK_SIZE_K"] + config["BLOCK_SIZE_K"] * config["BLOCK_SIZE_N"]
    return config["num_stages"] * tile * element_bytes


def candidates(space: dict, num_tokens: int, top_k: int, kept: int, smem_limit: int) -> list[dict]:
    """The configs of ``space`` worth timing at (T, kept): those that fit in shared memory, with
    ``BLOCK_SIZE_M`` at most twice the mean tokens per kept expert (rounded up to a power of two, at
    least 16): taller blocks are mostly padding."""
    per_expert = max(1, -(-num_tokens * top_k // kept))
    max_m = max(16, 2 * (1 << (per_expert - 1).bit_length()))
    keys = list(space)
    out = []
    for values in itertools.product(*(space[k] for k in keys)):
        config = dict(zip(keys, values, strict=True))
        if config["BLOCK_SIZE_M"] <= max_m and shared_memory_bytes(config) <= smem_limit:
            out.append(config)
    return out


def plan_points(
    shape: Shape, tokens: list[int], phases: list[str], draft_tokens: int, kept: list[int] | None
) -> list[tuple[int, int]]:
    """(T, kept) pairs to tune: the given kept counts at every T, or the static bounds on |keep| of the
    benchmark's policy grid below E (what the plugin's hook looks up for those settings)."""
    points = set()
    for t in tokens:
        if kept:
            points |= {(t, k) for k in kept if shape.top_k <= k < shape.num_experts}
            continue
        for phase in phases:
            d = draft_tokens if phase == "verify" else 1
            for cfg in policy_grid(shape, phase, smoke=False):
                bound = keep_bound(cfg, t, d, shape.num_experts)
                if bound is not None and shape.top_k <= bound < shape.num_experts:
                    points.add((t, bound))
    return sorted(points, key=lambda p: (p[1], p[0]))


def pruned_routing(
    num_tokens: int, top_k: int, num_experts: int, kept: int, gen: torch.Generator, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of a pruned call: ``kept`` random experts; each token's top-k distinct among them.

    Returns
    -------
    ids : Tensor [T, k] int32
    weights : Tensor [T, k] float32, rows summing to 1
    """
    chosen = torch.randperm(num_experts, generator=gen)[:kept]
    picks = torch.rand(num_tokens, kept, generator=gen).argsort(dim=1)[:, :top_k]
    ids = chosen[picks].to(torch.int32)
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)
    return ids.to(device), weights.to(device)


@dataclass
class TuneResult:
    """The winners of one shape: kept -> T -> config, and per point what was timed."""

    table: dict[int, dict[int, dict]] = field(default_factory=dict)
    points: list[dict] = field(default_factory=list)


def tune_shape(
    shape: Shape,
    backend: SglangFusedMoE,
    points: list[tuple[int, int]],
    *,
    space: dict,
    dtype: torch.dtype,
    calls: int,
    replays: int,
    deadline: float,
    seed: int = 0,
    on_point=None,
) -> TuneResult:
    """Time every candidate at every (T, kept) point, fastest first into the table.

    SGLang's own choices at T and at ``ceil(T·E/kept)`` are timed first, so a winner is never slower
    than either (within the timing noise).  Past ``deadline`` (``time.monotonic()``) a point stops
    timing candidates and later points are skipped; ``on_point(result)`` runs after each point (to
    write partial results).
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    e, h, i = shape.local_experts, shape.hidden, shape.intermediate
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=device) * i**-0.5).to(dtype)
    smem = DEFAULT_SMEM_BYTES
    if device.type == "cuda":
        smem = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", smem)
    result = TuneResult()
    for num_tokens, kept in points:
        if time.monotonic() > deadline:
            result.points.append({"T": num_tokens, "kept": kept, "skipped": "past the time limit"})
            continue
        x = torch.randn(num_tokens, h, generator=gen, device=device).to(dtype)
        ids, weights = pruned_routing(num_tokens, shape.top_k, shape.num_experts, kept, cpu_gen, device)
        own, _ = backend.config(num_tokens, e, i)
        scaled_m = -(-num_tokens * shape.num_experts // kept)
        scaled, _ = backend.config(scaled_m, e, i)
        # SGLang's own choices first: a point cut short by the deadline still has them to beat
        pool = [dict(own)] + ([dict(scaled)] if scaled != own else [])
        pool += [c for c in candidates(space, num_tokens, shape.top_k, kept, smem) if c not in pool]
        timings = []
        for config in pool:
            if timings and time.monotonic() > deadline:
                logger.info(
                    "T=%d kept=%d: time limit after %d of %d configs", num_tokens, kept, len(timings), len(pool)
                )
                break
            try:
                us = time_graph(_call(backend, x, ids, weights, w13, w2, config), calls, replays)
            except Exception as exc:  # e.g. out of resources: not a candidate on this device
                logger.debug("config %s failed: %s", config, exc)
                continue
            timings.append((us, config))
        if not timings:
            result.points.append({"T": num_tokens, "kept": kept, "skipped": "no config ran"})
            continue
        timings.sort(key=lambda item: item[0])
        best_us, best = timings[0]
        by_config = {json.dumps(c, sort_keys=True): us for us, c in timings}
        err = rel_err(backend(x, ids, weights, w13, w2, 0, config=best), reference_moe(x, ids, weights, w13, w2, 0))
        point = {
            "T": num_tokens,
            "kept": kept,
            "candidates": len(timings),
            "space": len(pool),
            "best_us": round(best_us, 2),
            "sglang_us": _round(by_config.get(json.dumps(own, sort_keys=True))),
            "sglang_scaled_us": _round(by_config.get(json.dumps(scaled, sort_keys=True))),
            "best": best,
            "rel_err": round(err, 6),
        }
        result.points.append(point)
        if err <= MOE_TOLERANCE:
            result.table.setdefault(kept, {})[num_tokens] = best
        else:
            point["skipped"] = f"winner fails the reference check ({err:.2e} > {MOE_TOLERANCE})"
        logger.info("T=%d kept=%d: %s", num_tokens, kept, point)
        if on_point is not None:
            on_point(result)
    return result


def _call(backend, x, ids, weights, w13, w2, config: dict):
    """One layer call with ``config``, as ``time_graph`` captures it."""

    def call(_i: int) -> None:
        backend(x, ids, weights, w13, w2, 0, config=config)

    return call


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def write_table(out_dir: Path, backend: SglangFusedMoE, shape: Shape, table: dict) -> Path:
    """Write ``table`` (kept -> T -> config) where the hook reads it:
    ``<out_dir>/triton_<version>/<SGLang's file name>,pruned.json``."""
    folder = Path(out_dir) / triton_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / pruned_file_name(backend.file_name(shape.local_experts, shape.intermediate))
    ordered = {str(k): {str(t): table[k][t] for t in sorted(table[k])} for k in sorted(table)}
    path.write_text(json.dumps(ordered, indent=2) + "\n")
    return path
