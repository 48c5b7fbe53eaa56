"""Compile the fused selection kernels for sm_90 (Hopper) on a machine without a GPU, exactly as a launch
on a GPU would (the wrapper's arguments, Triton's own argument specialization), and report what the
PTX holds.

Run as ``python -m tests.compile_sm90 CASES_JSON`` with ``TRITON_INTERPRET`` unset (the jit functions
must be real ``JITFunction`` objects); ``tests/test_kernels_ptx.py`` does.  Each case is a dict with
``tokens``, ``experts``, ``policy``, ``router`` (softmax, sigmoid, grouped, biased), ``top_k``, ``fill``
and ``metrics``; the output is one JSON list, per case ``{kernel: {ptx op: count}}`` or
``{"error": message}``.  With ``PYTHONPATH`` naming another Triton install first, the same cases
compile with that Triton (the GPU machine's Triton 3.6 crashed on some that SGLang's 3.8 compiles).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from tests.strategies import make_logits, routing_call
from xshare_sglang import PrunerConfig
from xshare_sglang.kernels import _prune_route as jit
from xshare_sglang.policies.call import RouterSpec

PTX_OPS = ("div.full.f32", "div.approx.f32", "div.approx.ftz.f32", "div.rn.f32")
TARGET = GPUTarget("cuda", 90, 32)


class _Recorder:
    """Stands in for a jit function: keeps the arguments of a launch instead of launching."""

    def __init__(self, name: str, captured: dict) -> None:
        self.name, self.captured = name, captured

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.captured[self.name] = (args, dict(kwargs))

        return launch


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
    return PrunerConfig(policy=policy, k0=1, budget=8, request_budget=2, rank_budget=2)


def compile_case(case: dict) -> dict:
    """Capture the launches of one ``prune_route`` call and compile each kernel for sm_90."""
    wrapper = importlib.import_module("xshare_sglang.kernels.prune_route")
    real = {"select_kernel": jit.select_kernel, "route_kernel": jit.route_kernel}
    captured: dict = {}
    wrapper._interpreting = lambda: True  # CPU tensors reach the launch code
    jit.select_kernel, jit.route_kernel = (_Recorder(name, captured) for name in real)
    try:
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
        wrapper.prune_route(call, _config(case["policy"]), fill_dropped=case["fill"], metrics_row=metrics)
    finally:
        jit.select_kernel, jit.route_kernel = real["select_kernel"], real["route_kernel"]
    backend = make_backend(TARGET)
    out = {}
    for name, (args, kwargs) in captured.items():
        fn = real[name]
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        try:
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__
            )
        except Exception as exc:  # a compiler crash is the finding
            lines = [line for line in str(exc).splitlines() if "error" in line.lower() or "Assertion" in line]
            return {"error": f"{name}: {type(exc).__name__}: {' | '.join(lines[:3])[:500]}"}
        ptx = compiled.asm["ptx"]
        out[name] = {op: ptx.count(op) for op in PTX_OPS}
    return out


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must compile")
    print(json.dumps([compile_case(case) for case in json.loads(sys.argv[1])]))
