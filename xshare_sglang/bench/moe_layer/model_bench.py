"""One model shape timed on the device: :class:`ModelBench` checks the backends, then times the
baseline and every pruning setting at each (phase, T) and builds the rows with their targets;
:func:`add_layer_bench_arguments` adds the flags of the scripts that use it."""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from ... import PrunerConfig, route_within
from ...kernels import SelectionWorkspace
from ..common import count_launches, time_graph
from .backends import check_alignment, check_backend
from .case import Case, PrunedLayer, build_case
from .probes import _bound, roofline_us
from .reference import MOE_TOLERANCE, _same_routing, activated_experts, reference_moe, rel_err, route_topk, routed_slots
from .report import _fmt, _round
from .sglang_fused import SglangFusedMoE
from .shapes import Shape, policy_grid, policy_label
from .trace_routing import TraceRouting

SPEEDUP_TARGET = 0.8  # realized speed-up >= 80% of the activated-experts ratio ...
SPEEDUP_TARGET_MIN_T = 32  # ... for T >= 32
SELECTION_TARGET = 0.03  # selection <= 3% of the pruned layer's time ...
SELECTION_TARGET_MAX_T = 512  # ... for T <= 512
ROOFLINE_TARGET = 1.5  # pruned layer time <= 1.5x its roofline (issue 37) ...
ROOFLINE_TARGET_MIN_T = 32  # ... for T >= 32


class ModelBench:
    """One model shape on the device: its expert weights, the MoE backend that passed its check, its rows."""

    def __init__(self, shape: Shape, args, backends: list, device, dtype) -> None:
        self.shape, self.args, self.device, self.dtype = shape, args, device, dtype
        self.gen = torch.Generator(device=device).manual_seed(args.seed)
        self.cpu_gen = torch.Generator().manual_seed(args.seed)
        e, h, i = shape.local_experts, shape.hidden, shape.intermediate
        self.weights = [
            (
                (torch.randn(e, 2 * i, h, generator=self.gen, device=device) * h**-0.5).to(dtype),
                (torch.randn(e, h, i, generator=self.gen, device=device) * i**-0.5).to(dtype),
            )
            for _ in range(args.weight_copies)
        ]
        self.info = {
            "note": shape.note,
            "expert_bytes": shape.expert_bytes,
            "local_experts": e,
            "checks": {},
            "errors": [],
        }
        if not check_alignment(shape, device, self.gen):
            raise RuntimeError(f"{shape.name}: align_tokens differs from align_reference")
        self.info["checks"]["align"] = "ok"
        self.backend = None
        for backend in backends:
            ok = self._check(backend)
            if ok and self.backend is None:
                self.backend = backend
        if self.backend is None:
            raise RuntimeError(f"{shape.name}: no MoE backend passed its check: {self.info['checks']}")
        self.info["backend"] = self.backend.source
        self.workspace = SelectionWorkspace(shape.num_experts, device)
        #: measured bf16 matmul TFLOP/s (set by the script); None leaves the roofline columns empty
        self.peak_tflops: float | None = None

    def _check(self, backend) -> bool:
        """Check one backend against the reference; SGLang's kernel is retried without PDL if it fails."""
        checks = self.info["checks"]
        try:
            err = check_backend(backend, self.shape, self.weights, self.device, self.dtype, self.gen)
        except Exception as exc:
            if not (isinstance(backend, SglangFusedMoE) and backend.pdl.value):
                checks[backend.name] = f"failed: {type(exc).__name__}: {exc}"
                return False
            backend.pdl.value = False  # programmatic dependent launch off, then once more
            checks["sglang_pdl"] = f"off after {type(exc).__name__}: {exc}"
            try:
                err = check_backend(backend, self.shape, self.weights, self.device, self.dtype, self.gen)
            except Exception as exc2:
                checks[backend.name] = f"failed: {type(exc2).__name__}: {exc2}"
                return False
        checks[backend.name] = f"rel err {err:.2e}" + ("" if err <= MOE_TOLERANCE else f" > {MOE_TOLERANCE}")
        return err <= MOE_TOLERANCE

    def _error(self, where: str, exc: Exception) -> None:
        message = f"{where}: {type(exc).__name__}: {exc}"
        self.info["errors"].append(message)
        print(f"[{self.shape.name}] ERROR {message}", flush=True)

    def moe(self, i: int, x, ids, w, config: dict | None = None):
        """The MoE of layer call i (weight copies alternate between calls); ``config``: block sizes
        other than SGLang's choice (SGLang's kernel only)."""
        w13, w2 = self.weights[i % len(self.weights)]
        if config is None:
            return self.backend(x, ids, w, w13, w2, 0)
        return self.backend(x, ids, w, w13, w2, 0, config=config)

    def plugin_config(self, case: Case, cfg: PrunerConfig) -> tuple[dict | None, str]:
        """With ``--pruned-config plugin|both`` and SGLang's kernel: the config the plugin's hook gives
        this pruned row (from the policy's static bound on |keep|); else (None, SGLang's label)."""
        mode = getattr(self.args, "pruned_config", "sglang")
        own = self.backend.config_label(case.tokens, self.shape)
        if mode == "sglang" or not isinstance(self.backend, SglangFusedMoE):
            return None, own
        from ...sglang_plugin.pruned_moe_config import keep_bound

        bound = keep_bound(cfg, case.tokens, case.tokens_per_request, self.shape.num_experts)
        config, source = self.backend.pruned_config(case.tokens, self.shape, bound)
        return config, self.backend.label(config, source)

    def floor_us(self, activated: float, bandwidth_gbps: float) -> float:
        return activated * self.shape.expert_bytes / (bandwidth_gbps * 1e3)

    def run(self, phase: str, tokens: int, source: TraceRouting, bandwidth_gbps: float) -> list[dict]:
        """Every policy of the grid at one (phase, T): checks, then baseline / pruned / selection timings."""
        shape, args = self.shape, self.args
        case = build_case(
            shape,
            phase,
            tokens,
            args.draft_tokens,
            source,
            args.rotate,
            self.device,
            self.dtype,
            self.gen,
            self.cpu_gen,
        )
        rot = len(case.xs)
        everything = torch.ones(shape.num_experts, dtype=torch.bool, device=self.device)
        ref_route = route_within(case.logits[0], everything, top_k=shape.top_k, scoring=shape.scoring)
        base_check = _same_routing(case.logits[0], *case.baseline_routes[0], *ref_route)

        def torch_topk(i: int) -> None:
            ids, w = route_topk(case.logits[i % rot], shape.top_k, shape.scoring)
            self.moe(i, case.xs[i % rot], ids, w)

        # the baseline: the unpruned layer as a user runs it, one fused top-k (the kernels' policy none:
        # one launch, as SGLang's sgl_kernel top-k, which the device image lacks), the alignment, the MoE
        fused_topk = PrunedLayer(case, PrunerConfig(policy="none"), self.workspace)

        def baseline(i: int) -> None:
            ids, w = fused_topk.route(i % rot)
            self.moe(i, case.xs[i % rot], ids, w)

        try:
            base_us = time_graph(baseline, args.calls, args.replays)
            torch_us = time_graph(torch_topk, args.calls, args.replays)
        except Exception as exc:  # recorded; the other cases still run
            self._error(f"{phase} T={tokens} baseline", exc)
            return []
        base_check = base_check and _same_routing(case.logits[0], *fused_topk.route(0), *ref_route)
        launches = {"baseline": count_launches(baseline), "baseline_torch_topk": count_launches(torch_topk)}
        rows = []
        for cfg in policy_grid(shape, phase, args.smoke):
            if args.policies != "all" and cfg.policy not in args.policies:
                continue
            try:
                row = self._policy_row(case, cfg, base_us, base_check, bandwidth_gbps, launches)
                row["baseline_torch_topk_us"] = round(torch_us, 2)
                row["speedup_torch_topk"] = round(torch_us / row["pruned_us"], 3)
                rows.append(row)
            except Exception as exc:
                self._error(f"{phase} T={tokens} {cfg.policy} {policy_label(cfg)}", exc)
                continue
            print(_progress_line(rows[-1]), flush=True)
        base_again = time_graph(baseline, args.calls, args.replays) if self.device.type == "cuda" else base_us
        for row in rows:
            row["baseline_repeat_us"] = round(base_again, 2)
        return rows

    def _policy_row(
        self, case: Case, cfg: PrunerConfig, base_us: float, base_check: bool, bandwidth: float, launches: dict
    ) -> dict:
        shape, args, rot = self.shape, self.args, len(case.xs)
        layer = PrunedLayer(case, cfg, self.workspace)
        check = layer.check(0)
        out = self.moe(0, case.xs[0], check["ids"], check["w"])
        moe_err = rel_err(out, reference_moe(case.xs[0], check["ids"], check["w"], *self.weights[0], 0))
        routes = [check["ids"]] + [layer.route(j)[0].clone() for j in range(1, rot)]
        acts = [activated_experts(ids, 0, shape.local_experts) for ids in routes]
        act = statistics.mean(acts)
        slots = statistics.mean(routed_slots(ids, 0, shape.local_experts) for ids in routes)
        roof_base = roof_pruned = None
        if self.peak_tflops:
            roof_base = roofline_us(case.baseline_activated, case.baseline_slots, shape, bandwidth, self.peak_tflops)
            roof_pruned = roofline_us(act, slots, shape, bandwidth, self.peak_tflops)

        plugin_cfg, pruned_label = self.plugin_config(case, cfg)
        if plugin_cfg is not None:  # the plugin's config must give the same output
            out_plugin = self.moe(0, case.xs[0], check["ids"], check["w"], config=plugin_cfg)
            ref = reference_moe(case.xs[0], check["ids"], check["w"], *self.weights[0], 0)
            moe_err = max(moe_err, rel_err(out_plugin, ref))

        def pruned_with(config: dict | None):
            def pruned(i: int) -> None:
                ids, w = layer.route(i % rot)
                self.moe(i, case.xs[i % rot], ids, w, config=config)

            return pruned

        pruned_us = time_graph(pruned_with(plugin_cfg), args.calls, args.replays)
        pruned_sglang_us = None
        if plugin_cfg is not None and getattr(args, "pruned_config", "sglang") == "both":
            pruned_sglang_us = time_graph(pruned_with(None), args.calls, args.replays)
        sel_us = time_graph(lambda i: layer.selection_only(i % rot), args.calls, args.replays)
        speedup, share = base_us / pruned_us, sel_us / pruned_us
        ideal = case.baseline_activated / act if act > 0 else None  # None: no local expert left to read
        realized = speedup / ideal if ideal else None
        measured = self.device.type == "cuda"  # the CPU smoke run's times are no measurements
        checks_ok = check["masks_equal"] and check["routing_equal"] and base_check and moe_err <= MOE_TOLERANCE
        tokens = case.tokens
        return {
            "model": shape.name,
            "phase": case.phase,
            "T": tokens,
            "D": case.tokens_per_request,
            "policy": cfg.policy,
            "settings": policy_label(cfg),
            "backend": self.backend.name,
            "moe_config": self.backend.config_label(tokens, shape),
            "moe_config_pruned": pruned_label,
            "kept": check["kept"],
            "activated_baseline": round(case.baseline_activated, 2),
            "activated_pruned": round(act, 2),
            "baseline_us": round(base_us, 2),
            "pruned_us": round(pruned_us, 2),
            "pruned_sglang_config_us": _round(pruned_sglang_us, 2),
            "config_gain": _round(pruned_sglang_us / pruned_us if pruned_sglang_us else None, 3),
            "selection_us": round(sel_us, 2),
            "floor_baseline_us": round(self.floor_us(case.baseline_activated, bandwidth), 2),
            "floor_pruned_us": round(self.floor_us(act, bandwidth), 2),
            "slots_baseline": round(case.baseline_slots, 2),
            "slots_pruned": round(slots, 2),
            "roofline_baseline_us": _round(roof_base, 2),
            "roofline_pruned_us": _round(roof_pruned, 2),
            "baseline_over_roofline": _round(base_us / roof_base if roof_base else None, 3),
            "pruned_over_roofline": _round(pruned_us / roof_pruned if roof_pruned else None, 3),
            "pruned_bound": None if roof_pruned is None else _bound(act, slots, shape, bandwidth, self.peak_tflops),
            "speedup": round(speedup, 3),
            "ideal": _round(ideal, 3),
            "realized_over_ideal": _round(realized, 3),
            "selection_share": round(share, 4),
            "target_speedup": (
                realized >= SPEEDUP_TARGET
                if measured and realized is not None and tokens >= SPEEDUP_TARGET_MIN_T
                else None
            ),
            "target_selection": share <= SELECTION_TARGET if measured and tokens <= SELECTION_TARGET_MAX_T else None,
            "target_roofline": (
                pruned_us <= ROOFLINE_TARGET * roof_pruned
                if measured and roof_pruned and tokens >= ROOFLINE_TARGET_MIN_T
                else None
            ),
            "baseline": "fused top-k (policy none)",
            "launches_baseline": launches["baseline"],
            "launches_baseline_torch_topk": launches["baseline_torch_topk"],
            "launches_pruned": count_launches(pruned_with(plugin_cfg)),
            "masks_equal": check["masks_equal"],
            "routing_equal": check["routing_equal"] and base_check,
            "moe_rel_err": round(moe_err, 6),
            "pruned_le_baseline": all(a <= b for a, b in zip(acts, case.baseline_counts, strict=True)),
            "checks_ok": bool(checks_ok),
        }

    def close(self) -> None:
        self.weights.clear()
        self.workspace = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _progress_line(r: dict) -> str:
    return (
        f"[{r['model']}] {r['phase']:6} T={r['T']:<4} {r['policy']:<11} {r['settings']:<26} "
        f"act {r['activated_baseline']:6.1f}->{r['activated_pruned']:6.1f}  base {r['baseline_us']:8.1f}  "
        f"pruned {r['pruned_us']:8.1f}  x{r['speedup']:5.2f} (ideal {_fmt(r['ideal'], '5.2f')})  "
        f"sel {r['selection_us']:6.1f} ({100 * r['selection_share']:4.1f}%)  "
        f"{'ok' if r['checks_ok'] else 'CHECK FAILED'}"
    )


def add_layer_bench_arguments(parser: argparse.ArgumentParser, *, calls: int, case: str) -> None:
    """The flags every script that times MoE layers with :class:`ModelBench` takes (this one and
    ``bench_selection.py``): MoE backend, logits, graph timing, time limit, outputs, smoke mode."""
    parser.add_argument("--backend", default="auto", choices=["auto", "sglang", "grouped_mm"], help="fused MoE")
    parser.add_argument("--sglang-root", default=None, help="folder of the sglang package holding the kernel file")
    parser.add_argument("--trace", default="gemma", choices=["gemma", "gptoss"], help="route trace for the logits")
    parser.add_argument("--calls", type=int, default=calls, help="calls captured per graph")
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays (median)")
    parser.add_argument("--rotate", type=int, default=8, help="distinct inputs cycled through")
    parser.add_argument("--weight-copies", type=int, default=2, help="expert weight copies, alternated per call")
    parser.add_argument("--max-minutes", type=float, default=8.5, help=f"start no new {case} after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--git-sha", default=None, help="recorded in the output (default: git rev-parse HEAD)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="without a GPU: every path once on tiny shapes under TRITON_INTERPRET=1, checked (no timings)",
    )
