"""Tune SGLang's fused-MoE block configuration for pruned layer calls, one model shape per run.

In the manner of SGLang's fused-MoE tuner: per point, every configuration of a search space is timed
(inside CUDA graphs, SGLang's own kernel loaded as ``bench_moe_layer.py`` loads it) and the fastest
is kept.  A point is (T, kept): T tokens routed top-k among ``kept`` experts only, the distribution a
pruned call runs.  The kept counts default to the static bounds on |keep| of the benchmark's policy
grid (moe-spec's ``max_experts``, xshare's ``k0·T + budget``), the counts the plugin's lookup hook
(``xshare_sglang/sglang_plugin/hooks/moe_config_lookup.py``) keys its table by.  SGLang's own
choices at T and at ``T·E/kept`` are always timed too, and reported next to the winner.

Writes ``<out-dir>/triton_<x_y_z>/E=..,N=..,device_name=..,pruned.json`` (kept -> T -> config; after
every point, so a run cut short keeps what it finished) and ``tune_report.json``.  To ship a table,
copy the JSON into ``xshare_sglang/data/moe_configs/triton_<x_y_z>/`` and list it in that folder's
README.  Sized for one device call: the ``small`` space and the default points of one shape take a
few minutes on an H100/H200 (Triton compiles dominate); ``--max-minutes`` stops starting points.
Run from the repository root::

    PYTHONPATH=. python scripts/tune_pruned_moe.py --model qwen3-30b-a3b --out-dir $OUT/moe_configs

``--smoke`` runs the whole path on CPU on a tiny shape under ``TRITON_INTERPRET=1`` (no timings).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import triton

from xshare_sglang.bench.common import cpu_smoke_problem
from xshare_sglang.bench.moe_layer import MODELS, SMOKE_MODELS, SglangFusedMoE, find_sglang_root
from xshare_sglang.bench.tune_moe import SPACES, plan_points, tune_shape, write_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-30b-a3b", help=f"one of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default="32,64,128,256,512", help="token counts T")
    parser.add_argument("--phases", default="decode", help="phases whose policy grid gives the kept counts")
    parser.add_argument("--draft-tokens", type=int, default=4, help="D of verify batches")
    parser.add_argument("--kept", default=None, help="comma-separated kept counts instead of the grid's bounds")
    parser.add_argument("--space", default="small", choices=sorted(SPACES), help="search space")
    parser.add_argument("--calls", type=int, default=4, help="calls captured per graph")
    parser.add_argument("--replays", type=int, default=10, help="timed graph replays (median)")
    parser.add_argument("--max-minutes", type=float, default=7.0, help="start no new point after this")
    parser.add_argument("--sglang-root", default=None, help="folder of the sglang package holding the kernel file")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "tune_out"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pdl", action="store_true", help="SGLang's kernel without programmatic dependent launch")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, TRITON_INTERPRET=1, no timings")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    if args.smoke and not cuda:
        problem = cpu_smoke_problem()
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        shape, dtype, space = SMOKE_MODELS["tiny"], torch.float16, SPACES["smoke"]
        args.tokens, args.kept, args.calls, args.replays = "4", args.kept or "4", 1, 1
    elif not cuda:
        print("tune_pruned_moe.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        if args.model not in MODELS:
            print(f"unknown model {args.model}; models: {', '.join(MODELS)}", file=sys.stderr)
            return 2
        shape, dtype, space = MODELS[args.model], torch.bfloat16, SPACES[args.space]
    root = find_sglang_root(args.sglang_root)
    if root is None:
        print("SGLang's fused_moe_triton_kernels.py not found (--sglang-root, sglang, .sgl/sglang)", file=sys.stderr)
        return 2
    backend = SglangFusedMoE(root)
    tokens = [int(t) for t in args.tokens.split(",")]
    kept = [int(k) for k in args.kept.split(",")] if args.kept else None
    points = plan_points(shape, tokens, args.phases.split(","), args.draft_tokens, kept)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke run, times are not measurements)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sglang_kernel": f"{backend.version} ({root})",
        "shape": shape.name,
        "space": args.space if not args.smoke else "smoke",
        "points": points,
        "command": " ".join(sys.argv),
    }
    print(f"{meta['device']}: {shape.name}, {len(points)} points (T, kept): {points}", flush=True)
    written: list[str] = []

    def save(result) -> None:
        if result.table:
            path = write_table(out_dir, backend, shape, result.table)
            if str(path) not in written:
                written.append(str(path))
        report = {"meta": {**meta, "files": written, "elapsed_s": round(time.monotonic() - t0, 1)}}
        report["points"] = result.points
        (out_dir / "tune_report.json").write_text(json.dumps(report, indent=2) + "\n")

    backend.pdl.value = not args.no_pdl
    result = tune_shape(
        shape,
        backend,
        points,
        space=space,
        dtype=dtype,
        calls=args.calls,
        replays=args.replays,
        deadline=t0 + 60 * args.max_minutes,
        seed=args.seed,
        on_point=save,
    )
    save(result)
    done = sum(1 for p in result.points if "skipped" not in p)
    print(f"{done}/{len(points)} points tuned in {time.monotonic() - t0:.0f} s; files: {written}", flush=True)
    return 0 if done else 1


if __name__ == "__main__":
    sys.exit(main())
