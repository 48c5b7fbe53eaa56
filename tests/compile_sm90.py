"""Compile the fused selection kernels for sm_90 (Hopper) on a machine without a GPU, with exactly the
arguments the launch wrapper passes for one call, and print what the PTX holds as JSON.

Run as ``python -m tests.compile_sm90 CASE`` with ``TRITON_INTERPRET`` unset (the jit functions must be
real ``JITFunction`` objects); ``tests/test_kernels_ptx.py`` does.  CASE is ``T,E,policy,router``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from tests.strategies import make_logits, routing_call
from xshare_sglang import PrunerConfig
from xshare_sglang.kernels import _prune_route as jit
from xshare_sglang.policies.call import RouterSpec

ROUTERS = {"softmax": RouterSpec(8, "softmax"), "grouped": RouterSpec(8, "sigmoid", True, 8, 4, 2.5)}


class _Recorder:
    """Stands in for a jit function: keeps the arguments of a launch instead of launching."""

    def __init__(self, name: str, captured: dict) -> None:
        self.name, self.captured = name, captured

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.captured[self.name] = (args, kwargs)

        return launch


def compile_case(num_tokens: int, num_experts: int, policy: str, router_name: str) -> dict:
    wrapper = importlib.import_module("xshare_sglang.kernels.prune_route")
    real = {"select_kernel": jit.select_kernel, "route_kernel": jit.route_kernel}
    captured: dict = {}
    jit.select_kernel, jit.route_kernel = (_Recorder(name, captured) for name in real)
    wrapper._interpreting = lambda: True  # CPU tensors reach the launch code
    router = ROUTERS[router_name]
    bias = torch.randn(num_experts) if router.scoring == "sigmoid" else None
    logits = make_logits(num_tokens, num_experts, "normal", seed=0).to(torch.bfloat16)
    call = routing_call(logits, router, num_valid_tokens=num_tokens, as_tensor=True, correction_bias=bias)
    wrapper.prune_route(
        call, PrunerConfig(policy=policy, k0=1, budget=8), metrics_row=torch.zeros(4, dtype=torch.int64)
    )
    out = {}
    for name, (args, kwargs) in captured.items():
        fn = real[name]
        options = {k: kwargs.pop(k) for k in ("num_warps", "enable_fp_fusion") if k in kwargs}
        values = [p for p in fn.params if not p.is_constexpr]
        signature = {p.name: mangle_type(a) for p, a in zip(values, args, strict=True)}
        constexprs = {}
        for p in fn.params:
            if p.is_constexpr:
                signature[p.name] = "constexpr"
                constexprs[(fn.arg_names.index(p.name),)] = kwargs[p.name]
        compiled = triton.compile(
            ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options
        )
        ptx = compiled.asm["ptx"]
        out[name] = {op: ptx.count(op) for op in ("div.full.f32", "div.approx.f32", "div.approx.ftz.f32", "div.rn.f32")}
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "unset TRITON_INTERPRET: the kernels must compile"
    tokens, experts, policy, router_name = sys.argv[1].split(",")
    print(json.dumps(compile_case(int(tokens), int(experts), policy, router_name)))
