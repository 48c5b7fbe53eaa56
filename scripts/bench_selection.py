"""Selection cost per MoE layer call: the Triton kernels vs the torch reference, inside CUDA graphs.

For every (E, T, policy) both paths are captured in a CUDA graph of ``--calls`` consecutive calls
that cycle through ``--rotate`` different logit buffers (so the inputs are not one cached tensor);
each graph is warmed up, then replayed ``--replays`` times and timed with CUDA events.  The figure
reported is the median replay time divided by the calls per graph.  The kernel path runs with a
preallocated workspace and output, as the server does; its eager calls are also checked for
allocations.

Run on a GPU node from the repository root (no install needed)::

    PYTHONPATH=. python scripts/bench_selection.py --out-dir bench_out

Writes ``selection.csv`` and ``selection.json`` (rows plus device name, torch/triton versions and git
SHA) to ``--out-dir`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _bench_common import git_sha, sync, time_graph, write_csv

from xshare_sglang import PrunerConfig, select_experts_mask
from xshare_sglang.kernels import SelectionWorkspace, select_keep_mask

TOP_K = 8
TOKENS_PER_REQUEST = 4
NUM_RANKS = 8


def bench_configs(tmp_dir: Path, num_experts: int) -> dict[str, PrunerConfig]:
    """One representative setting per policy (the papers' typical budgets)."""
    counts = [[float((e * 7919) % 101) for e in range(num_experts)]]
    ranking = tmp_dir / f"ranking_{num_experts}.json"
    ranking.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
    return {
        "oea": PrunerConfig(policy="oea", k0=2),
        "xshare": PrunerConfig(policy="xshare", k0=2, budget=12),
        "xshare-threshold": PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9),
        "xshare-spec": PrunerConfig(policy="xshare-spec", k0=1, request_budget=4, budget=0),
        "xshare-ep": PrunerConfig(policy="xshare-ep", k0=1, rank_budget=5),
        "moe-spec": PrunerConfig(policy="moe-spec", max_experts=min(32, num_experts)),
        "moe-spec-static": PrunerConfig(
            policy="moe-spec", max_experts=min(32, num_experts), ranking="static", static_ranking_path=str(ranking)
        ),
        "lynx": PrunerConfig(policy="lynx", alpha=2.0, beta=4),
    }


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def bench_policy(cfg, inputs, num_valid, ranks, out, workspace, calls: int, replays: int) -> dict:
    """Kernel and reference timings of one config over rotating inputs, plus the sanity checks."""
    kw = dict(
        top_k=TOP_K, tokens_per_request=TOKENS_PER_REQUEST, num_valid_tokens=num_valid, expert_to_rank=ranks, layer_id=0
    )

    def kernel(i: int) -> None:
        select_keep_mask(inputs[i % len(inputs)], cfg, out=out, workspace=workspace, **kw)

    def reference(i: int) -> None:
        select_experts_mask(inputs[i % len(inputs)], cfg, **kw)

    kernel(0)
    sync()
    before = _allocated()
    for i in range(4):
        kernel(i)
    sync()
    allocated = _allocated() - before
    same = all(
        torch.equal(select_keep_mask(x, cfg, workspace=workspace, **kw), select_experts_mask(x, cfg, **kw))
        for x in inputs[:2]
    )
    kernel_us = time_graph(kernel, calls, replays)
    reference_us = time_graph(reference, calls, replays)
    return {
        "kernel_us": round(kernel_us, 2),
        "reference_us": round(reference_us, 2),
        "speedup": round(reference_us / kernel_us, 2),
        "eager_alloc_bytes": allocated,
        "masks_equal": same,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="8,32,64,128,256,512,2048", help="token counts T")
    parser.add_argument("--experts", default="64,128,256", help="expert counts E")
    parser.add_argument("--policies", default="all", help="comma-separated subset of the policies, or all")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--calls", type=int, default=50, help="calls captured per graph")
    parser.add_argument("--replays", type=int, default=30, help="timed graph replays (median)")
    parser.add_argument("--rotate", type=int, default=8, help="distinct input buffers cycled through")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--git-sha", default=None, help="recorded in the output (default: git rev-parse HEAD)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="without a GPU: run every path once on tiny shapes under TRITON_INTERPRET=1 (no timings)",
    )
    args = parser.parse_args()
    if args.smoke and not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke without a GPU needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
        args.tokens, args.experts, args.calls, args.replays, args.rotate = "8", "64", 2, 1, 2
    elif not torch.cuda.is_available():
        print("bench_selection.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"

    import triton

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke run, times are not measurements)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": args.git_sha or git_sha(),
        "dtype": args.dtype,
        "top_k": TOP_K,
        "tokens_per_request": TOKENS_PER_REQUEST,
        "calls_per_graph": args.calls,
        "replays": args.replays,
        "rotate": args.rotate,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for num_experts in [int(x) for x in args.experts.split(",")]:
        configs = bench_configs(out_dir, num_experts)
        names = list(configs) if args.policies == "all" else args.policies.split(",")
        ranks = (torch.arange(num_experts, device=device) // (num_experts // NUM_RANKS)).to(torch.int32)
        workspace = SelectionWorkspace(num_experts, device)
        out = torch.empty(num_experts, dtype=torch.bool, device=device)
        for num_tokens in [int(x) for x in args.tokens.split(",")]:
            inputs = [
                (torch.randn(num_tokens, num_experts, device=device, generator=gen) * 2).to(dtype)
                for _ in range(args.rotate)
            ]
            num_valid = torch.tensor([num_tokens], device=device, dtype=torch.int32)
            for name in names:
                row = bench_policy(configs[name], inputs, num_valid, ranks, out, workspace, args.calls, args.replays)
                row = {"E": num_experts, "T": num_tokens, "policy": name, **row}
                rows.append(row)
                print(json.dumps(row), flush=True)

    write_csv(out_dir / "selection.csv", rows)
    (out_dir / "selection.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))

    print(f"\n{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  git {meta['git_sha'][:12]}")
    print(f"{args.dtype} logits, top_k={TOP_K}, D={TOKENS_PER_REQUEST}; us per call, median of graph replays")
    header = f"{'E':>4} {'T':>5} {'policy':<17} {'kernel':>8} {'torch':>8} {'x':>6} {'alloc':>6} {'eq':>3}"
    print(header)
    for r in rows:
        print(
            f"{r['E']:>4} {r['T']:>5} {r['policy']:<17} {r['kernel_us']:>8.2f} {r['reference_us']:>8.2f} "
            f"{r['speedup']:>6.1f} {r['eager_alloc_bytes']:>6} {'ok' if r['masks_equal'] else 'NO':>3}"
        )
    return 0 if all(r["masks_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
