"""The CPU ops of the ``sgl_kernel`` stand-in against SGLang's own Triton kernels.

Each op is reached through SGLang's own ``*_func`` wrapper with its CPU branch switched on (the module's
``_is_cpu`` flag set and the stand-in op bound under the name SGLang imports it as), so the call is
made with exactly the arguments of SGLang's CPU call site.  The reference is the Triton kernel of the
same op, launched as SGLang's non-CPU branch launches it: without a GPU the project's conftest sets
``TRITON_INTERPRET=1`` and Triton's interpreter runs it on the CPU tensors; with one it runs natively on
copies of them on the GPU.  Every output must be exactly equal.  Draft trees are built with SGLang's own
draft-step functions and ``organize_draft_results``; verification targets accept some drafts and reject
others.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from tests.sglang_helpers import sglang_draft
from xshare_sglang.testing.cpu_server import cpu_server_env
from xshare_sglang.testing.standin import sgl_kernel as standin
from xshare_sglang.testing.standin.sgl_kernel import _ops

pytestmark = pytest.mark.sglang

BATCHES = (1, 3, 5)
#: (batch, topk, steps, draft tokens, seed) of the tree cases: topk 1-3, steps 1-4, batches 1, 3, 5.
TREES = (
    (1, 1, 1, 2, 0),
    (3, 1, 4, 5, 1),
    (5, 2, 1, 3, 2),
    (1, 2, 3, 6, 3),
    (3, 3, 2, 8, 4),
    (5, 3, 4, 10, 5),
    (3, 2, 4, 9, 6),
)
TREE_IDS = [f"bs{b}-topk{k}-steps{s}-n{n}" for b, k, s, n, _ in TREES]

#: Where the Triton kernels run: the CPU under Triton's interpreter, else the GPU.
TRITON_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


def on_triton(fn, *args, **kwargs) -> None:
    """Call ``fn`` with every tensor argument on :data:`TRITON_DEVICE`, then copy each one's final value
    back into the CPU tensor that was passed (on the CPU they are the same tensor)."""
    moved = [a.to(TRITON_DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    moved_kw = {k: v.to(TRITON_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    fn(*moved, **moved_kw)
    for given, used in [*zip(args, moved, strict=True), *((kwargs[k], moved_kw[k]) for k in kwargs)]:
        if isinstance(given, torch.Tensor) and used is not given:
            given.copy_(used)


def cpu_branch(monkeypatch: pytest.MonkeyPatch, module, **ops) -> None:
    """Switch ``module``'s CPU branch on, with the stand-in ops bound as SGLang binds them on CPU."""
    monkeypatch.setattr(module, "_is_cpu", True)
    for name, op in ops.items():
        monkeypatch.setattr(module, name, op, raising=False)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def token_table(gen: torch.Generator, rows: int, pool_len: int) -> torch.Tensor:
    """A request-to-token table (int32, as SGLang's) of distinct random slots."""
    return torch.randperm(rows * pool_len, generator=gen).view(rows, pool_len).to(torch.int32)


def requests(gen: torch.Generator, bs: int, rows: int) -> torch.Tensor:
    """Distinct ``req_to_token`` rows of ``bs`` requests (int64, as SGLang's)."""
    return torch.randperm(rows, generator=gen)[:bs]


def extends(gen: torch.Generator, bs: int, pool_len: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[start, end)`` slices of a row, empty ones and ones longer than Triton's 32-block included."""
    lengths = torch.randint(0, longest + 1, (bs,), generator=gen)
    lengths[0] = longest  # more than one block of the kernel's loop
    starts = torch.stack([torch.randint(0, pool_len - int(n) + 1, (1,), generator=gen)[0] for n in lengths])
    return starts, starts + lengths


# ---------------------------------------------------------------------------------------------------
# KV-cache slot bookkeeping


@pytest.mark.parametrize("bs", BATCHES)
def test_assign_req_to_token_pool(monkeypatch, bs) -> None:
    from sglang.srt.mem_cache import allocation

    gen = torch.Generator().manual_seed(100 + bs)
    rows, pool_len = 8, 96
    table = token_table(gen, rows, pool_len)
    req_pool_indices = requests(gen, bs, rows)
    start, end = extends(gen, bs, pool_len, 40)
    out_cache_loc = torch.randperm(10_000, generator=gen)[: int((end - start).sum())]
    ours, theirs = table.clone(), table.clone()

    cpu_branch(monkeypatch, allocation, assign_req_to_token_pool_cpu=standin.assign_req_to_token_pool_cpu)
    allocation.assign_req_to_token_pool_func(req_pool_indices, ours, start, end, out_cache_loc, bs)
    on_triton(
        allocation.assign_req_to_token_pool[(bs,)],
        req_pool_indices,
        theirs,
        start,
        end,
        out_cache_loc,
        pool_len,
        next_power_of_2(bs),
    )
    assert not torch.equal(theirs, table)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("bs", BATCHES)
def test_assign_extend_cache_locs(monkeypatch, bs) -> None:
    from sglang.kernels.ops.speculative import cache_locs

    gen = torch.Generator().manual_seed(200 + bs)
    rows, pool_len, width = 8, 96, 40
    table = token_table(gen, rows, pool_len)
    req_pool_indices = requests(gen, bs, rows)
    start, end = extends(gen, bs, pool_len, width)

    cpu_branch(monkeypatch, cache_locs, assign_extend_cache_locs_cpu=standin.assign_extend_cache_locs_cpu)
    ours = cache_locs.assign_extend_cache_locs_func(req_pool_indices, table, start, end, bs, width, "cpu")
    theirs = torch.full((bs * width,), -7, dtype=torch.int64)
    total = int((end - start).sum())
    theirs_copy = theirs.clone()
    on_triton(
        cache_locs.assign_extend_cache_locs[(bs,)],
        req_pool_indices,
        table,
        start,
        end,
        theirs,
        pool_len,
        next_power_of_2(bs),
    )
    assert not torch.equal(theirs, theirs_copy)
    # the wrapper hands back torch.empty: only the gathered prefix is defined
    assert torch.equal(ours[:total], theirs[:total])


@pytest.mark.parametrize("bs", BATCHES)
def test_fill_front_out_cache_loc(monkeypatch, bs) -> None:
    """``assign_extend_cache_locs_cpu`` as ``fill_front_out_cache_loc_func`` calls it (int32 lengths,
    an int32 table made of the verify windows)."""
    from sglang.kernels.ops.speculative import cache_locs

    gen = torch.Generator().manual_seed(300 + bs)
    width = 7
    out_cache_loc = torch.randperm(1000, generator=gen)[: bs * width]
    num_front = torch.randint(1, width + 1, (bs,), generator=gen, dtype=torch.int32)
    ours = torch.full((bs * width,), -3, dtype=torch.int64)
    theirs = ours.clone()

    cpu_branch(monkeypatch, cache_locs, assign_extend_cache_locs_cpu=standin.assign_extend_cache_locs_cpu)
    cache_locs.fill_front_out_cache_loc_func(num_front, out_cache_loc, ours)
    window = out_cache_loc.view(bs, -1)
    on_triton(
        cache_locs.assign_extend_cache_locs[(bs,)],
        torch.arange(bs),
        window,
        torch.zeros_like(num_front),
        num_front,
        theirs,
        width,
        next_power_of_2(bs),
    )
    assert int((theirs != -3).sum()) == int(num_front.sum())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("bs", "topk", "steps"), [(1, 1, 3), (3, 2, 4), (5, 3, 50)])
def test_assign_draft_cache_locs_contiguous(monkeypatch, bs, topk, steps) -> None:
    """``steps=50`` copies 150 slots a request: more than one 128-block of the Triton loop."""
    from sglang.kernels.ops.speculative import cache_locs

    gen = torch.Generator().manual_seed(400 + bs)
    rows, pool_len = 8, 256
    copy_len = topk * steps
    table = token_table(gen, rows, pool_len)
    req_pool_indices = requests(gen, bs, rows)
    seq_lens = torch.randint(0, pool_len - copy_len + 1, (bs,), generator=gen)
    ours = torch.full((bs * copy_len,), -5, dtype=torch.int64)
    theirs = ours.clone()

    cpu_branch(
        monkeypatch,
        cache_locs,
        assign_draft_cache_locs_contiguous_cpu=standin.assign_draft_cache_locs_contiguous_cpu,
    )
    cache_locs.assign_draft_cache_locs_contiguous_func(req_pool_indices, table, seq_lens, ours, topk, steps)
    on_triton(
        cache_locs.assign_draft_cache_locs_contiguous[(bs,)],
        req_pool_indices,
        table,
        seq_lens,
        theirs,
        pool_len,
        topk,
        steps,
        BS=bs,
    )
    assert bool((theirs != -5).all())
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------------
# KV-cache row moves


def kv_pool(gen: torch.Generator, layers: int, rows: int) -> list[torch.Tensor]:
    """K and V buffers of every layer as a KV pool holds them (rows of different byte widths)."""
    k = [torch.randn(rows, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(rows, 3, 5, generator=gen) for _ in range(layers)]  # 60-byte rows
    return [*k, *v]


@pytest.mark.parametrize("bs", BATCHES)
@pytest.mark.parametrize("stride_dtype", [torch.int64, torch.uint64])
def test_copy_all_layer_kv_cache(monkeypatch, bs, stride_dtype) -> None:
    """Overlapping moves included (a row that is both read and written); uint64 strides as the
    HiSparse pool passes them."""
    from sglang.kernels.ops.kvcache import cache_move

    gen = torch.Generator().manual_seed(500 + bs)
    rows, n = 40, 4 * bs
    picks = torch.randperm(rows, generator=gen)
    src, tgt = picks[:n].clone(), picks[n : 2 * n].clone()
    tgt[0] = src[-1]  # row src[-1] is read and overwritten: the move must read it first

    def pool(device: str):
        buffers = [b.to(device) for b in kv_pool(torch.Generator().manual_seed(600 + bs), 3, rows)]
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
        strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers], dtype=stride_dtype)
        return buffers, ptrs, strides

    (ours, ptrs, strides), (theirs, their_ptrs, their_strides) = pool("cpu"), pool(TRITON_DEVICE)
    original = [b.clone() for b in ours]
    upper = next_power_of_2(n)
    tile = 32
    config = {"bytes_per_tile": tile, "byte_tiles": -(-max(strides.tolist()) // tile), "num_warps": 1}

    cpu_branch(monkeypatch, cache_move, copy_all_layer_kv_cache_cpu=standin.copy_all_layer_kv_cache_cpu)
    cache_move.copy_all_layer_kv_cache_func(ptrs, strides, tgt, src, n, upper, config)
    grid = (their_ptrs.numel(), config["byte_tiles"])
    on_triton(
        cache_move.copy_all_layer_kv_cache_tiled[grid],
        their_ptrs,
        their_strides,
        tgt,
        src,
        n,
        upper,
        BYTES_PER_TILE=tile,
    )
    for mine, other, before in zip(ours, theirs, original, strict=True):
        other = other.cpu()
        assert torch.equal(other[tgt], before[src])
        assert torch.equal(mine.view(torch.uint8), other.view(torch.uint8))


# ---------------------------------------------------------------------------------------------------
# EAGLE draft trees


def draft_tree(bs: int, topk: int, steps: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    """A draft tree as SGLang builds it (its own draft-step functions, then ``organize_draft_results``):
    the tree inputs, every node's token (the bonus token at the root) and the sequence lengths."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    vocab = 50
    parent_list, top_scores_index, draft_tokens = organize_draft_results(
        *sglang_draft(bs, topk, steps, vocab=vocab, seed=seed), n
    )
    gen = torch.Generator().manual_seed(seed)
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    return {
        "parent_list": parent_list,
        "top_scores_index": top_scores_index,
        "candidates": torch.cat((bonus[:, None], draft_tokens), dim=1),
        "seq_lens": torch.randint(3, 20, (bs,), generator=gen),
    }


def tree_buffers(tree: dict[str, torch.Tensor], n: int, mode: int) -> dict[str, torch.Tensor]:
    """The output buffers ``eagle_utils.build_tree_kernel_efficient`` allocates (FULL_MASK and
    QLEN_ONLY start all True; the retrieval links start at -1)."""
    seq_lens = tree["seq_lens"]
    bs = seq_lens.numel()
    size = n * n * bs + (int(seq_lens.sum()) * n if mode == 0 else 0)
    links = torch.full((3, bs, n), -1, dtype=torch.long)
    return {
        "tree_mask": torch.full((size,), True, dtype=torch.bool),
        "positions": torch.full((bs * n,), -9, dtype=torch.long),
        "retrieve_index": links[0],
        "retrieve_next_token": links[1],
        "retrieve_next_sibling": links[2],
    }


def build_both(monkeypatch, tree, topk, steps, n, mode):
    from sglang.kernels.ops.speculative import spec_tree

    ours, theirs = tree_buffers(tree, n, mode), tree_buffers(tree, n, mode)
    inputs = (tree["parent_list"], tree["top_scores_index"], tree["seq_lens"])
    cpu_branch(monkeypatch, spec_tree, sgl_build_tree_kernel_efficient_cpu=standin.build_tree_kernel_efficient_cpu)
    spec_tree.build_tree_kernel_efficient_func(*inputs, *ours.values(), topk, steps, n, spec_tree.TreeMaskMode(mode))
    on_triton(
        spec_tree.sgl_build_tree_kernel_triton, *inputs, *theirs.values(), topk, steps, n, spec_tree.TreeMaskMode(mode)
    )
    return ours, theirs


@pytest.mark.parametrize("mode", [0, 1], ids=["full_mask", "qlen_only"])
@pytest.mark.parametrize(("bs", "topk", "steps", "n", "seed"), TREES, ids=TREE_IDS)
def test_build_tree_kernel_efficient(monkeypatch, bs, topk, steps, n, seed, mode) -> None:
    tree = draft_tree(bs, topk, steps, n, seed)
    ours, theirs = build_both(monkeypatch, tree, topk, steps, n, mode)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert bool((theirs["positions"] >= tree["seq_lens"].repeat_interleave(n)).all())
    if n > 2 and topk > 1 and steps > 1:  # a real tree: some node has a child and a sibling
        assert bool((theirs["retrieve_next_sibling"] != -1).any())
        assert int((theirs["positions"] - tree["seq_lens"].repeat_interleave(n)).max()) >= 2


def test_build_tree_bitpacking_is_refused() -> None:
    """QLEN_ONLY_BITPACKING: neither SGLang's Triton version nor the real CPU kernel builds it."""
    tree = draft_tree(1, 2, 2, 4, 0)
    buffers = tree_buffers(tree, 4, 1)
    with pytest.raises(NotImplementedError, match="BITPACKING"):
        standin.build_tree_kernel_efficient_cpu(
            tree["parent_list"], tree["top_scores_index"], tree["seq_lens"], *buffers.values(), 2, 2, 4, 2
        )


def verify_scenario(tree, links, seed: int) -> torch.Tensor:
    """Target tokens: at each node, a child's draft token (so drafts are accepted) or, now and then, a
    token no child has (so paths stop early)."""
    candidates = tree["candidates"]
    bs, n = candidates.shape
    rng = random.Random(seed)
    target = torch.randint(100, 200, (bs, n), generator=torch.Generator().manual_seed(seed))
    for b in range(bs):
        for node in range(n):
            children, child = [], int(links["retrieve_next_token"][b, node])
            while child != -1:
                children.append(child)
                child = int(links["retrieve_next_sibling"][b, child])
            if children and rng.random() < 0.8:
                target[b, node] = candidates[b, rng.choice(children)]
    return target


def verify_both(monkeypatch, tree, links, target, steps):
    from sglang.kernels.ops.speculative import spec_tree

    candidates = tree["candidates"]
    bs, n = candidates.shape

    def buffers():
        return (
            torch.full((bs * n,), -2, dtype=torch.int32),
            torch.full((bs, steps + 1), -1, dtype=torch.int32),
            torch.full((bs,), -4, dtype=torch.int32),
        )

    ours, theirs = buffers(), buffers()
    retrieve = (links["retrieve_index"], links["retrieve_next_token"], links["retrieve_next_sibling"])
    cpu_branch(monkeypatch, spec_tree, sgl_verify_tree_greedy_cpu=standin.verify_tree_greedy_cpu)
    spec_tree.verify_tree_greedy_func(*ours, candidates, *retrieve, target, topk=1)
    on_triton(spec_tree.verify_tree_greedy_triton, *theirs, candidates, *retrieve, target)
    return ours, theirs


@pytest.mark.parametrize(("bs", "topk", "steps", "n", "seed"), TREES, ids=TREE_IDS)
def test_verify_tree_greedy(monkeypatch, bs, topk, steps, n, seed) -> None:
    tree = draft_tree(bs, topk, steps, n, seed)
    _, links = build_both(monkeypatch, tree, topk, steps, n, 1)
    target = verify_scenario(tree, links, seed)
    ours, theirs = verify_both(monkeypatch, tree, links, target, steps)
    for name, mine, other in zip(("predicts", "accept_index", "accept_token_num"), ours, theirs, strict=True):
        assert torch.equal(mine, other), name
    assert int(theirs[2].sum()) > 0 or steps == 1 or n <= 2


@pytest.mark.parametrize(("bs", "topk", "steps", "n", "seed"), TREES, ids=TREE_IDS)
def test_fill_accept_out_cache_loc(monkeypatch, bs, topk, steps, n, seed) -> None:
    """From a real verify result: ``accept_index`` padded with -1, as ``move_accept_tokens`` passes it."""
    from sglang.kernels.ops.speculative import eagle

    tree = draft_tree(bs, topk, steps, n, seed)
    _, links = build_both(monkeypatch, tree, topk, steps, n, 1)
    _, (_, accept_index, _) = verify_both(monkeypatch, tree, links, verify_scenario(tree, links, seed), steps)
    size = bs * accept_index.shape[1]
    out_cache_loc = 1 + torch.randperm(1000, generator=torch.Generator().manual_seed(seed))[: bs * n]
    ours = torch.zeros(size, dtype=torch.int64)
    theirs = torch.zeros(size, dtype=torch.int64)

    cpu_branch(monkeypatch, eagle, fill_accept_out_cache_loc_cpu=standin.fill_accept_out_cache_loc_cpu)
    eagle.fill_accept_out_cache_loc_func(accept_index, out_cache_loc, ours, size)
    on_triton(eagle.fill_accept_out_cache_loc[(size,)], accept_index, out_cache_loc, theirs, next_power_of_2(size))
    assert int((theirs != 0).sum()) == int((accept_index != -1).sum())
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(("bs", "topk", "steps", "n", "seed"), TREES, ids=TREE_IDS)
def test_fill_bonus_tokens(monkeypatch, bs, topk, steps, n, seed) -> None:
    """From a real verify result: ``accept_tokens = predict[accept_index]``, ``accept_lens`` with the bonus."""
    from sglang.kernels.ops.speculative import eagle

    tree = draft_tree(bs, topk, steps, n, seed)
    _, links = build_both(monkeypatch, tree, topk, steps, n, 1)
    target = verify_scenario(tree, links, seed)
    _, (predict, accept_index, accepted) = verify_both(monkeypatch, tree, links, target, steps)
    accept_tokens = predict[accept_index]
    accept_lens = accepted + 1
    ours = torch.full((bs,), -1, dtype=torch.int32)
    theirs = ours.clone()

    cpu_branch(monkeypatch, eagle, fill_bonus_tokens_cpu=standin.fill_bonus_tokens_cpu)
    eagle.fill_bonus_tokens_func(accept_tokens, accept_lens, ours, accept_index.shape[1], bs)
    on_triton(eagle.fill_bonus_tokens[(bs,)], accept_tokens, accept_lens, theirs, accept_index.shape[1])
    assert bool((theirs >= 0).all())
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------------------------------------
# The package as SGLang sees it


def test_unavailable_op_raises_naming_it() -> None:
    """No op SGLang imports is left unimplemented; the helper that would stand for one raises."""
    stub = _ops.unavailable("some_op_cpu")
    with pytest.raises(NotImplementedError, match=r"sgl_kernel\.some_op_cpu"):
        stub(1, key=2)
    assert stub.__name__ == "some_op_cpu"
    ops = [name for name in standin.__all__ if name.endswith("_cpu")]
    assert len(ops) == 8
    assert [name for name in ops if getattr(standin, name).__code__ is stub.__code__] == []


def test_import_sgl_kernel_gets_the_standin() -> None:
    """With the stand-in first on ``PYTHONPATH`` (as ``cpu_server`` runs SGLang), ``import sgl_kernel``
    is the stand-in, names SGLang probes inside ``try/except ImportError`` are missing, and SGLang's
    CPU-engine modules bind the stand-in's ops."""
    code = """
import sgl_kernel
assert sgl_kernel.STANDIN is True
assert sgl_kernel.scalar_types.uint4b8.size_bits == 4, sgl_kernel.scalar_types.uint4b8
try:
    from sgl_kernel import rmsnorm
except ImportError:
    pass
else:
    raise AssertionError("rmsnorm imported")
try:
    import sgl_kernel.allreduce
except ImportError:
    pass
else:
    raise AssertionError("sgl_kernel.allreduce imported")
from sglang.kernels.ops.kvcache import cache_move
from sglang.kernels.ops.speculative import cache_locs, eagle, spec_tree
assert spec_tree._is_cpu
assert spec_tree.sgl_build_tree_kernel_efficient_cpu is sgl_kernel.build_tree_kernel_efficient_cpu
assert spec_tree.sgl_verify_tree_greedy_cpu is sgl_kernel.verify_tree_greedy_cpu
assert cache_move.copy_all_layer_kv_cache_cpu is sgl_kernel.copy_all_layer_kv_cache_cpu
assert cache_locs.assign_extend_cache_locs_cpu is sgl_kernel.assign_extend_cache_locs_cpu
assert eagle.fill_bonus_tokens_cpu is sgl_kernel.fill_bonus_tokens_cpu
print("OK", sgl_kernel.__file__)
"""
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        env=cpu_server_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("OK ")
    assert "standin" in result.stdout
