"""The golden launch manifest of the fused selection kernels: what every call of a fixed set launches.

For each call of :data:`CASES` (every policy and ranking, every router kind, T from 1 to 512, bf16 and
float32, metrics off, on and gated, filled slots, per-request scopes, dependent launch on and off,
the select-only entry point, and both sides of the open routing-sums switch) the wrapper plans the
call on CPU tensors (:func:`~xshare_sglang.kernels.launch.planned_launches`, :func:`capture`), and each
launch is written down: the kernel, its grid, its warps and launch options, the value of every
constexpr (a bundle's fields as ``BUNDLE.FIELD``, the set rule by name), and, with ``ptx=True``, the
SHA-256 of its sm_90 PTX
compiled here with line information off and the entry and parameter names normalized
(:func:`ptx_digest`).  ``tests/data/kernel_manifest.json`` holds it; ``tests/test_kernel_manifest.py``
recomputes it.  A change to the kernels or their plan then shows in the manifest's diff as exactly
the variants it changed.

Regenerate with ``python -m xshare_sglang.bench.kernel_manifest --write tests/data/kernel_manifest.json``
(``TRITON_INTERPRET`` unset; ``--no-ptx`` for the launches alone).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import PrunerConfig
from ..policies.call import RouterSpec, RoutingCall

#: Options of a launch that are not kernel parameters.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "launch_pdl")

#: name -> (E, router): the router kinds the kernels distinguish, on a model that has them.
ROUTERS: dict[str, tuple[int, RouterSpec]] = {
    "softmax": (128, RouterSpec(8, "softmax", True)),  # Qwen3-30B-A3B
    "softmax-plain": (60, RouterSpec(4, "softmax", False)),  # Qwen1.5-MoE: no renormalization, E=60
    "sigmoid": (128, RouterSpec(4, "sigmoid", True)),
    "grouped": (160, RouterSpec(6, "softmax", False, 8, 3)),  # DeepSeek-V2: grouped softmax, E=160
    "deepseek-v3": (256, RouterSpec(8, "sigmoid", True, 8, 4, 2.5)),  # biased grouped sigmoid
}

#: name -> (PrunerConfig fields, D): every policy and ranking, and the controls that change a kernel.
POLICIES: dict[str, tuple[dict, int]] = {
    "none": ({}, 1),
    "oea": ({"policy": "oea", "k0": 1}, 1),
    "xshare": ({"policy": "xshare", "k0": 1, "budget": 16}, 1),
    "xshare-cap": ({"policy": "xshare", "k0": 2, "budget": 16, "max_experts": 12}, 1),
    "xshare-range": ({"policy": "xshare", "k0": 1, "budget": 16, "min_tokens": 2, "max_tokens": 64}, 1),
    "xshare-truncation": ({"policy": "xshare", "k0": 1, "budget": 16, "coverage": "truncation"}, 1),
    "xshare-threshold": ({"policy": "xshare-threshold", "k0": 1, "tau": 0.9}, 1),
    "xshare-ep": ({"policy": "xshare-ep", "k0": 1, "rank_budget": 4}, 1),
    "xshare-spec": ({"policy": "xshare-spec", "k0": 1, "request_budget": 2, "budget": 4}, 4),
    "moe-spec": ({"policy": "moe-spec", "max_experts": 32}, 1),
    "moe-spec-static": ({"policy": "moe-spec", "max_experts": 32, "ranking": "static"}, 1),
    "moe-spec-coverage": ({"policy": "moe-spec", "max_experts": 32, "ranking": "coverage"}, 1),
    "moe-spec-coverage-probs": ({"policy": "moe-spec", "max_experts": 32, "ranking": "coverage", "score": "probs"}, 1),
    "moe-spec-coact": ({"policy": "moe-spec", "max_experts": 32, "ranking": "coactivation"}, 1),
    "moe-spec-request": ({"policy": "moe-spec", "max_experts": 8, "scope": "request"}, 4),
    "lynx": ({"policy": "lynx", "alpha": 2.0, "beta": 4}, 1),
    "lynx-cap": ({"policy": "lynx", "alpha": 2.0, "beta": 4, "max_experts": 24}, 1),
}
TOKENS = (1, 2, 5, 8, 9, 32, 257, 512)
NUM_RANKS = 4  # xshare-ep's expert-parallel ranks


def _case(policy, router, tokens, dtype="bf16", metrics="on", *, entry="prune_route", **extra) -> dict:
    case = dict(entry=entry, policy=policy, router=router, tokens=tokens, dtype=dtype, metrics=metrics)
    case.update(fill=False, pdl=False, votes=False, nv="tensor", stats=False, routing_sums_mass=True)
    case.update(extra)
    return case


def _cases() -> list[dict]:
    cases = []
    routers, metrics = list(ROUTERS), ("off", "on", "gated")
    # every policy at every T; the router, dtype, metrics and dependent launch rotate with different
    # periods, so each policy meets each router and each of the other settings
    for p, policy in enumerate(POLICIES):
        for t, tokens in enumerate(TOKENS):
            cases.append(
                _case(
                    policy,
                    routers[(p + t) % len(routers)],
                    tokens,
                    "bf16" if (p + t) % 2 == 0 else "fp32",
                    metrics[(p + 2 * t) % 3],
                    pdl=(p + t // 2) % 2 == 1,
                    votes=policy in ("xshare-spec", "moe-spec-request") and t % 2 == 1,
                    nv="int" if (p + t) % 7 == 3 else "tensor",
                )
            )
    # DeepSeek-V3's router where one row or a program per row routes on a warp per expert group
    for policy in ("none", "oea", "xshare", "moe-spec-static", "lynx"):
        for tokens in (1, 2, 8, 32, 257):
            cases.append(_case(policy, "deepseek-v3", tokens, "bf16", "gated", pdl=True))
    # dropped slots filled with weight-0 ids (backends that cannot take -1)
    for policy in ("none", "oea", "xshare-truncation"):
        for router in ("softmax", "deepseek-v3"):
            for tokens in (1, 8, 32):
                cases.append(_case(policy, router, tokens, "bf16", "on", fill=True))
    # the select-only entry point (GPT-OSS's default MoE backend and every masked route)
    for p, policy in enumerate(POLICIES):
        for tokens in (1, 32):
            cases.append(
                _case(policy, "softmax", tokens, "bf16", "gated" if (p + tokens) % 2 else "off", entry="select")
            )
    for policy in ("oea", "moe-spec-static", "lynx", "xshare"):
        cases.append(_case(policy, "softmax", 32, "bf16", "off", entry="select", stats=True))
    # the other side of the open switch: the selection scores every row for the retained mass
    for policy in ("oea", "moe-spec-static", "lynx"):
        for router, tokens in (("softmax", 32), ("deepseek-v3", 257)):
            for metrics in ("on", "gated"):
                cases.append(_case(policy, router, tokens, "bf16", metrics, routing_sums_mass=False))
    seen, unique = set(), []
    for case in cases:
        key = case_id(case)
        if key not in seen:
            seen.add(key)
            unique.append(case)
    return unique


def case_id(case: dict) -> str:
    """A readable name of one call, unique in :data:`CASES`."""
    parts = [
        case["entry"],
        case["policy"],
        case["router"],
        f"T{case['tokens']}",
        case["dtype"],
        f"metrics-{case['metrics']}",
    ]
    for flag in ("fill", "pdl", "votes", "stats"):
        if case[flag]:
            parts.append(flag)
    if case["nv"] != "tensor":
        parts.append("nv-int")
    if not case.get("routing_sums_mass", True):
        parts.append("select-mass")
    return "/".join(parts)


CASES: list[dict] = _cases()


def _calibration_files(folder: Path, num_experts: int) -> tuple[str, str]:
    """A static ranking and a co-activation file for E experts (synthetic, fixed)."""
    counts = [[float((e * 7919) % 101) for e in range(num_experts)]]
    pairs = [
        [counts[0][i] if i == j else float((i * 31 + j * 17) % 23) for j in range(num_experts)]
        for i in range(num_experts)
    ]
    ranking, coactivation = folder / f"ranking_{num_experts}.json", folder / f"coactivation_{num_experts}.json"
    header = {"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}
    ranking.write_text(json.dumps(header))
    coactivation.write_text(json.dumps({**header, "coactivation": [pairs]}))
    return str(ranking), str(coactivation)


def build_call(case: dict, folder: Path) -> tuple[RoutingCall, PrunerConfig, dict]:
    """The call, config and entry-point keywords of one case, on CPU tensors."""
    num_experts, router = ROUTERS[case["router"]]
    fields, tokens_per_request = POLICIES[case["policy"]]
    fields = dict(fields)
    if fields.get("ranking") in ("static", "coactivation"):
        ranking, coactivation = _calibration_files(folder, num_experts)
        fields["static_ranking_path"] = ranking if fields["ranking"] == "static" else coactivation
    cfg = PrunerConfig(**fields)
    num_tokens = case["tokens"]
    gen = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[case["dtype"]]
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(dtype)
    bias = torch.randn(num_experts, generator=gen) if case["router"] == "deepseek-v3" else None
    num_valid: Any = num_tokens
    if case["nv"] == "tensor":
        num_valid = torch.tensor([num_tokens], dtype=torch.int32)
    call = RoutingCall(
        logits,
        router,
        tokens_per_request=tokens_per_request,
        num_valid_tokens=num_valid,
        expert_to_rank=torch.arange(num_experts) % NUM_RANKS,
        token_weights=torch.rand(num_tokens, generator=gen) if case["votes"] else None,
        correction_bias=bias,
    )
    kwargs: dict[str, Any] = {}
    if case["metrics"] != "off":
        kwargs["metrics_row"] = torch.zeros(4, dtype=torch.int64)
    if case["metrics"] == "gated":
        kwargs["metrics_gate"] = torch.ones(1, dtype=torch.int32)
    if case["entry"] == "select":
        if case["stats"]:
            kwargs["stats_out"] = torch.zeros(2, dtype=torch.int64)
    else:
        kwargs["fill_dropped"] = case["fill"]
        kwargs["enable_pdl"] = case["pdl"]
    if not case.get("routing_sums_mass", True):
        kwargs["routing_sums_mass"] = False
    return call, cfg, kwargs


# ------------------------------------------------------------------------------------------ capture
def capture(case: dict, folder: Path) -> list[tuple]:
    """The launches of one case, planned, not run: ``[(jit function, grid, args, kwargs)]``."""
    from ..kernels.launch import planned_launches

    call, cfg, kwargs = build_call(case, folder)
    entry = "select" if case["entry"] == "select" else "prune_route"
    return [
        (launch.fn, launch.grid, launch.args, launch.kwargs)
        for launch in planned_launches(call, cfg, entry=entry, **kwargs)
    ]


def _values(name: str, value: Any) -> dict[str, Any]:
    """A constexpr as the manifest records it: a bundle's fields as ``NAME.FIELD``, a jit function by
    its name, plain values as they are (anything else as its repr)."""
    if hasattr(value, "_asdict"):  # a named tuple of constexprs
        return {f"{name}.{field}": _value(field_value) for field, field_value in value._asdict().items()}
    return {name: _value(value)}


def _value(value: Any) -> Any:
    if hasattr(value, "value"):  # a tl.constexpr
        value = value.value
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if hasattr(value, "__name__") and hasattr(value, "fn"):  # a jit function (a set rule)
        return value.__name__
    return repr(value)


def _parameters(fn) -> list[tuple[str, bool]]:
    """The kernel's parameters as (name, is constexpr), compiled or under Triton's interpreter."""
    raw = getattr(fn, "fn", fn)
    return [(name, "constexpr" in str(param.annotation)) for name, param in inspect.signature(raw).parameters.items()]


def launch_record(fn, grid: tuple, args: tuple, kwargs: dict) -> dict:
    """What one launch runs: the kernel, grid, warps, launch options and every constexpr's value."""
    parameters = _parameters(fn)
    names = [name for name, _ in parameters]
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    constexprs: dict[str, Any] = {}
    for name, constexpr in parameters:
        if constexpr:
            constexprs.update(_values(name, bound[name]))
    options = {k: _value(kwargs[k]) for k in LAUNCH_OPTIONS if k in kwargs and k != "num_warps"}
    return dict(
        kernel=fn.__name__,
        grid=list(grid),
        num_warps=kwargs.get("num_warps", 4),
        options=options,
        constexprs=dict(sorted(constexprs.items())),
    )


_PARAM = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*_param_(\d+)\b")
_COMMENT = re.compile(r"\s*//.*$")


def normalized_ptx(ptx: str, name: str) -> str:
    """PTX with what names the source rather than the code taken out: the entry's name and its
    parameters' names (``<kernel>_param_N``), ``.file``/``.loc`` directives and the debug sections
    (line information is off when compiled here, but a stray directive would name a file and line)."""
    out = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith((".file", ".loc", "//")) or stripped == "":
            continue
        if stripped.startswith(".section") and ".debug" in stripped:
            break  # the debug sections come last
        line = _COMMENT.sub("", _PARAM.sub(r"param_\1", line)).replace(f".entry {name}(", ".entry kernel(")
        out.append(line)
    return "\n".join(out) + "\n"


def compile_ptx(fn, args: tuple, kwargs: dict, capability: int = 90) -> str:
    """The PTX of one recorded launch compiled for ``sm_<capability>`` with Triton's own argument
    specialization (the binder a real launch runs), stopping after the PTX stage (no ptxas)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return _ptx_of(ASTSource(fn, signature, constexprs, attrs), target, options.__dict__)


def _ptx_of(src, target, options: dict) -> str:
    """Run Triton's stages up to PTX, as ``triton.compile`` does, without its cache and ptxas."""
    from triton import __version__
    from triton._C.libtriton import ir
    from triton.compiler import make_backend

    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    stages: dict = {}
    backend.add_stages(stages, opts, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), context)
    metadata = {"hash": "manifest", "target": target, **opts.__dict__, "triton_version": __version__}
    for ext, stage in stages.items():
        module = stage(module, metadata)
        if ext == "ptx":
            return module
    raise RuntimeError("Triton's stages produced no PTX")


def ptx_digest(fn, args: tuple, kwargs: dict) -> str:
    """SHA-256 of the launch's normalized sm_90 PTX (:func:`normalized_ptx`)."""
    ptx = compile_ptx(fn, args, kwargs)
    return "sha256:" + hashlib.sha256(normalized_ptx(ptx, fn.__name__).encode()).hexdigest()


_CONSTANT_BANK = re.compile(r"c\[0x[0-9a-f]+\]\[0x[0-9a-f]+\]")
_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?);")


def masked_sass(fn, args: tuple, kwargs: dict) -> list[str]:
    """The launch's sm_90 SASS (compiled with ptxas and disassembled with the ``cuobjdump`` Triton
    ships), one instruction a line, with every constant-bank operand (``c[bank][offset]``: the kernel's
    parameters among them) masked: removing a parameter moves the others' offsets and nothing else."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from .kernel_compile import kernel_sass

    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    import triton

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    lines = []
    for match in _SASS_LINE.finditer(kernel_sass(compiled)):
        instruction = " ".join(match.group(1).split())
        if not instruction.startswith("NOP"):
            lines.append(_CONSTANT_BANK.sub("c[*][*]", instruction))
    return lines


def sass_digests(case_ids: list[str], progress=None) -> dict[str, list[str]]:
    """``{call id: [digest of each launch's masked SASS]}`` for the named calls of :data:`CASES`
    (:func:`masked_sass`): run on two commits, equal digests show a change left the machine code as
    it was but for parameter offsets."""
    wanted = set(case_ids)
    out: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for case in CASES:
            name = case_id(case)
            if name not in wanted:
                continue
            out[name] = [
                "sha256:" + hashlib.sha256("\n".join(masked_sass(fn, args, kwargs)).encode()).hexdigest()
                for fn, _, args, kwargs in capture(case, Path(folder))
            ]
            if progress is not None:
                progress(len(out), len(wanted), len(out))
    return out


# ------------------------------------------------------------------------------------------ manifest
def _specialization_key(fn, args: tuple, kwargs: dict) -> str:
    """What decides a launch's compiled code: the kernel, Triton's specialization of its arguments,
    its constexprs and options (two launches with one key compile to one binary)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _, specialization, options = binder(*args, **kwargs)
    return repr((fn.__name__, specialization, sorted(options.items()) if isinstance(options, dict) else options))


def build(cases: list[dict] | None = None, ptx: bool = True, progress=None) -> dict:
    """The manifest of ``cases`` (default :data:`CASES`): ``{"triton": version, "calls": [...]}``, one
    entry per call with its launches (and their PTX digests with ``ptx``)."""
    import triton

    if ptx and os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the PTX digests need the kernels compiled")
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"
    cases = CASES if cases is None else cases
    digests: dict[str, str] = {}
    calls = []
    with tempfile.TemporaryDirectory() as folder:
        for number, case in enumerate(cases):
            records = []
            for fn, grid, args, kwargs in capture(case, Path(folder)):
                record = launch_record(fn, grid, args, kwargs)
                if ptx:
                    key = _specialization_key(fn, args, kwargs)
                    if key not in digests:
                        digests[key] = ptx_digest(fn, args, kwargs)
                    record["ptx"] = digests[key]
                records.append(record)
            calls.append(dict(id=case_id(case), case=case, launches=records))
            if progress is not None:
                progress(number + 1, len(cases), len(digests))
    return dict(triton=triton.__version__, capability=90, ptx=ptx, calls=calls)


def dumps(manifest: dict) -> str:
    """The manifest as committed: JSON, one key per line, so that its diff names each changed value."""
    return json.dumps(manifest, indent=1) + "\n"


def without_ptx(manifest: dict) -> dict:
    """The manifest's launch part alone (every PTX digest dropped)."""
    calls = [
        dict(call, launches=[{k: v for k, v in launch.items() if k != "ptx"} for launch in call["launches"]])
        for call in manifest["calls"]
    ]
    return dict(manifest, ptx=False, calls=calls)


def differences(want: dict, got: dict, limit: int = 40) -> list[str]:
    """Readable differences between two manifests, per call and launch (at most ``limit`` lines)."""
    lines: list[str] = []
    want_calls = {call["id"]: call for call in want["calls"]}
    got_calls = {call["id"]: call for call in got["calls"]}
    for name in sorted(want_calls.keys() - got_calls.keys()):
        lines.append(f"{name}: missing")
    for name in sorted(got_calls.keys() - want_calls.keys()):
        lines.append(f"{name}: new")
    for name, call in want_calls.items():
        if name not in got_calls:
            continue
        a, b = call["launches"], got_calls[name]["launches"]
        if [x["kernel"] for x in a] != [x["kernel"] for x in b]:
            lines.append(f"{name}: kernels {[x['kernel'] for x in a]} -> {[x['kernel'] for x in b]}")
            continue
        for x, y in zip(a, b, strict=True):
            for field in ("grid", "num_warps", "options", "ptx"):
                if x.get(field) != y.get(field):
                    lines.append(f"{name} {x['kernel']}: {field} {x.get(field)} -> {y.get(field)}")
            keys = x["constexprs"].keys() | y["constexprs"].keys()
            for key in sorted(keys):
                if x["constexprs"].get(key, "<absent>") != y["constexprs"].get(key, "<absent>"):
                    lines.append(
                        f"{name} {x['kernel']}: {key} {x['constexprs'].get(key, '<absent>')} -> "
                        f"{y['constexprs'].get(key, '<absent>')}"
                    )
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the manifest to this file")
    parser.add_argument("--check", type=Path, help="compare with this committed manifest; exit 1 on a difference")
    parser.add_argument("--no-ptx", action="store_true", help="the launches alone (seconds), no PTX digests")
    parser.add_argument(
        "--sass",
        nargs=2,
        type=Path,
        metavar=("CALLS", "OUT"),
        help="write the masked-SASS digests of the calls named in CALLS (a JSON list of ids) to OUT",
    )
    args = parser.parse_args(argv)

    def progress(done: int, total: int, compiled: int) -> None:
        if done % 25 == 0 or done == total:
            print(f"{done}/{total} calls, {compiled} kernels compiled", file=sys.stderr, flush=True)

    if args.sass:
        calls, out = args.sass
        out.write_text(json.dumps(sass_digests(json.loads(calls.read_text()), progress), indent=1) + "\n")
        return 0
    manifest = build(ptx=not args.no_ptx, progress=progress)
    if args.write:
        args.write.write_text(dumps(manifest))
    if args.check:
        want = json.loads(args.check.read_text())
        if args.no_ptx:
            want = without_ptx(want)
        found = differences(want, manifest)
        for line in found:
            print(line)
        return 1 if found else 0
    if not args.write:
        sys.stdout.write(dumps(manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
