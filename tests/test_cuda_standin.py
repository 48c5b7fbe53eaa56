"""The ops of the CUDA ``sgl_kernel`` stand-in against SGLang's own versions of the same ops, on CPU.

References: SGLang 0.5.23's torch-native ``forward_native`` of ``RMSNorm``, ``GemmaRMSNorm``,
``SiluAndMul``, ``GeluAndMul`` and ``RotaryEmbedding``; ``fused_topk_torch_native`` for the softmax
top-k; SGLang's Triton ``moe_align_small_numel`` (the "+1" align convention, run under Triton's
interpreter here) for ``moe_align_block_size``; SGLang's Triton ``moe_sum_reduce_triton`` for
``moe_sum_reduce``.  The JIT replacement is checked in a subprocess started as the GPU launcher starts
SGLang's processes (the stand-in folder first on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from xshare_sglang.testing.cuda_standin.sgl_kernel import _jit_patch, _ops

pytestmark = pytest.mark.sglang

STANDIN_DIR = os.path.join(os.path.dirname(_ops.__file__), os.pardir)

#: bf16 results computed in float32 then rounded may differ by one bf16 ulp from a reference that
#: rounds at other steps.
BF16 = {"atol": 2e-2, "rtol": 1.6e-2}


@pytest.fixture(scope="module")
def layers():
    pytest.importorskip("sglang")
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    return {"RMSNorm": RMSNorm, "GemmaRMSNorm": GemmaRMSNorm, "SiluAndMul": SiluAndMul, "GeluAndMul": GeluAndMul}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_equals_sglang_native(layers, dtype, gemma):
    torch.manual_seed(0)
    hidden = 256
    norm = layers["GemmaRMSNorm" if gemma else "RMSNorm"](hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.3 + (0.0 if gemma else 1.0))
    norm = norm.to(dtype)
    x = torch.randn(7, hidden, dtype=dtype) * 3
    residual = torch.randn(7, hidden, dtype=dtype)
    plain = _ops.gemma_rmsnorm if gemma else _ops.rmsnorm
    fused = _ops.gemma_fused_add_rmsnorm if gemma else _ops.fused_add_rmsnorm
    tol = BF16 if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}

    torch.testing.assert_close(plain(x, norm.weight.data, 1e-6), norm.forward_native(x.clone()), **tol)
    out = torch.empty_like(x)
    assert plain(x, norm.weight.data, 1e-6, out=out) is out

    want_x, want_r = norm.forward_native(x.clone(), residual.clone())
    got_x, got_r = x.clone(), residual.clone()
    assert fused(got_x, got_r, norm.weight.data, 1e-6) is None
    torch.testing.assert_close(got_r, want_r, **tol)
    torch.testing.assert_close(got_x, want_x, **tol)


def test_rmsnorm_is_not_the_identity():
    """A guard on the reference: a norm that forgot the weight or the scaling would fail here."""
    x = torch.full((2, 4), 2.0)
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(_ops.rmsnorm(x, w, 0.0), w.expand(2, 4))
    torch.testing.assert_close(_ops.gemma_rmsnorm(x, w, 0.0), (w + 1).expand(2, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_equals_sglang_native(layers, dtype, kind):
    torch.manual_seed(1)
    x = torch.randn(5, 2 * 96, dtype=dtype) * 2
    if kind == "silu":
        ref, op = layers["SiluAndMul"](), _ops.silu_and_mul
    else:
        approximate = "tanh" if kind == "gelu_tanh" else "none"
        ref = layers["GeluAndMul"](approximate=approximate)
        op = _ops.gelu_tanh_and_mul if kind == "gelu_tanh" else _ops.gelu_and_mul
    tol = BF16 if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(op(x), ref.forward_native(x), **tol)
    out = torch.empty(5, 96, dtype=dtype)
    assert op(x, out) is out
    torch.testing.assert_close(out, ref.forward_native(x), **tol)
    with pytest.raises(NotImplementedError):
        op(x, out, torch.zeros(5, dtype=torch.int32))


@pytest.mark.parametrize(("head_size", "rotary_dim", "neox"), [(128, 128, True), (128, 64, False), (64, 64, False)])
def test_rotary_equals_sglang_native(monkeypatch, head_size, rotary_dim, neox):
    import sglang.srt.layers.rotary_embedding.base as base

    # SGLang picks a compiled fallback kernel at construction off CUDA; its CPU flag keeps forward_native.
    monkeypatch.setattr(base, "_is_cpu", True)
    from sglang.srt.layers.rotary_embedding import get_rope

    rope = get_rope(
        head_size, rotary_dim=rotary_dim, max_position=512, base=10000.0, is_neox_style=neox, dtype=torch.float32
    )
    torch.manual_seed(2)
    tokens, q_heads, k_heads = 6, 4, 2
    positions = torch.tensor([0, 3, 17, 100, 511, 2])
    q = torch.randn(tokens, q_heads * head_size)
    k = torch.randn(tokens, k_heads * head_size)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())

    got_q, got_k = q.clone(), k.clone()
    _ops.rotary_embedding(positions, got_q, got_k, head_size, rope.cos_sin_cache, neox)
    torch.testing.assert_close(got_q, want_q.reshape(got_q.shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k.reshape(got_k.shape), atol=1e-5, rtol=1e-5)
    assert not torch.equal(got_q, q)

    # The JIT entry point as RotaryEmbedding.forward_cuda calls it: [T, heads, D] views of the rotated part.
    got_q, got_k = q.clone(), k.clone()
    q_view = got_q.view(tokens, q_heads, head_size)[..., :rotary_dim]
    k_view = got_k.view(tokens, k_heads, head_size)[..., :rotary_dim]
    _ops.apply_rope_with_cos_sin_cache_inplace(
        positions=positions, q=q_view, k=k_view, cos_sin_cache=rope.cos_sin_cache, is_neox=neox
    )
    torch.testing.assert_close(got_q, want_q.reshape(got_q.shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k.reshape(got_k.shape), atol=1e-5, rtol=1e-5)


def test_rope_fused_kv_store():
    from sglang.kernels.ops.attention.rope import FusedSetKVBufferArg

    torch.manual_seed(3)
    tokens, heads, dim = 3, 2, 8
    cache = torch.randn(16, dim)
    q, k, v = (torch.randn(tokens, heads, dim) for _ in range(3))
    k_buf, v_buf = torch.zeros(10, heads * dim), torch.zeros(10, heads * dim)
    loc = torch.tensor([7, 1, 4])
    args = FusedSetKVBufferArg(value=v.reshape(tokens, -1), k_buffer=k_buf, v_buffer=v_buf, cache_loc=loc)
    _ops.apply_rope_with_cos_sin_cache_inplace(q, k, cache, torch.tensor([1, 2, 3]), is_neox=True, fused_args=args)
    torch.testing.assert_close(k_buf[loc], k.reshape(tokens, -1))
    torch.testing.assert_close(v_buf[loc], v.reshape(tokens, -1))
    assert k_buf[[0, 2, 3]].abs().sum() == 0


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("experts", [8, 128])
def test_topk_softmax_equals_sglang_native(renormalize, experts):
    from sglang.srt.layers.moe.topk import fused_topk_torch_native

    torch.manual_seed(4)
    tokens, k = 9, min(8, experts // 2)
    logits = torch.randn(tokens, experts, dtype=torch.bfloat16) * 2
    hidden = torch.zeros(tokens, 16)
    want_w, want_ids = fused_topk_torch_native(hidden, logits, k, renormalize)
    weights = torch.empty(tokens, k, dtype=torch.float32)
    ids = torch.empty(tokens, k, dtype=torch.int32)
    _ops.topk_softmax(weights, ids, logits, renormalize)
    # Same experts per row (order may differ on ties), same weights for them.
    got_sorted, order = ids.long().sort(dim=-1)
    want_sorted, want_order = want_ids.long().sort(dim=-1)
    assert torch.equal(got_sorted, want_sorted)
    torch.testing.assert_close(weights.gather(-1, order), want_w.float().gather(-1, want_order), atol=1e-6, rtol=1e-5)


def test_topk_softmax_bias_picks_but_does_not_weigh():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    weights, ids = torch.empty(1, 2), torch.empty(1, 2, dtype=torch.int32)
    _ops.topk_softmax(weights, ids, logits, False, 0.0, bias)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(weights[0], probs[[3, 0]])


def _align_buffers(numel: int, experts: int, block: int):
    """Buffers sized as SGLang's ``moe_align_block_size`` (triton_utils) sizes them."""
    padded = numel * block if numel < experts + 1 else numel + (experts + 1) * (block - 1)
    padded = (padded + 3) // 4 * 4
    blocks = -(-padded // block)
    return (
        torch.full((padded,), -7, dtype=torch.int32),
        torch.full((blocks,), -7, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
    )


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block", "dropped", "seed"),
    [
        (1, 8, 128, 16, 0.0, 0),
        (4, 8, 128, 16, 0.3, 1),
        (8, 8, 128, 64, 0.5, 2),
        (5, 4, 16, 16, 0.0, 3),
        (16, 4, 8, 4, 0.2, 4),
    ],
)
def test_moe_align_equals_sglang_triton(tokens, top_k, experts, block, dropped, seed):
    from sglang.kernels.ops.moe.moe_align_small_numel import moe_align_small_numel

    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    ids[torch.rand(ids.shape, generator=gen) < dropped] = -1
    numel = ids.numel()

    want_sorted, want_eids, want_total = _align_buffers(numel, experts, block)
    moe_align_small_numel(ids, experts + 1, block, want_sorted, want_eids, want_total)
    got_sorted, got_eids, got_total = _align_buffers(numel, experts, block)
    cumsum = torch.zeros(experts + 2, dtype=torch.int32)
    _ops.moe_align_block_size(ids, experts + 1, block, got_sorted, got_eids, got_total, cumsum, True)

    total = int(want_total)
    assert int(got_total) == total
    assert torch.equal(got_sorted[:total], want_sorted[:total])
    assert torch.equal(got_eids[: total // block], want_eids[: total // block])
    assert (got_sorted[total:] == numel).all()  # pad_sorted_token_ids fills the whole buffer
    assert int(cumsum[experts + 1]) == total and int(cumsum[0]) == 0
    if dropped:
        assert (got_eids[: total // block] == -1).any()


def test_moe_align_hand_example():
    """SGLang's docstring example, in the +1 convention (experts 1..4 of 5 held, bucket 0 empty)."""
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    sorted_ids, eids, total = (
        torch.empty(32, dtype=torch.int32),
        torch.empty(8, dtype=torch.int32),
        torch.empty(1, dtype=torch.int32),
    )
    _ops.moe_align_block_size(ids, 6, 4, sorted_ids, eids, total, torch.empty(8, dtype=torch.int32), True)
    assert int(total) == 16
    assert sorted_ids[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert eids[:4].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_moe_sum_reduce_equals_sglang_triton(scale):
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

    torch.manual_seed(5)
    x = torch.randn(6, 8, 64, dtype=torch.bfloat16)
    want = torch.empty(6, 64, dtype=torch.bfloat16)
    moe_sum_reduce_triton(x, want, scale)
    got = torch.empty_like(want)
    _ops.moe_sum_reduce(x, got, scale)
    torch.testing.assert_close(got, want, **BF16)


def test_is_arch_support_pdl(monkeypatch):
    from xshare_sglang.testing.cuda_standin.sgl_kernel import utils

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for capability, want in (((9, 0), True), ((10, 0), True), ((8, 9), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert utils.is_arch_support_pdl() is want

    def no_device(*args):
        raise RuntimeError("no CUDA device")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_device)
    assert utils.is_arch_support_pdl() is False


def test_unavailable_op_names_itself():
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.flash_mla"):
        _ops.unavailable("flash_mla")(1, 2)


def test_jit_table_names_existing_sglang_functions():
    """Every replaced attribute exists in SGLang 0.5.23 (a stale table would leave a JIT op in place)."""
    import importlib

    for module_name, names in _jit_patch.JIT_REPLACEMENTS.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert hasattr(module, name), f"{module_name}.{name}"


def test_stand_in_replaces_jit_ops_in_a_fresh_process(tmp_path):
    """As the GPU launcher starts SGLang: the stand-in folder first on PYTHONPATH, sitecustomize runs."""
    import sglang

    script = (
        "import sgl_kernel, sglang.kernels.ops.attention.rope as rope, sglang.kernels.ops.layernorm.norm as norm\n"
        "from sglang.kernels.ops.activation.activation import silu_and_mul\n"
        "from sgl_kernel import _ops\n"
        "assert sgl_kernel.STANDIN == 'cuda', sgl_kernel.__file__\n"
        "assert rope.apply_rope_with_cos_sin_cache_inplace is _ops.apply_rope_with_cos_sin_cache_inplace\n"
        "assert silu_and_mul is _ops.silu_and_mul\n"
        "assert norm.fused_add_rmsnorm is _ops.fused_add_rmsnorm and not norm.can_use_fused_inplace_qknorm(128, None)\n"
        "assert sgl_kernel.some_cuda_only_op.__name__ == 'some_cuda_only_op'\n"
        "print(sgl_kernel.scalar_types.uint4b8)\n"
    )
    env = dict(os.environ)
    real = os.path.join(os.path.dirname(os.path.dirname(sglang.__file__)), "sgl_kernel", "scalar_type.py")
    env["XSHARE_SGL_KERNEL_SCALAR_TYPE"] = real
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(STANDIN_DIR), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "uint4b8" in done.stdout


def test_module_standins_are_placeholders_and_never_shadow_a_real_module(monkeypatch):
    import importlib

    import pydantic

    from xshare_sglang.testing.cuda_standin import _module_standins as ms

    monkeypatch.setitem(ms.STANDIN_MODULES, "xshare_absent_pkg", "test")
    monkeypatch.setitem(ms.STANDIN_MODULES, "colorsys", "test: a real module stays real")
    finder = ms.StandinFinder()
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    for name in ("xshare_absent_pkg", "xshare_absent_pkg.sub", "colorsys"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    sub = importlib.import_module("xshare_absent_pkg.sub")
    thing = sub.Thing
    assert thing is sub.Thing and thing.CONSTANT is thing.CONSTANT  # stable, attribute chains work
    with pytest.raises(NotImplementedError, match=r"xshare_absent_pkg\.sub\.Thing"):
        thing()

    class Model(pydantic.BaseModel):  # SGLang's request models name stood-in types in fields
        field: thing | None = None

    assert Model(field=3).field == 3
    assert hasattr(importlib.import_module("colorsys"), "rgb_to_hsv")
    assert finder.find_spec("json", None) is None  # not listed: never answered


def test_standin_reports_unimplemented_names():
    from xshare_sglang.testing.cuda_standin import sgl_kernel

    op = sgl_kernel.some_op_xshare_test
    assert "some_op_xshare_test" in sgl_kernel.STOOD_IN_AS_UNAVAILABLE
    with pytest.raises(NotImplementedError, match="some_op_xshare_test"):
        op()
    with pytest.raises(AttributeError):
        sgl_kernel.__wrapped__  # noqa: B018  (dunders are never stood in)
