"""The device bundle (``scripts/device_bundle.py``): its module list, checked by importing the launcher as
the GPU machine would, and its parts that can be built without a network."""

from __future__ import annotations

import importlib.metadata as md
import tarfile
from pathlib import Path

import pytest

from xshare_sglang.testing import device_bundle as db
from xshare_sglang.testing.cuda_standin import _module_standins

pytestmark = pytest.mark.sglang


def test_bundle_wheels_are_what_the_device_lacks_and_installed_here():
    device = db.device_packages()
    assert {"torch", "triton", "transformers", "numpy"} <= device and len(device) > 150
    for name in db.BUNDLE_WHEELS:
        assert db.normalize(name) not in device, f"{name} is in the device image: do not carry it"
        assert md.version(name), name  # the version the wheel is pinned to
    assert not set(_module_standins.STANDIN_MODULES) & {db.normalize(n) for n in db.BUNDLE_WHEELS}


#: ``sgl_kernel`` names the CUDA branches import but this server never calls (flashinfer sampling,
#: int8 GEMMs, aiter's MoE sum).  A new name here needs a look: is it called on the served path?
NEVER_CALLED = {"int8_scaled_mm", "moe_sum", "top_k_renorm_prob", "top_p_renorm_prob"}
#: Modules answered by empty stand-ins (``_module_standins.STANDIN_MODULES`` and ``sgl_kernel`` submodules).
STOOD_IN = {
    "IPython",
    "datasets",
    "gguf",
    "soundfile",
    "tvm_ffi",
    "xgrammar",
    "sgl_kernel.kvcacheio",
    "sgl_kernel.quantization",
}


def _report(done, key: str) -> set[str]:
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(key + " ")]
    return set(line[len(key) + 1 :].split())


@pytest.mark.parametrize("cuda_branches", [False, True], ids=["cpu-branches", "cuda-branches"])
def test_launcher_imports_with_only_the_device_packages_and_the_bundle(tmp_path, cuda_branches):
    """Every launcher module and the benchmark client import in a process that sees only the device
    image's distributions, the bundle's wheels, SGLang, this checkout and the stand-ins (``sgl_kernel``,
    unused modules); with ``cuda_branches`` as SGLang's modules import on an H100."""
    modules = db.LAUNCHER_MODULES + db.CLIENT_MODULES
    done = db.launcher_import_check(tmp_path, db.allowed_distributions(), modules, cuda_branches=cuda_branches)
    assert done.returncode == 0 and "ALL IMPORTED" in done.stdout, (done.stdout + done.stderr)[-4000:]
    assert _report(done, "UNAVAILABLE") <= NEVER_CALLED
    stood_in = _report(done, "STOOD IN")
    # a stood-in package's own submodules (IPython.display) are stood in with it
    assert {name for name in stood_in if name not in STOOD_IN and name.split(".")[0] not in STOOD_IN} == set()
    assert "sgl_kernel.utils" not in stood_in  # the stand-in's own utils (is_arch_support_pdl) is used
    if cuda_branches:
        assert "sgl_kernel.quantization" in stood_in  # the CUDA branches were taken


def test_the_import_check_does_block_what_is_not_carried(tmp_path):
    """Negative control: leave one needed wheel out and the check must fail on exactly that module."""
    allowed = db.allowed_distributions() - {"orjson"}
    done = db.launcher_import_check(tmp_path, allowed, modules=("sglang.srt.entrypoints.http_server",))
    assert done.returncode == 1
    assert "No module named 'orjson'" in done.stdout + done.stderr


def test_sglang_archive_lists_python_files_and_the_tuned_configs():
    files = db.sglang_files()
    names = {str(p) for p in files}
    assert "sglang/launch_server.py" in names and "sglang/srt/models/qwen3_moe.py" in names
    assert {p.suffix for p in files} == {".py", ".json"}
    assert db.found_moe_configs(files) == set(db.MOE_CONFIGS)
    assert all(p.name in db.MOE_CONFIGS for p in files if p.suffix == ".json")


def test_archive_round_trip(tmp_path):
    root = tmp_path / "src" / "sglang"
    (root / "srt" / "configs" / "triton_3_6_0").mkdir(parents=True)
    (root / "__init__.py").write_text("X = 1\n")
    (root / "srt" / "a.py").write_text("Y = 2\n")
    (root / "srt" / "configs" / "triton_3_6_0" / db.MOE_CONFIGS[0]).write_text("{}\n")
    (root / "srt" / "configs" / "triton_3_6_0" / "E=8,N=8,device_name=X.json").write_text("{}\n")
    (root / "srt" / "kernel.cuh").write_text("// not carried\n")
    archive = db.write_sglang_archive(tmp_path / "s.tar.xz", root)
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    assert names == sorted(
        ["sglang/__init__.py", "sglang/srt/a.py", f"sglang/srt/configs/triton_3_6_0/{db.MOE_CONFIGS[0]}"]
    )


def test_sizes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y" * 5)
    assert db.tree_size(tmp_path) == 15
    repo = Path(__file__).resolve().parents[1]
    size = db.checkout_size(repo)
    assert 1_000_000 < size < db.CARRY_LIMIT
    assert db.scalar_type_source().is_file()


#: Run after the launcher's modules imported with their CUDA branches: SGLang's CUDA-path names are
#: bound to the stand-in's ops, and SGLang's own CUDA-branch layers, called on CPU tensors, call them
#: with compatible arguments and agree with their torch-native forward.
CUDA_PATH_CHECKS = """
import torch
import sglang.srt.layers.activation as act
import sglang.srt.layers.attention.triton_backend as tb
import sglang.srt.layers.layernorm as ln
import sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe as fm
import sglang.srt.layers.rotary_embedding.base as rb
import sglang.srt.models.utils as model_utils
from sglang.kernels.selector import get_kernel
from sglang.kernels.spec import KernelBackend
from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import moe_align_block_size
from sglang.srt.layers.rotary_embedding import get_rope
from sgl_kernel import _ops, utils

bound = {
    "layernorm.rmsnorm": ln.rmsnorm is _ops.rmsnorm,
    "layernorm.fused_add_rmsnorm": ln.fused_add_rmsnorm is _ops.fused_add_rmsnorm,
    "layernorm._jit_fused_add_rmsnorm": ln._jit_fused_add_rmsnorm is _ops.fused_add_rmsnorm,
    "activation._jit_silu_and_mul": act._jit_silu_and_mul is _ops.silu_and_mul,
    "activation._sgl_silu_and_mul": act._sgl_silu_and_mul is _ops.silu_and_mul,
    "fused_moe.silu_and_mul": fm.silu_and_mul is _ops.silu_and_mul,
    "fused_moe.moe_sum_reduce": fm.moe_sum_reduce is _ops.moe_sum_reduce,
    "rope.apply_rope_with_cos_sin_cache_inplace": rb.apply_rope_with_cos_sin_cache_inplace
    is _ops.apply_rope_with_cos_sin_cache_inplace,
    "registry moe.topk_softmax": get_kernel("moe.topk_softmax") is _ops.topk_softmax,
    "registry moe.moe_align_block_size": get_kernel("moe.moe_align_block_size", KernelBackend.AOT)
    is _ops.moe_align_block_size,
    "triton_backend.is_arch_support_pdl": tb.is_arch_support_pdl is utils.is_arch_support_pdl,
    "qk-norm JIT probe says no": not model_utils.can_use_fused_inplace_qknorm(128, torch.bfloat16),
}
assert all(bound.values()), {k: v for k, v in bound.items() if not v}

close = lambda a, b: torch.allclose(a.float(), b.reshape(a.shape).float(), atol=3e-2, rtol=2e-2)
torch.manual_seed(0)
norm = ln.RMSNorm(256).to(torch.bfloat16)
x, r = torch.randn(5, 256, dtype=torch.bfloat16), torch.randn(5, 256, dtype=torch.bfloat16)
(a, b), (c, d) = norm.forward_cuda(x.clone(), r.clone()), norm.forward_native(x.clone(), r.clone())
y = torch.randn(4, 2 * 768, dtype=torch.bfloat16)
rope = get_rope(128, rotary_dim=128, max_position=4096, base=1e6, is_neox_style=True, dtype=torch.bfloat16)
pos = torch.tensor([0, 5, 99, 4000])
q, k = torch.randn(4, 32 * 128, dtype=torch.bfloat16), torch.randn(4, 4 * 128, dtype=torch.bfloat16)
(q1, k1), (q2, k2) = rope.forward_cuda(pos, q.clone(), k.clone()), rope.forward_native(pos, q.clone(), k.clone())
ids = torch.stack([torch.randperm(128)[:8] for _ in range(12)]).to(torch.int32)  # 96 slots: the AOT path
ids[0, :3] = -1
sorted_ids, expert_ids, total = moe_align_block_size(ids, 16, 128)
n = int(total[0])
called = {
    "RMSNorm.forward_cuda": close(norm.forward_cuda(x.clone()), norm.forward_native(x.clone())),
    "RMSNorm.forward_cuda residual": close(a, c) and close(b, d),
    "SiluAndMul.forward_cuda": close(act.SiluAndMul().forward_cuda(y), act.SiluAndMul().forward_native(y)),
    "RotaryEmbedding takes the JIT path": not rope.use_fallback_kernel,
    "RotaryEmbedding.forward_cuda": close(q1, q2) and close(k1, k2),
    "moe_align_block_size": sorted(i for i in sorted_ids[:n].tolist() if i < ids.numel()) == list(range(ids.numel()))
    and int(expert_ids[0]) == -1,
}
assert all(called.values()), {k: v for k, v in called.items() if not v}
print("CUDA PATH CHECKS PASSED")
"""


def test_cuda_branches_bind_and_call_the_stand_in(tmp_path):
    done = db.launcher_import_check(tmp_path, db.allowed_distributions(), cuda_branches=True, then=CUDA_PATH_CHECKS)
    assert done.returncode == 0 and "CUDA PATH CHECKS PASSED" in done.stdout, (done.stdout + done.stderr)[-4000:]


def _load_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "device_bundle.py"
    spec = importlib.util.spec_from_file_location("device_bundle_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("checkout", "code"), [(1000, 0), (db.CARRY_LIMIT, 1)])
def test_script_builds_and_checks_the_limit(tmp_path, monkeypatch, caplog, checkout, code):
    """``scripts/device_bundle.py --no-wheels`` on a small stand-in SGLang tree: the archive, the scalar
    type file, the sizes, and exit 1 saying by how much when bundle plus checkout exceed 64 MiB."""
    script = _load_script()
    root = tmp_path / "src" / "sglang"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("X = 1\n")
    (tmp_path / "scalar_type.py").write_text("# scalar types\n")
    monkeypatch.setattr(db, "sglang_dir", lambda: root)
    monkeypatch.setattr(db, "scalar_type_source", lambda: tmp_path / "scalar_type.py")
    monkeypatch.setattr(db, "checkout_size", lambda repo: checkout)
    out = tmp_path / "bundle"
    caplog.set_level("INFO", logger="device_bundle")
    assert script.main(["--out", str(out), "--no-wheels"]) == code
    assert (out / db.SGLANG_ARCHIVE).is_file() and (out / db.SCALAR_TYPE_FILE).is_file()
    bundle = db.tree_size(out)
    if code:
        assert f"over the device call's limit by {(bundle + checkout - db.CARRY_LIMIT) / 2**20:.2f} MiB" in caplog.text
    else:
        assert "fits, with" in caplog.text


def test_script_never_removes_a_folder_that_is_not_a_bundle(tmp_path):
    keep = tmp_path / "notes.txt"
    keep.write_text("mine\n")
    assert _load_script().main(["--out", str(tmp_path), "--no-wheels"]) == 2
    assert keep.read_text() == "mine\n"
