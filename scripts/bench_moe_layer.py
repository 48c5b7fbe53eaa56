"""One MoE layer at decode and verify shapes: baseline top-k vs pruned routing, inside CUDA graphs.

For each model shape (Qwen3-30B-A3B, GPT-OSS-120B with bf16 stand-in weights, one expert-parallel
rank of DeepSeek-V3), each token count T and each phase (decode: T requests of one token; verify:
T = R x D tokens, R requests of D draft tokens), three things are captured in CUDA graphs of
``--calls`` consecutive layer calls that cycle through ``--rotate`` pre-built inputs (hidden states
and router logits) and alternate between ``--weight-copies`` copies of the expert weights:

* the baseline layer: top-k routing of the router logits, then the fused MoE;
* the pruned layer: the pruner's fused selection kernel (``prune_route``: keep mask and routing in
  place of the top-k, with ``-1`` in slots a token cannot fill), then the fused MoE, which never reads
  an expert no token was sent to;
* the selection alone (the three pruner kernels above).

Each graph is replayed ``--replays`` times and timed with CUDA events; a figure is the median replay
time over the calls per graph.  The device's copy bandwidth is measured in the same run, so every
row also gets the bandwidth floor ``activated experts x bytes per expert / bandwidth``; a bf16 matmul
(``--matmul-size``) measures the compute peak, and each layer is set against its roofline
``max(weight bytes / bandwidth, FLOPs / peak)`` (FLOPs: ``6·H·I`` per routed slot).  Before
timing, every row is checked: kernel keep masks equal the torch reference
(``select_experts_mask``), the routing equals ``route_within`` (substitution) under that mask, and
the MoE output equals a float32 reference loop over the activated experts with the same routing.

The MoE is SGLang 0.5.23's own fused-MoE Triton kernel (``invoke_fused_moe_kernel``, loaded from
SGLang's source file, see ``--sglang-root``) when it loads and passes its check, else
``torch._grouped_mm``; ``--backend`` forces one.  Router logits come from the shipped route traces
(see ``TraceRouting``).  Run on a GPU node from the repository root::

    PYTHONPATH=. python scripts/bench_moe_layer.py --out-dir bench_out/moe

Writes ``moe_layer.csv``, ``moe_layer.json`` (rows plus device, versions, backend, bandwidth, git
SHA) and ``moe_layer.md`` (the tables) to ``--out-dir``, after every model, and prints progress.
``--smoke`` runs every path on CPU on tiny shapes under ``TRITON_INTERPRET=1`` (checks, no timings).
``--guard-repeats N`` times every case N times and writes ``guard_table.md`` / ``.json``: per case, the
decision the start-up guard (``--moe-pruner-guard auto``) would take from those timings.
docs/benchmarks.md says how the inputs are built and how to run this on a lent GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xshare_sglang.bench.common import cpu_smoke_problem, git_sha
from xshare_sglang.bench.moe_layer import (
    MODELS,
    SMOKE_MODELS,
    ModelBench,
    SglangFusedMoE,
    TraceRouting,
    add_layer_bench_arguments,
    guard_markdown,
    guard_rows,
    measure_bandwidth,
    measure_matmul_tflops,
    policy_grid,
    resolve_backends,
    write_outputs,
)
from xshare_sglang.break_even import DEFAULT_MARGIN


def write_guard(out_dir: Path, rows: list[dict], margin: float) -> None:
    (out_dir / "guard_table.md").write_text(guard_markdown(rows, margin))
    (out_dir / "guard_table.json").write_text(json.dumps({"margin": margin, "rows": rows}, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default="8,16,32,64,128,256,512", help="token counts T (verify: T = R x D)")
    parser.add_argument("--phases", default="decode,verify", help="decode and/or verify")
    parser.add_argument("--draft-tokens", type=int, default=4, help="D, tokens per request in verify batches")
    parser.add_argument("--policies", default="all", help="comma-separated policy names to keep, or all")
    parser.add_argument("--bandwidth-gib", type=float, default=2.0, help="buffer size of the copy-bandwidth test")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the [n, n] @ [n, n] bf16 peak test")
    parser.add_argument(
        "--pruned-config",
        default="sglang",
        choices=["sglang", "plugin", "both"],
        help="fused-MoE config of the pruned layer (SGLang's kernel): SGLang's choice at T; the plugin's "
        "(hooks/moe_config_lookup.py: tuned (T, |keep|) file, else SGLang's table at T*E/|keep|); or both, "
        "timed one after the other (pruned_us: the plugin's, pruned_sglang_config_us: SGLang's)",
    )
    parser.add_argument(
        "--guard-repeats",
        type=int,
        default=0,
        help="time every case this many times and write the start-up guard's decision per case "
        "(guard_table.md / .json); 0: off",
    )
    parser.add_argument("--guard-margin", type=float, default=DEFAULT_MARGIN, help="the guard's margin, in [0, 1)")
    add_layer_bench_arguments(parser, calls=8, case="(model, phase, T)")
    args = parser.parse_args()
    if args.guard_repeats < 0 or not 0.0 <= args.guard_margin < 1.0:
        parser.error("--guard-repeats must be >= 0 and --guard-margin in [0, 1)")
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    if args.smoke and not cuda:
        problem = cpu_smoke_problem()
        if problem is not None:
            print(problem, file=sys.stderr)
            return 2
        models = SMOKE_MODELS
        if args.models == parser.get_default("models"):
            args.models = ",".join(SMOKE_MODELS)
        if args.tokens == parser.get_default("tokens"):
            args.tokens = "1,7"
        args.calls, args.replays, args.rotate, args.weight_copies, args.bandwidth_gib = 1, 1, 2, 2, 1 / 128
        args.matmul_size = 64
        dtype = torch.float16  # bf16 tl.dot gave garbage under the interpreter (Triton 3.8); fp16 is right
    elif not cuda:
        print("bench_moe_layer.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        models = {**MODELS, **SMOKE_MODELS}
        dtype = torch.bfloat16
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.phases = [p for p in args.phases.split(",") if p]
    if args.policies != "all":
        args.policies = set(args.policies.split(","))
    unknown = [m for m in args.models.split(",") if m not in models]
    if unknown or any(p not in ("decode", "verify") for p in args.phases):
        print(f"unknown model or phase: {unknown or args.phases}; models: {', '.join(models)}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    backends, notes = resolve_backends(args.backend, args.sglang_root)
    for note in notes:
        print(f"backend: {note}", flush=True)
    if not backends:
        print(f"no MoE backend available for --backend {args.backend}", file=sys.stderr)
        return 2
    source = TraceRouting(args.trace, seed=args.seed)
    bandwidth = measure_bandwidth(device, int(args.bandwidth_gib * 2**30))
    peak_tflops = float(f"{measure_matmul_tflops(device, dtype, args.matmul_size):.4g}")  # rows use the recorded value
    sglang = next((b for b in backends if isinstance(b, SglangFusedMoE)), None)
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke run, times are not measurements)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sglang_kernel": f"{sglang.version} ({sglang.root})" if sglang else "not loaded",
        "backend_choice": args.backend,
        "backend_notes": notes,
        "git_sha": args.git_sha or git_sha(),
        "dtype": str(dtype).removeprefix("torch."),
        "bandwidth_gbps": round(bandwidth, 1),
        "matmul_tflops": peak_tflops,
        "pruned_config": args.pruned_config,
        "trace": f"{source.name} ({source.model}, top-{source.source_top_k} listed)",
        "rho": source.rho,
        "trace_sibling_overlap": round(source.sibling_overlap, 4),
        "calls_per_graph": args.calls,
        "replays": args.replays,
        "rotate": args.rotate,
        "weight_copies": args.weight_copies,
        "draft_tokens": args.draft_tokens,
        "tokens": args.tokens,
        "phases": args.phases,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "models": {},
        "skipped": [],
    }
    print(
        f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  sglang kernel {meta['sglang_kernel']}\n"
        f"copy bandwidth {bandwidth:.0f} GB/s; bf16 matmul {peak_tflops:.4g} TFLOP/s; "
        f"logits from trace {meta['trace']}, rho={source.rho:.2f} "
        f"(consecutive-token overlap {source.sibling_overlap:.3f})",
        flush=True,
    )
    planned = sum(
        len([c for c in policy_grid(models[m], ph, args.smoke) if args.policies == "all" or c.policy in args.policies])
        for m in args.models.split(",")
        for ph in args.phases
    ) * len(args.tokens)
    print(f"plan: {planned} rows over models {args.models}, phases {args.phases}, T {args.tokens}", flush=True)
    rows: list[dict] = []
    guard: list[dict] = []
    deadline = t0 + 60 * args.max_minutes
    for name in args.models.split(","):
        try:
            bench = ModelBench(models[name], args, backends, device, dtype)
        except Exception as exc:  # recorded; the other models still run
            meta["models"][name] = {"errors": [f"setup: {type(exc).__name__}: {exc}"]}
            print(f"[{name}] ERROR setup: {type(exc).__name__}: {exc}", flush=True)
            continue
        bench.peak_tflops = peak_tflops
        meta["models"][name] = bench.info
        print(f"[{name}] backend checks: {bench.info['checks']}; timing with {bench.backend.name}", flush=True)
        for phase in args.phases:
            for tokens in args.tokens:
                if time.monotonic() > deadline:
                    meta["skipped"].append(f"{name} {phase} T={tokens}")
                    print(f"[{name}] {phase} T={tokens}: skipped, past --max-minutes", flush=True)
                    continue
                started = time.monotonic()
                runs = [bench.run(phase, tokens, source, bandwidth) for _ in range(max(1, args.guard_repeats))]
                rows += runs[0]
                if args.guard_repeats:
                    guard += guard_rows(runs, args.guard_margin)
                    write_guard(out_dir, guard, args.guard_margin)
                print(
                    f"[{name}] {phase} T={tokens} done in {time.monotonic() - started:.1f} s "
                    f"({time.monotonic() - t0:.0f} s so far)",
                    flush=True,
                )
                write_outputs(out_dir, rows, meta)
        bench.close()
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_outputs(out_dir, rows, meta)
    errors = [e for info in meta["models"].values() for e in info["errors"]]
    met_speed = [r["target_speedup"] for r in rows if r["target_speedup"] is not None]
    met_sel = [r["target_selection"] for r in rows if r["target_selection"] is not None]
    print(
        f"\n{len(rows)} rows in {meta['elapsed_s']:.0f} s; checks ok {sum(r['checks_ok'] for r in rows)}/{len(rows)}; "
        f"speed-up target met {sum(met_speed)}/{len(met_speed)}; selection target met {sum(met_sel)}/{len(met_sel)}; "
        f"{len(errors)} errors; files in {out_dir}",
        flush=True,
    )
    passed = not errors and all(r["checks_ok"] and (r["pruned_le_baseline"] or not args.smoke) for r in rows)
    return 0 if rows and passed else 1


if __name__ == "__main__":
    sys.exit(main())
