"""On a GPU: the cost of pruning GPT-OSS's default routing (``triton_kernels``, SGLang's ``TRITON_KERNEL``
top-k format), inside CUDA graphs.

Per router shape (GPT-OSS-120B: 128 experts, GPT-OSS-20B: 32 experts, both top-4) and real-token
count T, two timings of one layer call, bfloat16 logits:

* ``unpruned_us``: ``triton_kernels.topk.topk`` on the logits (the core of SGLang's routing wrapper);
* ``pruned_us``: what the plugin's ``TopK.forward_cuda`` hook adds around it: the select-only keep
  mask, the masked copy of the logits, the same top-k on it, and the call's metrics from the
  routing's expert histogram.

Prints a Markdown table (and writes CSV with ``--out``).  Off CUDA (``--smoke``, CPU under
``TRITON_INTERPRET=1``) it checks that the script runs: the figures are then not timings.

    python scripts/bench_kernel_routing.py [--tokens 1,8,32,128,512] [--out kernel_routing.csv]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.bench.common import git_sha, time_graph, write_csv
from xshare_sglang.sglang_plugin.model_layers import make_layer_state, make_runtime
from xshare_sglang.sglang_plugin.runtime import ForwardScope
from xshare_sglang.sglang_plugin.settings import PluginSettings

SHAPES = {"gpt-oss-120b": (128, 4), "gpt-oss-20b": (32, 4)}
POLICIES = {
    "xshare k0=1 b=8": PrunerConfig(policy="xshare", k0=1, budget=8),
    "oea k0=1": PrunerConfig(policy="oea", k0=1),
    "moe-spec 16": PrunerConfig(policy="moe-spec", max_experts=16),
}


def layer_runtime(num_experts: int, top_k: int, cfg: PrunerConfig, device: str):
    """One GPT-OSS-shaped layer's runtime, as the plugin builds it from SGLang's ``TopKConfig``."""
    config = SimpleNamespace(
        top_k=top_k,
        num_shared_topk_slots=0,
        scoring_func="softmax",
        custom_routing_function=None,
        correction_bias=None,
        use_grouped_topk=False,
        num_expert_group=None,
        topk_group=None,
        renormalize=True,
        routed_scaling_factor=None,
        apply_routed_scaling_factor_on_output=False,
    )
    state = make_layer_state(config, layer_id=0, row=0, num_experts=num_experts, device=device)
    runtime = make_runtime(PluginSettings(pruner=cfg), {id(config): state}, device)
    runtime.enter(ForwardScope(phase="decode", num_valid=runtime.num_valid_buffer, cfg=runtime.config_for("decode")))
    return runtime, config


def pruned_call(topk, runtime, config, logits: torch.Tensor, top_k: int):
    """``fn(i)``: one pruned layer call as the ``TopK.forward_cuda`` hook runs it (keep mask, masked
    logits, ``triton_kernels``' top-k on them, the call's metrics)."""

    def call_once(i: int) -> None:
        call = runtime.begin_call(config, runtime.num_valid_buffer)
        masked, _ = runtime.mask_for_kernel(call, logits, None)
        sparse = topk(masked, top_k, apply_softmax=True, n_rows=runtime.num_valid_buffer)
        runtime.count_kernel_routing(call, expert_counts=sparse.mask_metadata.col_sum)
        runtime.end_call()

    return call_once


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--calls", type=int, default=20, help="layer calls captured per graph")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="CSV of the rows")
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: runs, no timings")
    args = parser.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        sys.exit("bench_kernel_routing.py needs a CUDA device (or --smoke)")
    from triton_kernels.topk import topk

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    calls, replays = (2, 1) if args.smoke else (args.calls, args.replays)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for shape, (num_experts, top_k) in SHAPES.items():
        for num_tokens in tokens:
            logits = (torch.randn(num_tokens, num_experts, device=device) * 2).to(torch.bfloat16)
            num_valid = torch.tensor([num_tokens], dtype=torch.int32, device=device)
            unpruned = time_graph(lambda i: topk(logits, top_k, apply_softmax=True, n_rows=num_valid), calls, replays)  # noqa: B023
            for name, cfg in POLICIES.items():
                runtime, config = layer_runtime(num_experts, top_k, cfg, device)
                runtime.num_valid_buffer.fill_(num_tokens)
                pruned_us = time_graph(pruned_call(topk, runtime, config, logits, top_k), calls, replays)
                rows.append(
                    {
                        "router": shape,
                        "T": num_tokens,
                        "policy": name,
                        "unpruned_us": round(unpruned, 2),
                        "pruned_us": round(pruned_us, 2),
                        "added_us": round(pruned_us - unpruned, 2),
                        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke, not a timing)",
                        "git_sha": args.git_sha or git_sha(),
                    }
                )
    print("| router | T | policy | unpruned us | pruned us | added us |")
    print("|---|---:|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['router']} | {row['T']} | {row['policy']} | {row['unpruned_us']} | {row['pruned_us']} "
            f"| {row['added_us']} |"
        )
    if args.out is not None:
        write_csv(args.out, rows)


if __name__ == "__main__":
    main()
