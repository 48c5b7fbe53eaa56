"""SGLang's fused-MoE backend: :class:`SglangFusedMoE` loads SGLang's own Triton kernel file as a
stand-alone module (its SGLang imports answered by stubs) and picks block sizes as SGLang does;
:func:`find_sglang_root` locates the file without importing SGLang.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..moe_align import align_tokens
from .shapes import Shape

REPO_ROOT = Path(__file__).resolve().parents[3]  # a source checkout (where .sgl/ is unpacked)
KERNEL_FILE = Path("kernels/ops/moe/fused_moe_triton_kernels.py")
CONFIG_DIR = Path("srt/layers/moe/moe_runner/triton_utils/configs")


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
        from ...sglang_plugin.pruned_moe_config import choose, load_pruned_table, pruned_file_name

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
