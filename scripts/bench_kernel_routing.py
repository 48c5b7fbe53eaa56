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

import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.bench.common import git_sha, time_graph, write_csv
from xshare_sglang.bench.kernel_routing import gptoss_layer_runtime, pruned_kernel_routing

SHAPES = {"gpt-oss-120b": (128, 4), "gpt-oss-20b": (32, 4)}
POLICIES = {
    "xshare k0=1 b=8": PrunerConfig(policy="xshare", k0=1, budget=8),
    "oea k0=1": PrunerConfig(policy="oea", k0=1),
    "moe-spec 16": PrunerConfig(policy="moe-spec", max_experts=16),
}


def pruned_call(topk, runtime, config, logits: torch.Tensor, top_k: int):
    """``fn(i)``: one pruned layer call as the ``TopK.forward_cuda`` hook runs it."""

    def call_once(i: int) -> None:
        pruned_kernel_routing(topk, runtime, config, logits, runtime.num_valid_buffer, top_k)

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
                runtime, config = gptoss_layer_runtime(num_experts, top_k, cfg, device)
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
