"""One MoE layer at decode and verify shapes, baseline against pruned, inside CUDA graphs: the model
shapes, routing from the shipped traces, SGLang's fused-MoE kernel (or ``torch._grouped_mm``), the
checks every row passes before it is timed, and the report.  ``scripts/bench_moe_layer.py`` is its
command line (its docstring says what is measured); ``scripts/bench_selection.py`` reuses the layer
timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import PrunerConfig, route_within
from ..break_even import BucketTiming, decide
from ..kernels import SelectionWorkspace, prune_route
from ..policies.api import select
from ..policies.call import RouterSpec, RoutingCall
from ..replay.route_csv import bundled_trace_path, load_route_csv
from .common import count_launches, sync, time_graph, write_csv
from .moe_align import align_reference, align_tokens, local_ids

REPO_ROOT = Path(__file__).resolve().parents[2]  # a source checkout (where .sgl/ is unpacked)
KERNEL_FILE = Path("kernels/ops/moe/fused_moe_triton_kernels.py")
CONFIG_DIR = Path("srt/layers/moe/moe_runner/triton_utils/configs")
MOE_TOLERANCE = 2e-2  # ||out - ref|| / ||ref|| against the float32 reference (bf16/fp16 operands)
WEIGHT_TOLERANCE = 1e-4  # routing weights, kernel path vs route_within
SPEEDUP_TARGET = 0.8  # realized speed-up >= 80% of the activated-experts ratio ...
SPEEDUP_TARGET_MIN_T = 32  # ... for T >= 32
SELECTION_TARGET = 0.03  # selection <= 3% of the pruned layer's time ...
SELECTION_TARGET_MAX_T = 512  # ... for T <= 512
ROOFLINE_TARGET = 1.5  # pruned layer time <= 1.5x its roofline (issue 37) ...
ROOFLINE_TARGET_MIN_T = 32  # ... for T >= 32


# --------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class Shape:
    """One MoE layer as this process holds it.

    ``num_experts`` experts are routed over (the router's width); with ``num_ranks > 1`` this process
    is expert-parallel rank 0 and holds the ``num_experts // num_ranks`` experts ``[0, E/ranks)``:
    picks of other experts are another rank's work and are not computed here.
    """

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    num_ranks: int = 1
    scoring: str = "softmax"
    note: str = ""

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights in bf16: gate and up (w13, [2I, H]) plus down (w2, [H, I])."""
        return 3 * self.hidden * self.intermediate * 2

    @property
    def slot_flops(self) -> int:
        """FLOPs of one routed (token, expert) slot: gate/up ``2·H·2I`` plus down ``2·I·H``."""
        return 6 * self.hidden * self.intermediate


MODELS = {
    "qwen3-30b-a3b": Shape(
        "qwen3-30b-a3b", 128, 8, 2048, 768, note="Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert 768, bf16"
    ),
    "gpt-oss-120b": Shape(
        "gpt-oss-120b",
        128,
        4,
        2880,
        2880,
        note="GPT-OSS-120B: 128 experts, top-4, hidden 2880, expert 2880; bf16 stand-in for its MXFP4 weights, "
        "plain SwiGLU without its biases and clamp",
    ),
    "gpt-oss-20b": Shape(
        "gpt-oss-20b",
        32,
        4,
        2880,
        2880,
        note="GPT-OSS-20B: 32 experts, top-4, hidden 2880, expert 2880; bf16 stand-in for its MXFP4 weights, "
        "plain SwiGLU without its biases and clamp",
    ),
    "deepseek-v3-ep8": Shape(
        "deepseek-v3-ep8",
        256,
        8,
        7168,
        2048,
        num_ranks=8,
        scoring="sigmoid",
        note="DeepSeek-V3, one rank of 8-way expert parallelism: routing over 256 experts, top-8, 32 local experts, "
        "hidden 7168, expert 2048, bf16; sigmoid scores renormalized, no group-limited routing, no correction "
        "bias, no shared expert",
    ),
}
SMOKE_MODELS = {
    "tiny": Shape("tiny", 8, 2, 64, 32, note="smoke shape"),
    "tiny-ep": Shape("tiny-ep", 16, 4, 64, 32, num_ranks=4, scoring="sigmoid", note="smoke shape, EP rank 0 of 4"),
}


def policy_grid(shape: Shape, phase: str, smoke: bool) -> list[PrunerConfig]:
    """Pruning settings compared with the baseline; budgets in experts scale with E / 128."""
    k = shape.top_k

    def scaled(budget: int) -> int:
        return max(1, round(budget * shape.num_experts / 128))

    if phase == "decode":
        grid = [PrunerConfig(policy="xshare", k0=1, budget=scaled(b)) for b in (8, 16)]
        grid += [PrunerConfig(policy="moe-spec", max_experts=scaled(b)) for b in (16, 32, 64)]
        grid += [PrunerConfig(policy="lynx", alpha=2.0, beta=4)]
        if shape.num_ranks > 1:
            grid += [PrunerConfig(policy="xshare-ep", k0=1, rank_budget=b) for b in (4, 8)]
    else:
        grid = [PrunerConfig(policy="xshare-spec", k0=1, request_budget=b, budget=0) for b in (2, 4)]
        grid += [PrunerConfig(policy="moe-spec", max_experts=b, scope="request") for b in (k, 2 * k)]
        grid += [PrunerConfig(policy="moe-spec", max_experts=scaled(32))]
    if smoke:  # one setting per policy and scope
        seen, picked = set(), []
        for cfg in grid:
            if (cfg.policy, cfg.scope) not in seen:
                seen.add((cfg.policy, cfg.scope))
                picked.append(cfg)
        grid = picked
    return grid


def policy_label(cfg: PrunerConfig) -> str:
    params = cfg.policy_parameters()
    params.pop("ranking", None)
    if params.get("scope") == "batch":
        params.pop("scope")
    return " ".join(f"{k}={v}" for k, v in params.items())


# ------------------------------------------------------------------------------------- router logits
class TraceRouting:
    """Router logits for any (E, T, D) built from one shipped route trace.

    The traces list each decode token's top-k experts per layer, not full logits.  From a trace this
    keeps two things: each layer's expert popularity ``p_l(e)`` (decode picks of e at layer l, plus
    0.5, normalized) and how much consecutive tokens share experts (mean ``|S_t & S_t+1| / k`` at the
    same layer).  A row of logits for layer l is ``log p_l(e) + G(e)`` with ``G`` standard Gumbel
    noise: its top-k is then a draw of k experts without replacement, each pick in proportion to its
    popularity (the Gumbel-top-k trick), so independent rows stand for independent decode requests with
    the layer's measured skew.  In a verify batch the D tokens of one request share part of their noise,
    ``(1 - rho) G_token + rho G_request``, with ``rho`` fitted so that two such tokens share as many
    top-k experts as consecutive tokens of the trace do.  E = 128 (the traces' own) uses the layer's
    experts as they are; other E map them by a fixed (seeded) permutation: E < 128 takes a random subset
    of the layer's experts; E = 256 puts the layer's vector next to the one of the layer half the model
    away and permutes the 256.
    """

    def __init__(self, name: str, seed: int = 0) -> None:
        trace = load_route_csv(bundled_trace_path(name))
        self.name, self.model, self.source_top_k = name, trace.model, trace.top_k
        self.num_layers, self.source_experts = trace.num_layers, trace.num_experts
        ids = trace.ids  # [N, L, k], -1 where a layer was not recorded
        listed = torch.zeros(*ids.shape[:2], self.source_experts + 1, dtype=torch.bool)
        listed.scatter_(-1, torch.where(ids >= 0, ids, self.source_experts), True)
        listed = listed[..., : self.source_experts]  # [N, L, E]: expert listed by token t at layer l
        counts = listed.sum(0).double()
        self.popularity = (counts + 0.5) / (counts + 0.5).sum(-1, keepdim=True)
        self.sibling_overlap = float((listed[:-1] & listed[1:]).sum(-1).double().mean() / self.source_top_k)
        self.seed = seed
        self.rho = self._fit_rho()

    def log_popularity(self, layer: int, num_experts: int) -> torch.Tensor:
        """``log p`` over ``num_experts`` experts for one source layer, float64 [E]."""
        gen = torch.Generator().manual_seed(self.seed + 7919)
        src = self.source_experts
        if num_experts == src:
            p = self.popularity[layer % self.num_layers]
        elif num_experts < src:
            p = self.popularity[layer % self.num_layers][torch.randperm(src, generator=gen)[:num_experts]]
        else:
            reps = -(-num_experts // src)
            parts = [self.popularity[(layer + r * self.num_layers // reps) % self.num_layers] for r in range(reps)]
            p = torch.cat(parts)[torch.randperm(reps * src, generator=gen)][:num_experts]
        return torch.log(p / p.sum())

    def logits(self, layer: int, num_tokens: int, num_experts: int, tokens_per_request: int, gen) -> torch.Tensor:
        """Router logits [T, E], float32, on the CPU."""
        logp = self.log_popularity(layer, num_experts).float()
        noise = _gumbel((num_tokens, num_experts), gen)
        if tokens_per_request > 1:
            requests = -(-num_tokens // tokens_per_request)
            shared = _gumbel((requests, num_experts), gen).repeat_interleave(tokens_per_request, 0)[:num_tokens]
            noise = (1.0 - self.rho) * noise + self.rho * shared
        return logp + noise

    def _fit_rho(self) -> float:
        """The sibling noise share whose top-k overlap matches the trace's consecutive tokens."""
        gen = torch.Generator().manual_seed(self.seed + 104729)
        k, pairs = self.source_top_k, 64
        best, best_gap = 0.0, math.inf
        layers = range(self.num_layers)
        base = torch.stack([self.log_popularity(layer, self.source_experts).float() for layer in layers])
        tok_a = _gumbel((len(layers), pairs, self.source_experts), gen)
        tok_b = _gumbel((len(layers), pairs, self.source_experts), gen)
        shared = _gumbel((len(layers), pairs, self.source_experts), gen)
        for step in range(21):
            rho = step / 20
            za = base[:, None] + (1 - rho) * tok_a + rho * shared
            zb = base[:, None] + (1 - rho) * tok_b + rho * shared
            ma = torch.zeros_like(za, dtype=torch.bool).scatter_(-1, za.topk(k, -1).indices, True)
            mb = torch.zeros_like(zb, dtype=torch.bool).scatter_(-1, zb.topk(k, -1).indices, True)
            gap = abs(float((ma & mb).sum(-1).float().mean()) / k - self.sibling_overlap)
            if gap < best_gap:
                best, best_gap = rho, gap
        return best


def _gumbel(shape, gen) -> torch.Tensor:
    u = torch.rand(shape, generator=gen).clamp(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(u))


# ------------------------------------------------------------------------------------------- routing
def route_topk(logits: torch.Tensor, top_k: int, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's top-k (SGLang's fused_topk semantics): scores, top-k, renormalized; int32 ids."""
    scores = torch.softmax(logits.float(), -1) if scoring == "softmax" else torch.sigmoid(logits.float())
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)


def activated_experts(ids: torch.Tensor, offset: int, num_local: int) -> int:
    local, valid = local_ids(ids, offset, num_local)
    return int(torch.unique(local[valid]).numel())


def routed_slots(ids: torch.Tensor, offset: int, num_local: int) -> int:
    """Slots of ``ids`` [T, k] this rank computes: ids in ``[offset, offset + num_local)`` (not ``-1``)."""
    _, valid = local_ids(ids, offset, num_local)
    return int(valid.sum())


def roofline_us(activated: float, slots: float, shape: Shape, bandwidth_gbps: float, peak_tflops: float) -> float:
    """``max(weight bytes / bandwidth, FLOPs / peak)`` in µs: the read of the activated experts' weights,
    or the slots' two GEMMs at the measured bf16 matmul rate, whichever takes longer.

    Parameters
    ----------
    activated : float
        Experts read (this rank's, mean over inputs).
    slots : float
        Routed (token, expert) slots computed (mean over inputs).
    shape : Shape
        Gives bytes per expert and FLOPs per slot.
    bandwidth_gbps, peak_tflops : float
        Measured in the same run (:func:`measure_bandwidth`, :func:`measure_matmul_tflops`).
    """
    memory_us = activated * shape.expert_bytes / (bandwidth_gbps * 1e3)
    compute_us = slots * shape.slot_flops / (peak_tflops * 1e6)
    return max(memory_us, compute_us)


def reference_moe(x, ids, weights, w13, w2, offset: int) -> torch.Tensor:
    """float32 loop over the activated local experts: sum_j w_j * down(silu(gate) * up)."""
    num_local, inter = w13.shape[0], w2.shape[2]
    local, valid = local_ids(ids, offset, num_local)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(local[valid]).tolist():
        rows, slots = torch.nonzero(valid & (local == e), as_tuple=True)
        h = x[rows].float() @ w13[e].float().t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].float().t()
        out.index_add_(0, rows, y * weights[rows, slots].float()[:, None])
    return out


class GroupedMMMoE:
    """``torch._grouped_mm`` over the slots sorted by expert (offsets per expert; empty groups do no work)."""

    name = "grouped_mm"

    def __init__(self) -> None:
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm")
        self.source = f"torch._grouped_mm (torch {torch.__version__})"
        self._arange: dict[tuple[int, str], torch.Tensor] = {}

    def config_label(self, num_tokens: int, shape: Shape) -> str:
        return "-"

    def __call__(self, x, ids, weights, w13, w2, offset: int, config: dict | None = None) -> torch.Tensor:
        num_tokens, top_k = ids.shape
        numel, num_local, inter = ids.numel(), w13.shape[0], w2.shape[2]
        sorted_ids, _, bounds = align_tokens(ids, 1, num_local, offset, expert_ids=False)
        order = sorted_ids.long()
        offs = bounds[1 : num_local + 1]
        h = torch._grouped_mm(x.index_select(0, order // top_k), w13.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w2.transpose(1, 2), offs=offs)
        key = (numel, str(x.device))
        if key not in self._arange:
            self._arange[key] = torch.arange(numel, device=x.device, dtype=torch.int32)
        live = (self._arange[key] < bounds[num_local])[:, None]  # rows past the last expert are not computed
        y = torch.where(live, y * weights.reshape(-1).index_select(0, order)[:, None].to(y.dtype), 0)
        out = torch.empty_like(y).index_copy_(0, order, y)
        return out.view(num_tokens, top_k, -1).sum(1)


class _Flag:
    def __init__(self, value: bool) -> None:
        self.value = value


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def find_sglang_root(explicit: str | None) -> Path | None:
    """Folder of the ``sglang`` package holding the fused-MoE kernel file, without importing SGLang.

    Looked for in: ``--sglang-root``; an installed ``sglang`` (located, not imported); ``.sgl/sglang``
    in the repository (files unpacked from the wheel, as docs/benchmarks.md shows).
    """
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    candidates.append(REPO_ROOT / ".sgl" / "sglang")
    for root in candidates:
        if (root / KERNEL_FILE).is_file():
            return root
    return None


def sglang_version(root: Path) -> str:
    for name in ("_version.py", "version.py"):
        path = root / name
        if path.is_file():
            found = re.search(
                r"""__version__\s*(?::\s*str\s*)?=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", path.read_text()
            )
            if found:
                return found.group(1)
    dist = sorted(root.parent.glob("sglang-*.dist-info"))
    return dist[-1].name.removeprefix("sglang-").removesuffix(".dist-info") if dist else "unknown"


class SglangFusedMoE:
    """SGLang's bf16 fused-MoE sequence built around its own Triton GEMM kernel.

    ``invoke_fused_moe_kernel`` and ``fused_moe_kernel`` come unchanged from SGLang's
    ``sglang/kernels/ops/moe/fused_moe_triton_kernels.py``, loaded as a stand-alone module: its imports
    of other SGLang modules (platform checks, quantization helpers that the bf16 path never calls) are
    answered by small stubs, so neither SGLang's dependencies nor ``sgl_kernel`` are needed.  Around it,
    as in SGLang's ``fused_experts`` for bf16: the slots are aligned by expert (``align_tokens``, the
    moe_align layout; SGLang uses its own CUDA kernel), gate/up GEMM, ``silu(gate) * up`` in torch
    (SGLang: a CUDA kernel), down GEMM with the routing weights, sum over the k slots.  Block sizes come
    from SGLang's tuned config files for (E, N, device) when there is one, else SGLang's default rule;
    the up-projection config serves both GEMMs (SGLang may use a separate TMA down config).
    """

    name = "sglang"

    def __init__(self, root: Path, pdl: bool = True) -> None:
        self.root, self.version = root, sglang_version(root)
        self.pdl = _Flag(pdl)
        self.module = self._load(root / KERNEL_FILE)
        self.source = f"sglang {self.version} fused_moe_kernel ({root / KERNEL_FILE})"
        self._configs: dict[tuple, tuple[dict, str]] = {}

    def _load(self, path: Path) -> types.ModuleType:
        cuda = torch.cuda.is_available()

        def sm90() -> bool:
            return cuda and torch.cuda.get_device_capability()[0] >= 9

        def quantized(*args, **kwargs):
            raise NotImplementedError("quantized MoE paths are not part of this benchmark")

        class _Env:
            def get(self):
                return False

        class _Envs:
            def __getattr__(self, name):
                return _Env()

        pdl = self.pdl
        stubs = {
            "sglang": _stub("sglang", __path__=[]),
            "sglang.kernels": _stub("sglang.kernels", __path__=[]),
            "sglang.kernels.jit": _stub("sglang.kernels.jit", __path__=[]),
            "sglang.kernels.jit.utils": _stub(
                "sglang.kernels.jit.utils", is_arch_support_pdl=lambda: pdl.value and sm90()
            ),
            "sglang.kernels.ops": _stub("sglang.kernels.ops", __path__=[]),
            "sglang.kernels.ops.quantization": _stub("sglang.kernels.ops.quantization", __path__=[]),
            "sglang.kernels.ops.quantization.fp8_kernel": _stub(
                "sglang.kernels.ops.quantization.fp8_kernel",
                per_token_group_quant_fp8=quantized,
                scaled_fp8_quant=quantized,
                sglang_per_token_group_quant_fp8=quantized,
            ),
            "sglang.kernels.ops.quantization.int8_kernel": _stub(
                "sglang.kernels.ops.quantization.int8_kernel",
                per_token_group_quant_int8=quantized,
                per_token_quant_int8=quantized,
                sglang_per_token_group_quant_int8=quantized,
            ),
            "sglang.srt": _stub("sglang.srt", __path__=[]),
            "sglang.srt.batch_invariant_ops": _stub(
                "sglang.srt.batch_invariant_ops", is_batch_invariant_mode_enabled=lambda: False
            ),
            "sglang.srt.environ": _stub("sglang.srt.environ", envs=_Envs()),
            "sglang.srt.layers": _stub("sglang.srt.layers", __path__=[]),
            "sglang.srt.layers.moe": _stub("sglang.srt.layers.moe", __path__=[]),
            "sglang.srt.layers.moe.utils": _stub("sglang.srt.layers.moe.utils", get_moe_padding_size=lambda aiter: 0),
            "sglang.srt.utils": _stub(
                "sglang.srt.utils",
                cpu_has_amx_support=lambda: False,
                is_cpu=lambda: not cuda,
                is_cuda=lambda: cuda,
                is_hip=lambda: False,
                is_sm90_supported=sm90,
            ),
        }
        saved = {name: sys.modules.get(name) for name in stubs}
        sys.modules.update(stubs)
        try:
            spec = importlib.util.spec_from_file_location("_bench_sglang_fused_moe_triton_kernels", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        finally:  # the stubs never outlive the load: a real ``import sglang`` later is unaffected
            for name, previous in saved.items():
                if previous is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = previous
        return module

    def config(self, num_tokens: int, num_local: int, inter: int) -> tuple[dict, str]:
        """SGLang's ``try_get_optimal_moe_config`` for bf16: tuned file (this Triton version first), or default."""
        key = (num_tokens, num_local, inter)
        if key not in self._configs:
            name = self.file_name(num_local, inter)
            root = self.root / CONFIG_DIR
            mine = f"triton_{triton.__version__.replace('.', '_')}"
            others = sorted(
                (d.name for d in root.glob("triton_*") if d.name != mine),
                key=lambda d: tuple(int(x) for x in d.removeprefix("triton_").split("_") if x.isdigit()),
                reverse=True,
            )
            found = None
            for version_dir in [mine, *others]:
                if (root / version_dir / name).is_file():
                    table = {int(k): v for k, v in json.loads((root / version_dir / name).read_text()).items()}
                    found = (dict(table[min(table, key=lambda m: abs(m - num_tokens))]), f"tuned {version_dir}")
                    break
            if found is None:
                small = num_tokens <= num_local
                cfg = (
                    {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1}
                    if small
                    else {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 32, "GROUP_SIZE_M": 8}
                )
                found = (cfg, "default")
            found[0].pop("USE_TMA", None)
            self._configs[key] = found
        return self._configs[key]

    @staticmethod
    def file_name(num_local: int, inter: int) -> str:
        """SGLang's tuned-file name for a bf16 shape on this device."""
        device = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
        return f"E={num_local},N={inter},device_name={device}.json"

    def pruned_config(self, num_tokens: int, shape: Shape, bound: int | None) -> tuple[dict, str]:
        """The config the plugin's hook (``hooks/moe_config_lookup.py``) gives a pruned call of at most
        ``bound`` kept experts: our tuned (T, |keep|) file, else SGLang's table at
        ``ceil(T * E / bound)``, else SGLang's own choice (:func:`~xshare_sglang.sglang_plugin.
        pruned_moe_config.choose`)."""
        from ..sglang_plugin.pruned_moe_config import choose, load_pruned_table, pruned_file_name

        key = ("pruned", num_tokens, shape.local_experts, shape.intermediate, shape.num_experts, bound)
        if key not in self._configs:
            own, source = self.config(num_tokens, shape.local_experts, shape.intermediate)
            ours = load_pruned_table(pruned_file_name(self.file_name(shape.local_experts, shape.intermediate)))
            choice = choose(
                num_tokens=num_tokens,
                num_experts=shape.num_experts,
                bound=bound,
                sglang_has_table=source.startswith("tuned"),
                pruned_table=ours,
            )
            if choice.source == "pruned-table":
                config = {k: v for k, v in choice.config.items() if k != "USE_TMA"}
                self._configs[key] = (config, f"pruned-table |keep|<={bound}")
            elif choice.source == "scaled":
                config, source = self.config(choice.num_tokens, shape.local_experts, shape.intermediate)
                self._configs[key] = (config, f"{source} at M={choice.num_tokens}")
            else:
                self._configs[key] = (own, source)
        return self._configs[key]

    @staticmethod
    def label(config: dict, source: str) -> str:
        blocks = "x".join(str(config[k]) for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"))
        return f"{source} {blocks}"

    def config_label(self, num_tokens: int, shape: Shape) -> str:
        return self.label(*self.config(num_tokens, shape.local_experts, shape.intermediate))

    def __call__(self, x, ids, weights, w13, w2, offset: int, config: dict | None = None) -> torch.Tensor:
        """The fused MoE with ``config`` (default: SGLang's choice for the call's token count)."""
        num_tokens, top_k = ids.shape
        num_local, inter, hidden = w13.shape[0], w2.shape[2], w2.shape[1]
        cfg = config if config is not None else self.config(num_tokens, num_local, inter)[0]
        sorted_ids, expert_ids, bounds = align_tokens(ids, cfg["BLOCK_SIZE_M"], num_local, offset)
        used = bounds[num_local + 1 :]
        kw = dict(
            compute_type=tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16,
            use_fp8_w8a8=False,
            use_int8_w8a8=False,
            use_int8_w8a16=False,
            use_int4_w4a16=False,
            per_channel_quant=False,
            block_shape=None,
        )
        invoke = self.module.invoke_fused_moe_kernel
        gate_up = torch.empty(ids.numel(), w13.shape[1], dtype=x.dtype, device=x.device)
        invoke(
            x, w13, None, gate_up, None, None, None, weights, ids, sorted_ids, expert_ids, used, False, top_k, cfg, **kw
        )
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        down = torch.empty(num_tokens, top_k, hidden, dtype=x.dtype, device=x.device)
        invoke(act, w2, None, down, None, None, None, weights, ids, sorted_ids, expert_ids, used, True, 1, cfg, **kw)
        return down.sum(1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return err if math.isfinite(err) else float("inf")


def check_backend(backend, shape: Shape, weights, device, dtype, gen) -> float:
    """Worst relative error of the backend against the reference on one random routing (decode, T=16).

    On CUDA the call is also captured in a CUDA graph and replayed, as the timed runs do.
    """
    w13, w2 = weights[0]
    tokens = 16
    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype)
    logits = torch.randn(tokens, shape.num_experts, generator=gen, device=device)
    ids, w = route_topk(logits, shape.top_k, shape.scoring)
    ids[0, 0] = -1  # a dropped slot must be skipped
    ref = reference_moe(x, ids, w, w13, w2, 0)
    err = rel_err(backend(x, ids, w, w13, w2, 0), ref)
    if device.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            backend(x, ids, w, w13, w2, 0)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = backend(x, ids, w, w13, w2, 0)
        captured.fill_(float("nan"))  # poisoned: the replay must write every element
        graph.replay()
        sync()
        err = max(err, rel_err(captured, ref))
        del graph
    return err


def check_alignment(shape: Shape, device, gen) -> bool:
    """``align_tokens`` equals ``align_reference`` on a random routing with dropped and remote slots."""
    for tokens, block_m in ((13, 1), (13, 16), (1, 16)):  # (1, 16): fewer slots than buckets
        ids = torch.randint(-1, shape.num_experts, (tokens, shape.top_k), generator=gen, device=device)
        ids = ids.to(torch.int32)
        sorted_ids, expert_ids, bounds = align_tokens(ids, block_m, shape.local_experts, 0)
        ref_sorted, ref_experts, ref_bounds = align_reference(ids, block_m, shape.local_experts, 0)
        used = int(ref_bounds[-1])
        if not torch.equal(bounds.cpu(), ref_bounds) or not torch.equal(sorted_ids[:used].cpu(), ref_sorted):
            return False
        if not torch.equal(expert_ids[: used // block_m].cpu(), ref_experts):
            return False
    return True


def resolve_backends(choice: str, sglang_root: str | None) -> tuple[list, list[str]]:
    """Backends to try, in order of preference, and why any could not be built."""
    found, notes = [], []
    if choice in ("auto", "sglang"):
        root = find_sglang_root(sglang_root)
        if root is None:
            notes.append(f"sglang: no {KERNEL_FILE} under --sglang-root, an installed sglang or .sgl/sglang")
        else:
            try:
                found.append(SglangFusedMoE(root))
            except Exception as exc:  # any load failure: the next backend
                notes.append(f"sglang: loading {root / KERNEL_FILE} failed: {type(exc).__name__}: {exc}")
    if choice in ("auto", "grouped_mm"):
        try:
            found.append(GroupedMMMoE())
        except Exception as exc:
            notes.append(f"grouped_mm: {exc}")
    return found, notes


# ------------------------------------------------------------------------------------------ measuring
def _seconds_per_run(device, run, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run()`` after 3 warm-up calls: CUDA events on a GPU,
    a wall clock elsewhere (a figure of the smoke run only)."""
    for _ in range(3):
        run()
    sync()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            samples.append(time.perf_counter() - t0)
    return samples


def measure_bandwidth(device, nbytes: int, repeats: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of ``repeats``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    samples = _seconds_per_run(device, lambda: dst.copy_(src), repeats)
    moved = 2 * src.numel() * 2
    return statistics.median(moved / seconds / 1e9 for seconds in samples)


def measure_matmul_tflops(device, dtype, n: int, repeats: int = 20) -> float:
    """Dense ``[n, n] @ [n, n]`` matmul rate in TFLOP/s (``2·n³`` per product), median of ``repeats``:
    the compute peak this run's roofline uses (cuBLAS on a square bf16 GEMM; on CPU a figure of the
    smoke run only)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device).to(dtype)
    b = torch.randn(n, n, generator=gen, device=device).to(dtype)
    out = torch.empty(n, n, dtype=dtype, device=device)
    samples = _seconds_per_run(device, lambda: torch.matmul(a, b, out=out), repeats)
    return statistics.median(2 * n**3 / seconds / 1e12 for seconds in samples)


@dataclass
class Case:
    """Inputs of one (model, phase, T): rotated hidden states and logits, and the baseline's routing."""

    shape: Shape
    phase: str
    tokens: int
    tokens_per_request: int
    xs: list
    logits: list
    num_valid: torch.Tensor
    expert_to_rank: torch.Tensor | None
    baseline_routes: list
    baseline_counts: list[int]

    @property
    def baseline_activated(self) -> float:
        return statistics.mean(self.baseline_counts)

    @property
    def baseline_slots(self) -> float:
        """This rank's routed slots of the baseline, mean over the inputs."""
        return statistics.mean(routed_slots(ids, 0, self.shape.local_experts) for ids, _ in self.baseline_routes)


def build_case(shape, phase, tokens, draft, source: TraceRouting, rotate, device, dtype, gen, cpu_gen) -> Case:
    per_request = draft if phase == "verify" else 1
    xs, logits = [], []
    for i in range(rotate):
        layer = (i * source.num_layers) // rotate
        xs.append(torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype))
        z = source.logits(layer, tokens, shape.num_experts, per_request, cpu_gen)
        logits.append(z.to(torch.bfloat16).to(device))
    routes = [route_topk(z, shape.top_k, shape.scoring) for z in logits]
    ranks = None
    if shape.num_ranks > 1:
        ranks = (torch.arange(shape.num_experts, device=device) // shape.local_experts).to(torch.int32)
    counts = [activated_experts(ids, 0, shape.local_experts) for ids, _ in routes]
    return Case(
        shape,
        phase,
        tokens,
        per_request,
        xs,
        logits,
        torch.tensor([tokens], device=device, dtype=torch.int32),
        ranks,
        routes,
        counts,
    )


class PrunedLayer:
    """The server's pruned routing for one config: the fused selection kernel in place of the top-k."""

    def __init__(self, case: Case, cfg: PrunerConfig, workspace: SelectionWorkspace) -> None:
        self.case, self.cfg, self.workspace = case, cfg, workspace
        device = case.logits[0].device
        self.keep = torch.empty(case.shape.num_experts, dtype=torch.bool, device=device)
        router = RouterSpec(case.shape.top_k, case.shape.scoring)
        # one call per input, built (and checked) once, as the server builds one per layer call
        self.calls = [
            RoutingCall(
                logits,
                router,
                tokens_per_request=case.tokens_per_request,
                num_valid_tokens=case.num_valid,
                expert_to_rank=case.expert_to_rank,
            )
            for logits in case.logits
        ]
        # routing buffers the selection-only graph writes (same work as in the layer)
        self.scratch = [(ids.clone(), w.clone()) for ids, w in case.baseline_routes]

    def _prune_route(self, j: int, ids: torch.Tensor | None = None, w: torch.Tensor | None = None):
        return prune_route(
            self.calls[j], self.cfg, keep_out=self.keep, ids_out=ids, weights_out=w, workspace=self.workspace
        )

    def route(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        routed = self._prune_route(j)
        return routed.topk_ids, routed.topk_weights

    def selection_only(self, j: int) -> None:
        ids, w = self.scratch[j]
        self._prune_route(j, ids, w)

    def check(self, j: int) -> dict:
        """Kernel mask vs reference, routing vs route_within, on input j (eager)."""
        logits = self.case.logits[j]
        keep_ref = select(self.calls[j], self.cfg)[0]
        ids, w = self.route(j)
        sync()
        masks_equal = bool(torch.equal(self.keep, keep_ref))
        ref_ids, ref_w = route_within(
            logits, keep_ref, top_k=self.case.shape.top_k, coverage=self.cfg.coverage, scoring=self.case.shape.scoring
        )
        routing_equal = _same_routing(logits, ids, w, ref_ids, ref_w)
        return {
            "masks_equal": masks_equal,
            "routing_equal": routing_equal,
            "kept": int(keep_ref.sum()),
            "ids": ids.clone(),
            "w": w.clone(),
        }


def _same_routing(logits, ids, w, ref_ids, ref_w) -> bool:
    """Same routing up to ties: per row, the sorted logits of the chosen experts and the sorted weights."""

    def summary(i, weights):
        chosen = torch.where(i >= 0, logits.float().gather(1, i.long().clamp_min(0)), float("-inf"))
        return chosen.sort(1).values, torch.where(i >= 0, weights, 0.0).sort(1).values

    a_logit, a_w = summary(ids, w)
    b_logit, b_w = summary(ref_ids, ref_w)
    return bool(torch.equal(a_logit, b_logit) and (a_w - b_w).abs().max() <= WEIGHT_TOLERANCE)


# ---------------------------------------------------------------------------------------------- report
def md_tables(rows: list[dict], meta: dict) -> str:
    lines = [
        "# MoE layer: unpruned (a fused top-k) vs pruned routing",
        "",
        f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}, sglang kernel "
        f"{meta['sglang_kernel']}; git {meta['git_sha'][:12]}; {meta['date']}.",
        f"Copy bandwidth {meta['bandwidth_gbps']:.0f} GB/s (read + write). Times in us per layer call: median of "
        f"{meta['replays']} replays of CUDA graphs of {meta['calls_per_graph']} calls over {meta['rotate']} "
        f"rotated inputs and {meta['weight_copies']} weight copies. Logits: trace `{meta['trace']}`, "
        f"rho={meta['rho']:.2f}.",
        "",
        "Columns: act = activated experts (this rank's, mean over inputs), baseline -> pruned; base = the "
        "unpruned layer routed by a fused top-k (the kernels' policy none), what a user runs; torch = the "
        "unpruned layer routed by torch ops (softmax, topk); floor = pruned "
        "activated x bytes per expert / bandwidth; x = base time / pruned time (x torch: against torch); "
        "ideal = activated ratio; "
        "r/i = x / ideal (target >= 0.8 for T >= 32); sel = selection time, and its share of the pruned layer "
        "(target <= 3% for T <= 512); roof = roofline max(weight bytes / bandwidth, FLOPs / bf16 matmul peak), "
        "b/roof and p/roof = baseline and pruned time over their rooflines (pruned target <= 1.5 for T >= 32), "
        "m/c = the pruned roofline's bound (memory or compute); cfg = SGLang's config time / the pruned time "
        "(with `--pruned-config both`: the plugin's config against SGLang's own, > 1 = the plugin's is faster); "
        "launches = kernels one layer call puts on the GPU (profiled): unpruned (a fused top-k, "
        "the alignment, the MoE) / pruned.",
    ]
    if meta.get("matmul_tflops"):
        lines.insert(4, f"bf16 matmul peak {meta['matmul_tflops']:.0f} TFLOP/s (measured in this run).")
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += ["", f"## {model}", "", f"{meta['models'][model]['note']}; backend {meta['models'][model]['backend']}"]
        lines += [
            "",
            "| phase | T | policy | settings | act | base us | torch us | pruned us | floor us | roof us | b/roof "
            "| p/roof | m/c | cfg | x | x torch | ideal | r/i | sel us | sel % | launches | checks |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["model"] != model:
                continue
            ok = "ok" if r["checks_ok"] else "FAIL"
            lines.append(
                f"| {r['phase']} | {r['T']} | {r['policy']} | {r['settings']} | {r['activated_baseline']:.1f} -> "
                f"{r['activated_pruned']:.1f} | {r['baseline_us']:.1f} | "
                f"{_fmt(r.get('baseline_torch_topk_us'), '.1f')} | "
                f"{r['pruned_us']:.1f} | "
                f"{r['floor_pruned_us']:.1f} | {_fmt(r.get('roofline_pruned_us'), '.1f')} | "
                f"{_fmt(r.get('baseline_over_roofline'), '.2f')} | {_fmt(r.get('pruned_over_roofline'), '.2f')}"
                f"{_mark(r.get('target_roofline'))} | {(r.get('pruned_bound') or '-')[:1]} | "
                f"{_fmt(r.get('config_gain'), '.2f')} | "
                f"{r['speedup']:.2f} | {_fmt(r.get('speedup_torch_topk'), '.2f')} | {_fmt(r['ideal'], '.2f')} | "
                f"{_fmt(r['realized_over_ideal'], '.2f')}"
                f"{_mark(r['target_speedup'])} | {r['selection_us']:.1f} | {100 * r['selection_share']:.1f}"
                f"{_mark(r['target_selection'])} | {_launches(r)} | {ok} |"
            )
    return "\n".join(lines) + "\n"


def _launches(r: dict) -> str:
    counts = [r.get(key) for key in ("launches_baseline", "launches_pruned")]
    return "-" if any(c is None for c in counts) else "/".join(str(c) for c in counts)


def _mark(met: bool | None) -> str:
    return "" if met is None else (" ✓" if met else " ✗")


def write_outputs(out_dir: Path, rows: list[dict], meta: dict) -> None:
    if rows:
        write_csv(out_dir / "moe_layer.csv", rows)
        (out_dir / "moe_layer.md").write_text(md_tables(rows, meta))
    (out_dir / "moe_layer.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


def guard_rows(runs: list[list[dict]], margin: float) -> list[dict]:
    """The start-up guard's decision for every (model, phase, T, settings) measured in repeated runs.

    Each run gives one baseline sample (``baseline_us``, and ``baseline_repeat_us`` when timed again
    after the policies) and one pruned sample (``pruned_us``) per row; :func:`xshare_sglang.break_even.decide`
    turns them into the decision a server would take for that bucket.
    """
    samples: dict[tuple, tuple[list[float], list[float]]] = {}
    for rows in runs:
        for row in rows:
            key = (row["model"], row["phase"], row["T"], row["policy"], row["settings"])
            base, pruned = samples.setdefault(key, ([], []))
            base.append(row["baseline_us"])
            if row.get("baseline_repeat_us") not in (None, row["baseline_us"]):
                base.append(row["baseline_repeat_us"])
            pruned.append(row["pruned_us"])
    keys = list(samples)
    timings = [BucketTiming(key[1], key[2], tuple(samples[key][0]), tuple(samples[key][1])) for key in keys]
    out = []
    for key, decision in zip(keys, decide(timings, margin), strict=True):
        model, phase, tokens, policy, settings = key
        out.append(
            {
                "model": model,
                "phase": phase,
                "T": tokens,
                "policy": policy,
                "settings": settings,
                "baseline_us": _round(decision.unpruned_s, 2),
                "pruned_us": _round(decision.pruned_s, 2),
                "samples": len(samples[key][1]),
                "prune": decision.prune,
                "reason": decision.reason,
            }
        )
    return out


def guard_markdown(rows: list[dict], margin: float) -> str:
    lines = [
        f"Start-up guard decisions (margin {margin:g}): medians of repeated CUDA-graph timings, in µs",
        "",
        "| model | phase | T | policy | settings | unpruned | pruned | runs | guard |",
        "|---|---|---:|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        state = "**on**" if r["prune"] else "off"
        lines.append(
            f"| {r['model']} | {r['phase']} | {r['T']} | {r['policy']} | {r['settings']} | {r['baseline_us']} | "
            f"{r['pruned_us']} | {r['samples']} | {state} ({r['reason']}) |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main
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
        from ..sglang_plugin.pruned_moe_config import keep_bound

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


def _bound(activated: float, slots: float, shape: Shape, bandwidth_gbps: float, peak_tflops: float) -> str:
    """Which term of :func:`roofline_us` is larger: ``memory`` or ``compute``."""
    memory_us = activated * shape.expert_bytes / (bandwidth_gbps * 1e3)
    return "memory" if memory_us >= slots * shape.slot_flops / (peak_tflops * 1e6) else "compute"


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


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
