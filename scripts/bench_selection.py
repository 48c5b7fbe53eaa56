"""Selection cost of every policy per MoE layer call, against SGLang's top-k and the pruned MoE layer.

For each model shape (``--models``), token count T (``--tokens``) and policy this measures, in one
run and inside CUDA graphs (``_bench_common.time_graph``: median of graph replays, per call):

* ``launches``: Triton kernel launches of one eager ``prune_route`` call (the launcher is wrapped and
  counted); on CUDA also ``device_kernels``, every kernel torch's profiler sees in that call (Triton or
  not: a stray copy or fill would show here);
* ``selection_us``: ``prune_route`` alone, with preallocated outputs, workspace and per-layer metrics
  row, as the serving plugin calls it (keep mask and routing in place of SGLang's top-k);
* ``topk_us``: the unpruned top-k it replaces, as SGLang's torch-native path computes it (softmax or
  sigmoid, top-k, renormalization; for DeepSeek-V3 the biased group-limited top-k).  SGLang's CUDA
  path uses ``sgl_kernel`` ops that a bare GPU node does not have, so this is a stand-in, recorded as
  ``topk_source``; ``none_us`` (``prune_route`` with policy ``none``, a one-launch fused top-k) is the
  closer stand-in for a fused CUDA top-k;
* ``layer_us``: the pruned layer, ``prune_route`` then the fused MoE of ``bench_moe_layer.py``
  (SGLang's Triton fused-MoE kernel when its source is found, else ``torch._grouped_mm``);
* ``share`` = ``selection_us / layer_us`` (goal: at most 3% for T <= 256, then 1%);
* with ``--pdl`` (a GPU of compute capability 9.0+): ``selection_pdl_us`` and ``none_pdl_us``, the same
  calls launched as programmatic dependents (``prune_route(..., enable_pdl=True)``), and
  ``pdl_equal``: their ids, weights and mask equal the plain launch's bit for bit, eagerly and in
  CUDA-graph replays, on two of the rotated inputs (part of the row's check); above one program also
  ``reset_pdl_us``, the dependent call behind the counter reset launch every such call made before
  the kernels cleared their own counters (a one-program ``fill_kernel`` of the workspace's counters),
  so that the row shows what dropping that launch saved.

Every row is first checked on one of its inputs: the kernel's keep mask and ids equal the torch
reference (``policies.prune_route.prune_route``) exactly, the weights within 2e-6 + 2e-5 relative,
the call's metrics equal the reference's (``metrics_equal``); eager calls allocate nothing on the
device.  A failed check marks the row and the script exits 1.

Shapes: Qwen3-30B-A3B (E=128, top-8, softmax), GPT-OSS-120B (E=128, top-4, softmax) and DeepSeek-V3
(E=256, top-8, sigmoid with correction bias, 8 groups of which 4 are kept, routed scaling 2.5; the
MoE layer is one rank of 8-way expert parallelism).  Router logits come from the shipped route
traces (``TraceRouting`` in ``bench/moe_layer/``).  Decode policies run on T one-token requests;
the verify policies (xshare-spec, moe-spec per request) on T/4 requests of 4 draft tokens.

Run on a GPU node from the repository root (no install needed)::

    PYTHONPATH=. python scripts/bench_selection.py --out-dir bench_out/selection

Writes ``selection.csv``, ``selection.json`` (rows plus device, versions, MoE backend and git SHA)
and ``selection.md`` to ``--out-dir``.  ``--smoke`` runs every path once on tiny shapes on the CPU
under ``TRITON_INTERPRET=1`` (checks and launch counts; its times are no measurements).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xshare_sglang import PrunerConfig
from xshare_sglang.bench.common import git_sha, sync, time_graph, write_csv
from xshare_sglang.bench.moe_layer import (
    MODELS,
    SMOKE_MODELS,
    ModelBench,
    Shape,
    TraceRouting,
    add_layer_bench_arguments,
    build_case,
    resolve_backends,
)
from xshare_sglang.kernels import SelectionWorkspace, prune_route
from xshare_sglang.kernels.launch import Outputs, call_spec
from xshare_sglang.kernels.plan import plan_call
from xshare_sglang.policies.call import RouterSpec, RoutingCall
from xshare_sglang.policies.prune_route import prune_route as prune_route_reference

WEIGHT_RTOL, WEIGHT_ATOL = 2e-5, 2e-6  # routing weights, kernel vs reference (as the kernel tests)
SHARE_GOAL = 0.03  # selection <= 3% of the pruned layer ...
SHARE_GOAL_MAX_T = 256  # ... for T <= 256
SHARE_STRETCH = 0.01  # then 1%
DRAFT_TOKENS = 4  # tokens per request of the verify policies
NUM_RANKS = 8  # xshare-ep's ranks when the shape is not expert-parallel itself


@dataclass(frozen=True)
class Model:
    """A benchmarked shape: the MoE layer (``moe_layer.Shape``) and the model's router."""

    name: str
    shape: Shape
    router: RouterSpec
    bias: bool = False  # a DeepSeek-V3 style correction bias


MODEL_ROUTERS = {
    "qwen3-30b-a3b": Model("qwen3-30b-a3b", MODELS["qwen3-30b-a3b"], RouterSpec(8, "softmax")),
    "gpt-oss-120b": Model("gpt-oss-120b", MODELS["gpt-oss-120b"], RouterSpec(4, "softmax")),
    "deepseek-v3": Model(
        "deepseek-v3",
        MODELS["deepseek-v3-ep8"],
        RouterSpec(8, "sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5),
        bias=True,
    ),
}
SMOKE_ROUTERS = {
    "tiny": Model("tiny", SMOKE_MODELS["tiny"], RouterSpec(2, "softmax")),
    "tiny-grouped": Model(
        "tiny-grouped",
        SMOKE_MODELS["tiny-ep"],
        RouterSpec(4, "sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5),
        bias=True,
    ),
}


def policy_configs(num_experts: int, top_k: int, ranking_dir: Path) -> dict[str, tuple[PrunerConfig, str]]:
    """One typical setting per policy (budgets scale with E / 128) and the phase it runs in."""

    def scaled(budget: int) -> int:
        return max(1, round(budget * num_experts / 128))

    counts = [[float((e * 7919) % 101) for e in range(num_experts)]]
    ranking = ranking_dir / f"ranking_{num_experts}.json"
    ranking.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
    # co-activation counts: each expert's own count on the diagonal, pairs fewer (synthetic, fixed)
    pairs = [
        [counts[0][i] if i == j else float((i * 31 + j * 17) % 23) for j in range(num_experts)]
        for i in range(num_experts)
    ]
    coactivation = ranking_dir / f"coactivation_{num_experts}.json"
    coactivation.write_text(
        json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts, "coactivation": [pairs]})
    )
    return {
        "oea": (PrunerConfig(policy="oea", k0=1), "decode"),
        "xshare": (PrunerConfig(policy="xshare", k0=1, budget=scaled(16)), "decode"),
        "xshare-threshold": (PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9), "decode"),
        "xshare-ep": (PrunerConfig(policy="xshare-ep", k0=1, rank_budget=max(1, scaled(32) // NUM_RANKS)), "decode"),
        "moe-spec": (PrunerConfig(policy="moe-spec", max_experts=scaled(32)), "decode"),
        "moe-spec-static": (
            PrunerConfig(policy="moe-spec", max_experts=scaled(32), ranking="static", static_ranking_path=str(ranking)),
            "decode",
        ),
        "moe-spec-coverage": (PrunerConfig(policy="moe-spec", max_experts=scaled(32), ranking="coverage"), "decode"),
        "moe-spec-coact": (
            PrunerConfig(
                policy="moe-spec", max_experts=scaled(32), ranking="coactivation", static_ranking_path=str(coactivation)
            ),
            "decode",
        ),
        "lynx": (PrunerConfig(policy="lynx", alpha=2.0, beta=4), "decode"),
        "xshare-spec": (PrunerConfig(policy="xshare-spec", k0=1, request_budget=2, budget=0), "verify"),
        "moe-spec-request": (PrunerConfig(policy="moe-spec", max_experts=top_k, scope="request"), "verify"),
    }


# ------------------------------------------------------------------------------ SGLang's top-k (torch)
def sglang_native_topk(
    logits: torch.Tensor, router: RouterSpec, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unpruned routing in the torch ops of SGLang's native path: ids int32 [T, k], weights float32.

    Softmax models: softmax, top-k, renormalize.  Sigmoid models with groups and a bias (DeepSeek-V3):
    sigmoid scores, choice key score + bias, each group ranked by the sum of its two best keys, the best
    ``topk_group`` groups kept, top-k of the keys there, weights = the picks' scores renormalized, times
    the routed scaling factor.
    """
    x = logits.float()
    if router.scoring == "softmax":
        scores = torch.softmax(x, dim=-1)
        choice = scores
    else:
        scores = torch.sigmoid(x)
        choice = scores + bias if bias is not None else scores
    if router.grouped:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, router.num_expert_group, -1)
        group_key = grouped.topk(2, dim=-1).values.sum(-1) if bias is not None else grouped.max(-1).values
        groups = group_key.topk(router.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_key).scatter_(1, groups, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = choice.topk(router.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if router.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if router.routed_scaling_factor is not None:
        weights = weights * router.routed_scaling_factor
    return ids.to(torch.int32), weights


# ----------------------------------------------------------------------------------------- counting
def count_launches(call) -> tuple[int, list[str]]:
    """Triton launches of ``call()`` (the JIT launcher's ``run`` wrapped for the duration)."""
    from xshare_sglang.kernels import jit

    launcher = type(jit.select_kernel)
    original = launcher.run
    names: list[str] = []

    def counting(self, *args, **kwargs):
        names.append(getattr(self, "__name__", str(self)))
        return original(self, *args, **kwargs)

    launcher.run = counting
    try:
        call()
        sync()
    finally:
        launcher.run = original
    return len(names), names


def count_device_kernels(call) -> int | None:
    """Every device kernel torch's profiler sees in ``call()`` (CUDA only; None elsewhere)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            sync()
    except Exception:  # a profiler that cannot start here: the Triton count still stands
        return None
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


# -------------------------------------------------------------------------------------------- a case
class SelectionCase:
    """One (model, phase, T): rotated inputs, preallocated outputs and the three timed paths."""

    def __init__(self, bench: ModelBench, model: Model, phase: str, tokens: int, source: TraceRouting, args):
        self.bench, self.model = bench, model
        self.case = build_case(
            model.shape,
            phase,
            tokens,
            DRAFT_TOKENS,
            source,
            args.rotate,
            bench.device,
            bench.dtype,
            bench.gen,
            bench.cpu_gen,
        )
        device, num_experts, top_k = bench.device, model.shape.num_experts, model.router.top_k
        gen = torch.Generator().manual_seed(args.seed + tokens)
        self.bias = (torch.randn(num_experts, generator=gen) * 0.05).to(device) if model.bias else None
        if self.case.expert_to_rank is not None:
            self.ranks = self.case.expert_to_rank
        else:
            self.ranks = (torch.arange(num_experts, device=device) * NUM_RANKS // num_experts).to(torch.int32)
        self.keep = torch.empty(num_experts, dtype=torch.bool, device=device)
        self.ids = torch.empty(tokens, top_k, dtype=torch.int32, device=device)
        self.weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
        self.workspace = SelectionWorkspace(num_experts, device)
        # the per-layer metrics row the serving plugin passes with every call (policy none, the fused
        # top-k stand-in, runs without: a top-k keeps no metrics)
        self.metrics = torch.zeros(4, dtype=torch.int64, device=device)
        self.with_metrics = not args.no_metrics
        # --metrics-gate: the row comes with the gate a server refills per forward (1: this call adds
        # its metrics, 0: a forward the server does not sample)
        self.gate_value = {"open": 1, "closed": 0}.get(args.metrics_gate)
        self.routing_sums_mass = not args.select_mass  # --select-mass: the other side of the open switch
        self.gate = (
            None if self.gate_value is None else torch.full((1,), self.gate_value, dtype=torch.int32, device=device)
        )
        # one call per rotated input, built (and checked) once, as the server builds one per layer call
        self.calls = [
            RoutingCall(
                logits,
                model.router,
                tokens_per_request=self.case.tokens_per_request,
                num_valid_tokens=self.case.num_valid,
                expert_to_rank=self.ranks,
                correction_bias=self.bias,
            )
            for logits in self.case.logits
        ]

    def select(self, cfg: PrunerConfig, j: int, pdl: bool = False, reset: bool = False):
        if reset:
            # the counter reset launch multi-program calls made before (as a programmatic dependent)
            from xshare_sglang.kernels.jit import fill_kernel

            counters = self.workspace.counters
            fill_kernel[(1,)](counters, counters.numel(), BLOCK=2048, num_warps=4, launch_pdl=True)
        return prune_route(
            self.calls[j % len(self.calls)],
            cfg,
            keep_out=self.keep,
            ids_out=self.ids,
            weights_out=self.weights,
            metrics_row=self.metrics_row(cfg),
            metrics_gate=self.metrics_gate(cfg),
            workspace=self.workspace,
            enable_pdl=pdl,
            routing_sums_mass=self.routing_sums_mass,
        )

    def metrics_row(self, cfg: PrunerConfig) -> torch.Tensor | None:
        """The metrics row a call of ``cfg`` writes: the plugin's, unless --no-metrics (or policy none)."""
        return None if cfg.policy == "none" or not self.with_metrics else self.metrics

    def metrics_gate(self, cfg: PrunerConfig) -> torch.Tensor | None:
        """The gate of the metrics row (--metrics-gate), with the row only."""
        return None if self.metrics_row(cfg) is None else self.gate

    def topk(self, j: int):
        return sglang_native_topk(self.case.logits[j % len(self.case.logits)], self.model.router, self.bias)

    def layer(self, cfg: PrunerConfig, i: int) -> None:
        routed = self.select(cfg, i)
        self.bench.moe(i, self.case.xs[i % len(self.case.xs)], routed.topk_ids, routed.topk_weights)

    def check(self, cfg: PrunerConfig) -> dict:
        """Kernel == reference on input 0 (ids and mask exactly, weights within tolerance), no allocation."""
        c = self.case
        self.select(cfg, 0)  # compiles
        sync()
        self.metrics.zero_()
        before = _allocated()
        got = self.select(cfg, 0)
        sync()
        allocated = _allocated() - before
        got_metrics = self.metrics.cpu()
        on_cpu = RoutingCall(
            c.logits[0].cpu(),
            self.model.router,
            tokens_per_request=c.tokens_per_request,
            num_valid_tokens=c.tokens,
            expert_to_rank=self.ranks.cpu(),
            correction_bias=self.bias.cpu() if self.bias is not None else None,
        )
        want_metrics = torch.zeros(4, dtype=torch.int64)
        gate = self.metrics_gate(cfg)
        ref = prune_route_reference(
            on_cpu,
            cfg,
            metrics_row=None if self.metrics_row(cfg) is None else want_metrics,
            metrics_gate=None if gate is None else gate.cpu(),
        )
        ids_equal = torch.equal(got.topk_ids.cpu(), ref.topk_ids) and torch.equal(got.keep.cpu(), ref.keep)
        got_weights = got.topk_weights.cpu()
        weight_err = float((got_weights - ref.topk_weights).abs().max()) if c.tokens else 0.0
        close = torch.allclose(got_weights, ref.topk_weights, rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
        return {
            "kept": int(ref.keep.sum()),
            "ids_equal": bool(ids_equal),
            "weights_close": bool(close),
            "weight_max_err": weight_err,
            "metrics_equal": bool(torch.equal(got_metrics, want_metrics)),
            "eager_alloc_bytes": allocated,
        }


def pdl_equal(sel: SelectionCase, cfg: PrunerConfig) -> bool:
    """The call launched as programmatic dependents gives the same ids, mask and weights, bit for bit,
    eagerly and in CUDA-graph replays, on two of the rotated inputs (each against the plain launch)."""
    for j in range(min(2, len(sel.calls))):
        plain = [t.clone() for t in sel.select(cfg, j)]
        eager = sel.select(cfg, j, pdl=True)  # compiles the dependent-launch kernels outside the capture
        sync()
        if not all(torch.equal(a, b) for a, b in zip(plain, eager, strict=True)):
            return False
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sel.select(cfg, j, pdl=True)
        for _ in range(2):
            sel.ids.fill_(-7)
            graph.replay()
            sync()
            if not all(torch.equal(a, b) for a, b in zip(plain, (sel.ids, sel.weights, sel.keep), strict=True)):
                return False
    return True


def bench_row(sel: SelectionCase, name: str, cfg: PrunerConfig, topk_us: float, args) -> dict:
    check = sel.check(cfg)
    launches, kernels = count_launches(lambda: sel.select(cfg, 1))
    device_kernels = count_device_kernels(lambda: sel.select(cfg, 1))
    none = PrunerConfig()
    selection_us = time_graph(lambda i: sel.select(cfg, i), args.calls, args.replays)
    none_us = time_graph(lambda i: sel.select(none, i), args.calls, args.replays)
    layer_us = time_graph(lambda i: sel.layer(cfg, i), args.calls, args.replays)
    pdl = {}
    if args.pdl:
        pdl = {
            "selection_pdl_us": round(time_graph(lambda i: sel.select(cfg, i, pdl=True), args.calls, args.replays), 2),
            "none_pdl_us": round(time_graph(lambda i: sel.select(none, i, pdl=True), args.calls, args.replays), 2),
            "pdl_equal": pdl_equal(sel, cfg),
        }
    tokens = sel.case.tokens
    outputs = Outputs(sel.keep, sel.ids, sel.weights, sel.metrics_row(cfg), sel.metrics_gate(cfg))
    spec = call_spec(
        sel.calls[0],
        route=True,
        fill_dropped=False,
        outputs=outputs,
        pdl=False,
        routing_sums_mass=sel.routing_sums_mass,
    )
    plan = plan_call(cfg, spec)
    if args.pdl:
        multi = not plan.split.single and cfg.policy != "none"
        pdl["reset_pdl_us"] = (
            round(time_graph(lambda i: sel.select(cfg, i, pdl=True, reset=True), args.calls, args.replays), 2)
            if multi
            else None
        )
    share = selection_us / layer_us
    measured = torch.cuda.is_available()
    checks_ok = (
        check["ids_equal"]
        and check["weights_close"]
        and check["metrics_equal"]
        and check["eager_alloc_bytes"] == 0
        and tuple(kernels) == plan.kernels
        and pdl.get("pdl_equal", True)
    )
    return {
        "model": sel.model.name,
        "E": sel.model.shape.num_experts,
        "top_k": sel.model.router.top_k,
        "T": tokens,
        "D": sel.case.tokens_per_request,
        "policy": name,
        "settings": " ".join(f"{k}={v}" for k, v in cfg.policy_parameters().items() if k != "ranking"),
        "kept": check["kept"],
        "launches": launches,
        "kernels": "+".join(kernels),
        "device_kernels": device_kernels,
        "selection_us": round(selection_us, 2),
        "none_us": round(none_us, 2),
        "topk_us": round(topk_us, 2),
        "layer_us": round(layer_us, 2),
        "share": round(share, 4),
        "goal_met": (share <= SHARE_GOAL) if measured and tokens <= SHARE_GOAL_MAX_T else None,
        "stretch_met": (share <= SHARE_STRETCH) if measured else None,
        "ids_equal": check["ids_equal"],
        "weights_close": check["weights_close"],
        "weight_max_err": check["weight_max_err"],
        "metrics_equal": check["metrics_equal"],
        "with_metrics": sel.metrics_row(cfg) is not None,
        "eager_alloc_bytes": check["eager_alloc_bytes"],
        **pdl,
        "checks_ok": bool(checks_ok),
    }


# --------------------------------------------------------------------------------------------- report
def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def md_table(rows: list[dict], meta: dict) -> str:
    pdl = any("selection_pdl_us" in r for r in rows)
    lines = [
        "# Selection per MoE layer call",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; MoE {meta['moe_backend']}; "
        f"git {meta['git_sha'][:12]}; {meta['date']}.",
        f"Times in us per call: median of {meta['replays']} replays of CUDA graphs of {meta['calls_per_graph']} "
        f"calls over {meta['rotate']} rotated inputs. sel = prune_route {meta['metrics']}; "
        f"top-k = {meta['topk_source']}; none = prune_route with policy none, no metrics (a one-launch fused "
        "top-k); layer = prune_route + fused MoE; share = sel / layer (goal <= 3% for T <= 256, then 1%).",
        "Retained mass of oea, static moe-spec and LYNX above one "
        f"program: {meta.get('retained_mass', 'summed by the selection')}.",
        "",
        "| model | T | D | policy | kept | launches | kernels | sel us | none us | top-k us | layer us | share | "
        "checks |" + (" pdl sel us | pdl none us | pdl sel us behind a reset launch |" if pdl else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if pdl else ""),
    ]
    for r in rows:
        mark = "" if r["goal_met"] is None else (" ✓" if r["goal_met"] else " ✗")
        kernels = "-" if r["device_kernels"] is None else str(r["device_kernels"])
        lines.append(
            f"| {r['model']} | {r['T']} | {r['D']} | {r['policy']} | {r['kept']} | {r['launches']} | {kernels} | "
            f"{r['selection_us']:.1f} | {r['none_us']:.1f} | {r['topk_us']:.1f} | {r['layer_us']:.1f} | "
            f"{100 * r['share']:.1f}%{mark} | {'ok' if r['checks_ok'] else 'FAIL'} |"
            + (f" {r['selection_pdl_us']:.1f} | {r['none_pdl_us']:.1f} | {_us(r.get('reset_pdl_us'))} |" if pdl else "")
        )
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, rows: list[dict], meta: dict) -> None:
    if rows:
        write_csv(out_dir / "selection.csv", rows)
        (out_dir / "selection.md").write_text(md_table(rows, meta))
    (out_dir / "selection.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODEL_ROUTERS), help=f"subset of {', '.join(MODEL_ROUTERS)}")
    parser.add_argument("--tokens", default="1,8,32,64,128,256,512", help="token counts T")
    parser.add_argument("--policies", default="all", help="comma-separated subset of the policies, or all")
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="also time every call launched as programmatic dependents (prune_route's enable_pdl, sm_90+) "
        "and check it equals the plain launch in CUDA graphs",
    )
    parser.add_argument(
        "--no-metrics",
        action="store_true",
        help="time the pruned calls without the serving plugin's per-layer metrics row (the A/B of what the "
        "metrics cost; the plugin always passes the row)",
    )
    parser.add_argument(
        "--metrics-gate",
        choices=("open", "closed"),
        help="pass the metrics row with a device gate, as a server that samples its metrics does: open (1, the "
        "call adds its metrics: what a sampled forward costs) or closed (0: what every other forward costs); "
        "without it, no gate",
    )
    parser.add_argument(
        "--select-mass",
        action="store_true",
        help="sum the retained-mass metric of oea, static moe-spec and LYNX above one program in the selection "
        "(scores of every row, E aggregates) instead of in the routing kernel "
        "(prune_route(..., routing_sums_mass=False)): the other side of its A/B",
    )
    add_layer_bench_arguments(parser, calls=20, case="(model, T)")
    args = parser.parse_args()
    if args.metrics_gate and args.no_metrics:
        parser.error("--metrics-gate gates the metrics row, which --no-metrics leaves out: choose one")
    t0 = time.monotonic()
    cuda = torch.cuda.is_available()
    models = {**MODEL_ROUTERS, **SMOKE_ROUTERS}
    if args.smoke and not cuda:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke without a GPU needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
            return 2
        torch.set_num_threads(1)
        if args.models == parser.get_default("models"):
            args.models = ",".join(SMOKE_ROUTERS)
        if args.tokens == parser.get_default("tokens"):
            args.tokens = "1,40"  # one program; several programs and the routing launch
        args.calls, args.replays, args.rotate, args.weight_copies = 1, 1, 2, 1
        dtype = torch.float16  # bf16 tl.dot is wrong under the interpreter (see bench_moe_layer.py)
    elif not cuda:
        print("bench_selection.py needs a CUDA device (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if args.pdl and not cuda:
        print("--pdl needs a CUDA device of compute capability 9.0 or newer", file=sys.stderr)
        return 2
    else:
        dtype = torch.bfloat16
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        print(f"--tokens must be comma-separated integers, got {args.tokens!r}", file=sys.stderr)
        return 2
    names = args.models.split(",")
    unknown = [m for m in names if m not in models]
    if unknown or any(t < 1 for t in tokens):
        print(
            f"--models takes {', '.join(models)}; --tokens integers >= 1 (got {args.models}, {tokens})", file=sys.stderr
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    backends, notes = resolve_backends(args.backend, args.sglang_root)
    if not backends:
        print(f"no MoE backend for --backend {args.backend}: {notes}", file=sys.stderr)
        return 2
    import triton

    source = TraceRouting(args.trace, seed=args.seed)
    # the synthetic static and co-activation files of the calibrated rankings: not part of the output
    rankings = tempfile.TemporaryDirectory(prefix="xshare-bench-rankings-")
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke run, times are not measurements)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_sha": args.git_sha or git_sha(),
        "dtype": str(dtype).removeprefix("torch."),
        "moe_backend": "",
        "backend_notes": notes,
        "topk_source": "torch ops of SGLang's native top-k path (sglang_native_topk; sgl_kernel not used)",
        "calls_per_graph": args.calls,
        "replays": args.replays,
        "rotate": args.rotate,
        "draft_tokens": DRAFT_TOKENS,
        "trace": source.name,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "skipped": [],
        "errors": [],
        "metrics": "WITHOUT metrics (--no-metrics)"
        if args.no_metrics
        else "with the serving plugin's metrics row"
        + (f", its gate {args.metrics_gate} (--metrics-gate)" if args.metrics_gate else ""),
        "retained_mass": "summed by the selection (--select-mass)"
        if args.select_mass
        else "summed by the routing kernel for rules without scores",
    }
    args.draft_tokens = DRAFT_TOKENS  # read by moe_layer.ModelBench
    bench_args = args
    rows: list[dict] = []
    for index, name in enumerate(names):
        model = models[name]
        # each router gets an equal slice of --max-minutes (and whatever an earlier one left): a cut
        # run then has every router at its smaller T rather than the last router at none
        model_deadline = t0 + 60 * args.max_minutes * (index + 1) / len(names)
        try:
            bench = ModelBench(model.shape, bench_args, backends, device, dtype)
        except Exception as exc:
            meta["errors"].append(f"{name} setup: {type(exc).__name__}: {exc}")
            print(f"[{name}] ERROR setup: {exc}", flush=True)
            continue
        meta["moe_backend"] = bench.info["backend"]
        configs = policy_configs(model.shape.num_experts, model.router.top_k, Path(rankings.name))
        wanted = list(configs) if args.policies == "all" else args.policies.split(",")
        for num_tokens in tokens:
            if time.monotonic() > model_deadline:
                meta["skipped"].append(f"{name} T={num_tokens}")
                continue
            for phase in ("decode", "verify"):
                chosen = [p for p in wanted if p in configs and configs[p][1] == phase]
                if not chosen:
                    continue
                sel = SelectionCase(bench, model, phase, num_tokens, source, bench_args)
                topk_us = time_graph(sel.topk, args.calls, args.replays)
                for policy in chosen:
                    try:
                        row = bench_row(sel, policy, configs[policy][0], topk_us, args)
                    except Exception as exc:  # recorded; the other rows still run
                        meta["errors"].append(f"{name} T={num_tokens} {policy}: {type(exc).__name__}: {exc}")
                        print(f"[{name}] ERROR T={num_tokens} {policy}: {exc}", flush=True)
                        continue
                    rows.append(row)
                    print(
                        f"[{name}] T={num_tokens:<4} {policy:<17} launches {row['launches']} sel "
                        f"{row['selection_us']:7.1f} top-k {topk_us:7.1f} layer {row['layer_us']:8.1f} "
                        f"share {100 * row['share']:5.1f}% {'ok' if row['checks_ok'] else 'CHECK FAILED'}",
                        flush=True,
                    )
            write_outputs(out_dir, rows, meta)
        bench.close()
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_outputs(out_dir, rows, meta)
    failed = [r for r in rows if not r["checks_ok"]]
    print(f"\n{len(rows)} rows, {len(failed)} failed checks, {len(meta['errors'])} errors; files in {out_dir}")
    return 0 if rows and not failed and not meta["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
