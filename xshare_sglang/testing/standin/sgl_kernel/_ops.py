"""Torch implementations of the ``sgl_kernel`` CPU ops the stand-in provides, and the error of the rest."""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch


def _load_shared() -> ModuleType:
    """``xshare_sglang/testing/sgl_kernel_standin.py`` (what both stand-ins share), loaded by its path from
    the folder above this stand-in's: the stand-in runs where ``xshare_sglang`` need not be importable."""
    path = Path(__file__).resolve().parents[2] / "sgl_kernel_standin.py"
    spec = importlib.util.spec_from_file_location("xshare_sgl_kernel_standin", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shared = _load_shared()


def unavailable(name: str) -> Callable[..., None]:
    """An op that SGLang imports but the stand-in does not implement: calling it raises."""
    return shared.unavailable(
        name,
        f"sgl_kernel.{name} is not available on CPU: xshare_sglang.testing's sgl_kernel stand-in "
        "does not implement it (the feature that calls it cannot run in a CPU test server)",
        __name__,
    )


def _request_slices(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    pool_len: int,
) -> list[tuple[int, int, int, int]]:
    """``(row, start, end, packed offset)`` of each request: its slice ``[start, end)`` of its
    ``req_to_token`` row, and where that slice sits when the slices are packed request after request.

    Raises
    ------
    ValueError
        When ``pool_len`` is not the table's row length, the offsets do not match the requests, or a
        slice is not inside a row.
    """
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len={pool_len} but req_to_token is {tuple(req_to_token.shape)}")
    rows = req_pool_indices.reshape(-1).tolist()
    starts, ends = start_offset.reshape(-1).tolist(), end_offset.reshape(-1).tolist()
    if not len(rows) == len(starts) == len(ends):
        raise ValueError(f"{len(rows)} requests but {len(starts)} start and {len(ends)} end offsets")
    out, packed = [], 0
    for b, (row, start, end) in enumerate(zip(rows, starts, ends, strict=True)):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"request {b}: slice [{start}, {end}) is not inside a row of {pool_len}")
        out.append((row, start, end, packed))
        packed += end - start
    return out


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write newly allocated KV-cache slots into each request's row of the request-to-token table.

    Parameters
    ----------
    req_pool_indices : Tensor [B], integer
        Row of ``req_to_token`` owned by each request.
    req_to_token : Tensor [R, pool_len], integer
        Modified in place: ``req_to_token[req_pool_indices[b], start_offset[b]:end_offset[b]]``
        receives request b's slice of ``out_cache_loc``.
    start_offset, end_offset : Tensor [B], integer
        Positions of the new tokens of each request.
    out_cache_loc : Tensor [sum(end - start)], integer
        The new slots, request after request.
    pool_len : int
        Row length of ``req_to_token`` (checked against the table).
    """
    flat = out_cache_loc.reshape(-1)
    for row, start, end, packed in _request_slices(req_pool_indices, req_to_token, start_offset, end_offset, pool_len):
        req_to_token[row, start:end] = flat[packed : packed + end - start].to(req_to_token.dtype)


def _byte_rows(address: int, rows: int, row_bytes: int) -> torch.Tensor:
    """A writable ``uint8`` tensor ``[rows, row_bytes]`` over the host memory at ``address`` (no copy)."""
    raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
    return torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy KV-cache rows ``src_loc -> tgt_loc`` in every buffer of the pool (every layer's K and V).

    Each buffer is addressed as raw bytes: row ``r`` of buffer ``i`` is the ``strides[i]`` bytes at
    ``data_ptrs[i] + r * strides[i]``.  All source rows of a buffer are read before any target row is
    written, so overlapping ``src_loc`` / ``tgt_loc`` behave as in SGLang's Triton kernel
    ``copy_all_layer_kv_cache_tiled`` (which loads a whole chunk of rows, then stores it).

    Parameters
    ----------
    data_ptrs : Tensor [L], uint64 or int64, on the CPU
        Host address of each buffer's first row.  Every buffer must hold at least
        ``max(src_loc.max(), tgt_loc.max()) + 1`` rows; this cannot be checked from a raw address.
    strides : Tensor [L], integer
        Row stride of each buffer in bytes (the number of bytes copied per row).
    tgt_loc, src_loc : Tensor [N], integer
        Row ``src_loc[j]`` is copied to row ``tgt_loc[j]`` in every buffer.
    """
    if data_ptrs.device.type != "cpu":
        raise ValueError(f"data_ptrs must hold host addresses in a CPU tensor, got one on {data_ptrs.device}")
    if data_ptrs.dim() != 1 or strides.shape != data_ptrs.shape:
        raise ValueError(f"data_ptrs {tuple(data_ptrs.shape)} and strides {tuple(strides.shape)} must be equal 1-D")
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"tgt_loc has {tgt_loc.numel()} locations but src_loc has {src_loc.numel()}")
    if src_loc.numel() == 0 or data_ptrs.numel() == 0:
        return
    src = src_loc.reshape(-1).to(device="cpu", dtype=torch.int64)
    tgt = tgt_loc.reshape(-1).to(device="cpu", dtype=torch.int64)
    if int(src.min()) < 0 or int(tgt.min()) < 0:
        raise ValueError("copy_all_layer_kv_cache_cpu: negative KV-cache location")
    rows = max(int(src.max()), int(tgt.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        if address <= 0 or row_bytes <= 0:
            raise ValueError(f"copy_all_layer_kv_cache_cpu: bad buffer (address {address}, row stride {row_bytes})")
        buffer = _byte_rows(int(address), rows, int(row_bytes))
        buffer[tgt] = buffer[src]  # the gather makes a copy first: all reads happen before any write


def _check_tree_tables(bs: int, draft_tokens: int, index, next_token, next_sibling) -> None:
    """The three ``retrive_*`` tables of a draft tree must each be [batch, draft tokens]."""
    for name, tensor in (
        ("retrive_index", index),
        ("retrive_next_token", next_token),
        ("retrive_next_sibling", next_sibling),
    ):
        if tensor.shape != (bs, draft_tokens):
            raise ValueError(f"{name} {tuple(tensor.shape)} is not [batch={bs}, draft tokens={draft_tokens}]")


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build an EAGLE draft tree: its attention mask, positions and retrieval links (in place).

    Same results as SGLang's ``sgl_build_tree_kernel_efficient_triton``.  Node 0 of each request's tree
    is the verified token; node ``i > 0`` is draft candidate ``selected_index[b, i - 1]``, whose parent is
    the root when ``selected_index[b, i - 1] // topk == 0``, else the node whose candidate equals
    ``parent_list[b, selected_index[b, i - 1] // topk]``.

    Parameters
    ----------
    parent_list : Tensor [B, topk * (depth - 1) + 1] (``[B, 0]`` when depth == 1), int64
        Candidate index of the parent of each expanded draft branch.
    selected_index : Tensor [B, draft_token_num - 1], int64
        The candidates kept in the tree, sorted.
    verified_seq_len : Tensor [B], integer
        Sequence length of each request before the draft tokens.
    tree_mask : Tensor, bool or uint8, modified in place
        ``tree_mask_mode == 0`` (FULL_MASK): ``[sum(seq_len) * n + B * n * n]`` flat, request b's block
        of ``n`` rows of ``seq_len[b] + n`` columns after the blocks of earlier requests; only the
        ``n`` tree columns of each row are written (the prefix columns are left as they are).
        ``tree_mask_mode == 1`` (QLEN_ONLY): ``[B * n * n]`` flat, one ``n x n`` block per request.
        Row ``i`` gets True at node 0, at node ``i`` and at each of its ancestors (at most ``depth``
        of them), False elsewhere.  ``n`` is ``draft_token_num``.
    positions : Tensor [B * n], integer, modified in place
        ``seq_len[b]`` plus the depth of each node.
    retrive_index : Tensor [B, n], integer, modified in place
        ``b * n + i``.
    retrive_next_token, retrive_next_sibling : Tensor [B, n], integer, modified in place
        Must come filled with -1: first child of each node, and next sibling of each node.
    topk, depth, draft_token_num : int
        Draft branching factor, draft steps, and tree size ``n``.
    tree_mask_mode : int
        0 (FULL_MASK) or 1 (QLEN_ONLY).  2 (QLEN_ONLY_BITPACKING) raises ``NotImplementedError``, as
        in SGLang's Triton version and the real CPU kernel.
    """
    mode = int(tree_mask_mode)
    if mode == 2:
        raise NotImplementedError("build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING (mode 2) is not supported")
    if mode not in (0, 1):
        raise ValueError(f"build_tree_kernel_efficient_cpu: unknown tree_mask_mode {tree_mask_mode}")
    n = int(draft_token_num)
    if topk <= 0 or depth <= 0 or n <= 0:
        raise ValueError(f"topk={topk}, depth={depth} and draft_token_num={n} must be positive")
    bs = verified_seq_len.numel()
    if selected_index.shape != (bs, n - 1):
        raise ValueError(f"selected_index {tuple(selected_index.shape)} is not [batch={bs}, draft_token_num-1={n - 1}]")
    _check_tree_tables(bs, n, retrive_index, retrive_next_token, retrive_next_sibling)
    if positions.numel() != bs * n:
        raise ValueError(f"positions has {positions.numel()} entries, not batch * draft_token_num = {bs * n}")
    if parent_list.dim() != 2 or parent_list.shape[0] != bs:
        raise ValueError(f"parent_list {tuple(parent_list.shape)} is not [batch={bs}, parents]")
    seq_lens = verified_seq_len.reshape(-1).tolist()
    need = n * n * bs + (n * sum(seq_lens) if mode == 0 else 0)
    if tree_mask.numel() < need:
        raise ValueError(f"tree_mask has {tree_mask.numel()} entries, mode {mode} needs {need}")

    selected = selected_index.tolist()
    parents = parent_list.tolist()
    next_token = retrive_next_token.tolist()
    next_sibling = retrive_next_sibling.tolist()
    flat_mask = tree_mask.view(-1)
    flat_positions = positions.view(-1)

    def node_of(b: int, candidate: int) -> int | None:
        """Slot in ``selected[b]`` holding ``candidate`` (first match), or None."""
        row = selected[b]
        for slot in range(n - 1):
            if row[slot] == candidate:
                return slot
        return None

    def parent_slot(b: int, slot: int) -> int | None:
        """Slot of the parent of the node at ``slot`` (node ``slot + 1``); None when it is the root."""
        owner = selected[b][slot] // topk
        if owner == 0:
            return None
        return node_of(b, parents[b][owner])

    prefix = 0
    for b in range(bs):
        seq_len = seq_lens[b]
        # retrieval links: children are pushed in decreasing node order, so each list ends up increasing
        for i in range(n - 1, 0, -1):
            owner = selected[b][i - 1] // topk
            if owner == 0:
                parent_position = 0
            else:
                slot = node_of(b, parents[b][owner])
                if slot is None:
                    continue
                parent_position = slot + 1
            previous = next_token[b][parent_position]
            next_token[b][parent_position] = i
            if previous != -1:
                next_sibling[b][i] = previous
        retrive_index[b] = torch.arange(b * n, (b + 1) * n, dtype=retrive_index.dtype)

        # mask rows and positions
        block = prefix * n + b * n * n if mode == 0 else b * n * n
        row_len = seq_len + n if mode == 0 else n
        offset = seq_len if mode == 0 else 0
        rows = torch.zeros(n, n, dtype=torch.bool)
        rows[:, 0] = True
        node_positions = [seq_len] * n
        for x in range(1, n):
            slot, steps = x - 1, 0
            for _ in range(depth):
                steps += 1
                rows[x, slot + 1] = True
                up = parent_slot(b, slot)
                if up is None:
                    break
                slot = up
            node_positions[x] = seq_len + steps
        for x in range(n):
            start = block + row_len * x + offset
            flat_mask[start : start + n] = rows[x]
        flat_positions[b * n : (b + 1) * n] = torch.tensor(node_positions, dtype=positions.dtype)
        prefix += seq_len

    retrive_next_token.copy_(torch.tensor(next_token, dtype=retrive_next_token.dtype).view(bs, n))
    retrive_next_sibling.copy_(torch.tensor(next_sibling, dtype=retrive_next_sibling.dtype).view(bs, n))


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy verification of EAGLE draft trees against the target model's argmax tokens (in place).

    Same results as SGLang's ``verify_tree_greedy_kernel_triton``.  From the root, each step walks the
    children of the last accepted node (``retrive_next_token`` then ``retrive_next_sibling``) and
    accepts the first child whose draft token equals the target's prediction at the last accepted
    node; the walk ends at the first step where no child matches, or after ``S - 1`` accepted drafts.

    Parameters
    ----------
    predicts : Tensor [B * D], int32, modified in place
        At each accepted node (flat index ``retrive_index`` value), the target's token there.  Other
        entries are left as they are.
    accept_index : Tensor [B, S], int32, modified in place
        ``accept_index[b, 0]`` = the root's flat index, then the accepted nodes' flat indices; the
        entries after the last accepted node are left as they are (SGLang fills them with -1).
    accept_token_num : Tensor [B], int32, modified in place
        Number of accepted draft tokens (the bonus token not counted).
    candidates : Tensor [B, D], int64
        Draft token of each tree node (node 0: the verified token).
    retrive_index, retrive_next_token, retrive_next_sibling : Tensor [B, D], int64
        As ``build_tree_kernel_efficient_cpu`` leaves them.
    target_predict : Tensor [B, D], int64
        Target model's greedy token at each node.
    """
    if candidates.dim() != 2:
        raise ValueError(f"candidates {tuple(candidates.shape)} is not [batch, draft_tokens]")
    bs, draft_tokens = candidates.shape
    _check_tree_tables(bs, draft_tokens, retrive_index, retrive_next_token, retrive_next_sibling)
    if target_predict.numel() != bs * draft_tokens:
        raise ValueError(f"target_predict has {target_predict.numel()} entries, not {bs * draft_tokens}")
    if accept_index.dim() != 2 or accept_index.shape[0] != bs or accept_index.shape[1] < 1:
        raise ValueError(f"accept_index {tuple(accept_index.shape)} is not [batch={bs}, spec_tokens >= 1]")
    if accept_token_num.numel() != bs:
        raise ValueError(f"accept_token_num has {accept_token_num.numel()} entries, not batch = {bs}")
    if predicts.numel() < bs * draft_tokens:
        raise ValueError(f"predicts has {predicts.numel()} entries, fewer than {bs * draft_tokens}")
    spec_tokens = accept_index.shape[1]

    index = retrive_index.tolist()
    next_token = retrive_next_token.tolist()
    next_sibling = retrive_next_sibling.tolist()
    tokens = candidates.tolist()
    targets = target_predict.reshape(-1).tolist()
    predicted: dict[int, int] = {}
    accepted_rows: list[list[int]] = []
    counts: list[int] = []
    for b in range(bs):
        last = index[b][0]
        accepted = [last]
        cur = 0
        for _ in range(1, spec_tokens):
            cur = next_token[b][cur]
            target = targets[last]
            matched = False
            for _ in range(draft_tokens):  # bounded sibling walk, as in the Triton kernel
                if cur == -1:
                    break
                if tokens[b][cur] == target:
                    predicted[last] = target
                    last = index[b][cur]
                    accepted.append(last)
                    matched = True
                    break
                cur = next_sibling[b][cur]
            if not matched:
                break
        predicted[last] = targets[last]
        accepted_rows.append(accepted)
        counts.append(len(accepted) - 1)

    if predicted:
        where = torch.tensor(list(predicted), dtype=torch.int64)
        predicts.view(-1)[where] = torch.tensor(list(predicted.values()), dtype=predicts.dtype)
    for b, accepted in enumerate(accepted_rows):
        accept_index[b, : len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
    accept_token_num.view(-1).copy_(torch.tensor(counts, dtype=accept_token_num.dtype))


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Gather each request's draft KV-cache slots from the request-to-token table.

    Same results as SGLang's Triton ``assign_draft_cache_locs_contiguous`` without positions:
    ``out_cache_loc[b * C : (b + 1) * C] = req_to_token[req_pool_indices[b], seq_lens[b] : seq_lens[b] + C]``
    with ``C = topk * num_steps``.

    Parameters
    ----------
    req_pool_indices : Tensor [B], integer
        Row of ``req_to_token`` owned by each request.
    req_to_token : Tensor [R, pool_len], integer
        The request-to-token table (read only).
    seq_lens : Tensor [B], integer
        First draft position of each request.
    out_cache_loc : Tensor [>= B * C], integer, modified in place
        Receives the slots, request after request.
    pool_len : int
        Row length of ``req_to_token`` (checked against the table).
    topk, num_steps : int
        The ``C = topk * num_steps`` slots copied per request.
    """
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len={pool_len} but req_to_token is {tuple(req_to_token.shape)}")
    bs = req_pool_indices.numel()
    copy_len = int(topk) * int(num_steps)
    if seq_lens.numel() != bs:
        raise ValueError(f"seq_lens has {seq_lens.numel()} entries but req_pool_indices {bs}")
    if out_cache_loc.numel() < bs * copy_len:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} entries, fewer than {bs * copy_len}")
    flat_out = out_cache_loc.view(-1)
    for b, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)):
        if start < 0 or start + copy_len > pool_len:
            raise ValueError(f"request {b}: slots [{start}, {start + copy_len}) fall outside a row of {pool_len}")
        flat_out[b * copy_len : (b + 1) * copy_len] = req_to_token[row, start : start + copy_len]


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Gather each request's KV-cache slots ``[start_offset, end_offset)`` from the request-to-token table.

    Same results as SGLang's Triton ``assign_extend_cache_locs``: the slices are packed request after
    request into ``out_cache_loc``; entries after the last one are left as they are.

    Parameters
    ----------
    req_pool_indices : Tensor [B], integer
        Row of ``req_to_token`` owned by each request.
    req_to_token : Tensor [R, pool_len], integer
        The request-to-token table (read only).
    start_offset, end_offset : Tensor [B], integer
        Slice of each request's row to gather.
    out_cache_loc : Tensor [>= sum(end - start)], integer, modified in place
        Receives the slots.
    pool_len : int
        Row length of ``req_to_token`` (checked against the table).
    """
    slices = _request_slices(req_pool_indices, req_to_token, start_offset, end_offset, pool_len)
    total = slices[-1][3] + slices[-1][2] - slices[-1][1] if slices else 0
    if out_cache_loc.numel() < total:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} entries, fewer than the {total} gathered")
    flat_out = out_cache_loc.view(-1)
    for row, start, end, packed in slices:
        flat_out[packed : packed + end - start] = req_to_token[row, start:end]


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
) -> None:
    """Pack the KV-cache slots of the accepted tree nodes, skipping the -1 padding of ``accept_index``.

    Same results as SGLang's Triton ``fill_accept_out_cache_loc``:
    ``accept_out_cache_loc[k] = out_cache_loc[a_k]`` for the k-th entry ``a_k != -1`` of the flattened
    ``accept_index``; later entries are left as they are.

    Parameters
    ----------
    accept_index : Tensor [B, S] (or flat), integer
        Accepted nodes' indices into ``out_cache_loc``, -1 after each request's accepted ones.
    out_cache_loc : Tensor [B * D], integer
        KV-cache slot of every verified tree node.
    accept_out_cache_loc : Tensor [>= number of accepted nodes], integer, modified in place
        Receives the slots.
    """
    flat = accept_index.reshape(-1).to(torch.int64)
    kept = flat != -1
    dst = torch.cumsum(kept, 0) - kept.to(torch.int64)  # entries != -1 before each one
    valid = flat > -1
    src = flat[valid]
    if src.numel() == 0:
        return
    if int(src.max()) >= out_cache_loc.numel():
        raise ValueError(f"accept_index {int(src.max())} is past out_cache_loc ({out_cache_loc.numel()} entries)")
    if int(dst[valid].max()) >= accept_out_cache_loc.numel():
        raise ValueError(f"accept_out_cache_loc has {accept_out_cache_loc.numel()} entries, too few")
    accept_out_cache_loc.view(-1)[dst[valid]] = out_cache_loc.reshape(-1)[src].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """Each request's bonus token: the last of its accepted tokens.

    Same results as SGLang's Triton ``fill_bonus_tokens``:
    ``bonus_tokens[b] = accept_tokens.flatten()[accept_stride * b + accept_lens[b] - 1]``.

    Parameters
    ----------
    accept_tokens : Tensor [B, accept_stride] (or flat), integer
        Accepted tokens of each request (``predict[accept_index]``).
    accept_lens : Tensor [B], integer
        Accepted tokens per request, the bonus token included.
    bonus_tokens : Tensor [B], integer, modified in place
        Receives the bonus tokens.
    accept_stride : int
        Per-request width of ``accept_tokens`` (``accept_index.shape[1]``).
    """
    bs = accept_lens.numel()
    if bonus_tokens.numel() != bs:
        raise ValueError(f"bonus_tokens has {bonus_tokens.numel()} entries but accept_lens {bs}")
    flat = accept_tokens.reshape(-1)
    where = accept_stride * torch.arange(bs, dtype=torch.int64) + accept_lens.reshape(-1).to(torch.int64) - 1
    if bs and (int(where.min()) < 0 or int(where.max()) >= flat.numel()):
        raise ValueError(f"accept_lens point outside accept_tokens ({flat.numel()} entries, stride {accept_stride})")
    bonus_tokens.view(-1).copy_(flat[where].to(bonus_tokens.dtype))
