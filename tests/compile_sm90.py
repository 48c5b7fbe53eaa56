"""Compile the fused selection kernels for sm_90 (Hopper) without a GPU, as a launch would
(:mod:`xshare_sglang.bench.kernel_compile`), and report what the PTX holds.

Run as ``python -m tests.compile_sm90 CASES_JSON`` with ``TRITON_INTERPRET`` unset;
``tests/test_kernels_ptx.py`` does.  Each case is a dict with ``tokens``, ``experts``, ``policy``,
``router`` (softmax, sigmoid, grouped, biased), ``top_k``, ``fill``, ``metrics`` and optionally
``pdl`` (launched as programmatic dependents); the output is one
JSON list, per case ``{kernel: {ptx op: count}}`` or ``{"error": message}``.  With ``PYTHONPATH``
naming another Triton install first, the same cases compile with that Triton (the GPU machine's
Triton 3.6 crashed on some that SGLang's 3.8 compiles).
"""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.strategies import make_logits, routing_call
from xshare_sglang import PrunerConfig
from xshare_sglang.bench.kernel_compile import capture_launches, compile_launch, ptx_counts
from xshare_sglang.policies.call import RouterSpec


def _router(name: str, top_k: int, num_experts: int) -> tuple[RouterSpec, torch.Tensor | None]:
    if name in ("softmax", "sigmoid"):
        return RouterSpec(top_k, name), None
    groups = 8
    topk_group = max(2, -(-top_k // (num_experts // groups)))
    if name == "grouped":
        return RouterSpec(top_k, "softmax", True, groups, topk_group), None
    return RouterSpec(top_k, "sigmoid", True, groups, topk_group, 2.5), torch.randn(num_experts)


def _config(policy: str) -> PrunerConfig:
    if policy == "moe-spec":
        return PrunerConfig(policy=policy, max_experts=16)
    if policy == "moe-spec-coverage":  # above one tile its pair sums, added with atomics
        return PrunerConfig(policy="moe-spec", max_experts=16, ranking="coverage")
    if policy == "moe-spec-coverage-probs":  # dense scores: above one tile, row lists filled with atomics
        return PrunerConfig(policy="moe-spec", max_experts=16, ranking="coverage", score="probs")
    return PrunerConfig(policy=policy, k0=1, budget=8, request_budget=2, rank_budget=2)


def compile_case(case: dict) -> dict:
    router, bias = _router(case["router"], case["top_k"], case["experts"])
    logits = make_logits(case["tokens"], case["experts"], "normal", seed=0).to(torch.bfloat16)
    call = routing_call(
        logits,
        router,
        num_valid_tokens=case["tokens"],
        as_tensor=True,
        correction_bias=bias,
        tokens_per_request=4,
        expert_to_rank=torch.arange(case["experts"]) % 4,
    )
    metrics = torch.zeros(4, dtype=torch.int64) if case["metrics"] else None
    extra = {}
    if case.get("pdl"):
        extra["enable_pdl"] = True
    launches = capture_launches(call, _config(case["policy"]), fill_dropped=case["fill"], metrics_row=metrics, **extra)
    out = {}
    for name, (_, args, kwargs) in launches.items():
        try:
            out[name] = ptx_counts(compile_launch(name, args, kwargs))
        except Exception as exc:  # a compiler crash is the finding
            lines = [line for line in str(exc).splitlines() if "error" in line.lower() or "Assertion" in line]
            return {"error": f"{name}: {type(exc).__name__}: {' | '.join(lines[:3])[:500]}"}
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must compile")
    print(json.dumps([compile_case(case) for case in json.loads(sys.argv[1])]))
