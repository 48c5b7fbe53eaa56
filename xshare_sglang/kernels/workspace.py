"""Scratch memory of the fused selection kernels, one per (device, E, stream).

The tickets, accumulators and marks are 0 between calls: the last program of each kernel clears what
its kernel accumulated (docs/kernels.md, "Workspace"), so a call launches no reset.  Only the coverage
ranking's pair sums are zeroed before the call that uses them (:attr:`CallPlan.zero_pairs`, or the
plan's ``fill_kernel``).
"""

from __future__ import annotations

import torch

from ..devices import canonical_device, stream_key
from .plan import BLOCK_BINS, MAX_COVERAGE_TOKENS


class SelectionWorkspace:
    """Scratch memory of the fused kernels for one device and expert count.

    Allocate it before CUDA-graph capture and pass it to every call.  One workspace may serve every
    layer of one stream (calls issued on one stream run one after the other), never two streams at
    once: :func:`default_workspace` keeps one per stream.  About ``E * 8.5 KiB``, most of it the
    coverage ranking's row scores and row lists.

    Parameters
    ----------
    num_experts : int
    device : torch.device or str
        ``"cuda"``, ``"cuda:0"`` and ``torch.device("cuda")`` are one device (see
        :func:`xshare_sglang.devices.canonical_device`).
    """

    def __init__(self, num_experts: int, device: torch.device | str) -> None:
        self.num_experts = num_experts
        self.device = canonical_device(device)
        kw = dict(device=self.device)
        # placeholders for optional pointer arguments (vote weights, bias, metrics, ranks, outputs of
        # a keep-mask-only call): passed where a constexpr flag says the kernel never touches them
        self.prim = torch.zeros(num_experts, dtype=torch.int64, **kw)
        self.flag = torch.zeros(num_experts, dtype=torch.int8, **kw)
        self.mass = torch.zeros(num_experts, dtype=torch.int64, **kw)
        self.lynx_digits = torch.zeros(num_experts, BLOCK_BINS, dtype=torch.int64, **kw)
        self.lynx_rank = torch.zeros(num_experts, dtype=torch.int32, **kw)
        # Everything a multi-program call accumulates with atomics, in one buffer that is 0 between
        # calls (the last program of each kernel clears its share; reset() zeroes it all): the three
        # tickets (selection, routing, LYNX picks; one word of padding), a placeholder of E words, the
        # LYNX picks, the warm-up and per-request marks, LYNX bin counts, the int64 aggregate scores,
        # the coverage ranking's column sums and the routing kernel's per-expert visits and marks
        # (8-byte aligned: the offsets 4 + 20 E, 4 + 22 E and 4 + 24 E words are even), and the lengths
        # of the coverage ranking's row lists.
        # After them, 8-byte aligned, the coverage ranking's [E, E] int64 pair sums, zeroed before
        # each call that uses them.
        n = num_experts
        words = 4 + 27 * n
        self.zeroed = torch.zeros(words + words % 2 + 2 * n * n, dtype=torch.int32, **kw)
        self.counters = self.zeroed[:words]
        self.tickets = self.counters[:3]
        self.placeholder_i32 = self.counters[4 : 4 + n]  # an int32 [E] placeholder, never written
        self.picked = self.counters[4 + n : 4 + 2 * n]
        self.warm_marks = self.counters[4 + 2 * n : 4 + 3 * n]
        self.base_marks = self.counters[4 + 3 * n : 4 + 4 * n]
        self.lynx_counts = self.counters[4 + 4 * n : 4 + 20 * n].view(n, BLOCK_BINS)
        self.aggregate = self.counters[4 + 20 * n : 4 + 22 * n].view(torch.int64)
        self.cover_aggregate = self.counters[4 + 22 * n : 4 + 24 * n].view(torch.int64)
        self.visits = self.counters[4 + 24 * n : 4 + 26 * n].view(torch.int64)
        self.cover_counts = self.counters[4 + 26 * n :]
        self.cover_pairs = self.zeroed[words + words % 2 :].view(torch.int64).view(n, n)
        # ranking=coverage: every row's scores, and for each expert the rows that score it
        self.row_scores = torch.zeros(MAX_COVERAGE_TOKENS, num_experts, dtype=torch.int32, **kw)
        self.cover_rows = torch.zeros(num_experts, MAX_COVERAGE_TOKENS, dtype=torch.int32, **kw)

    def reset(self) -> None:
        """Zero the tickets, accumulators and marks (queued on the current stream).

        Every call that completes leaves them at 0 (the last program of each kernel clears what its
        kernel accumulated), so calls never need this; ``prune_route`` calls it when a call fails
        after queueing part of its kernels.  Call it yourself after anything else wrote into the
        workspace (the one rule: a workspace serves one stream).
        """
        self.counters.zero_()


_workspaces: dict[tuple[torch.device, int, int], SelectionWorkspace] = {}


def workspace_key(num_experts: int, device: torch.device | str) -> tuple[torch.device, int, int]:
    """(device, E, current stream): calls with one key may share a workspace."""
    device = canonical_device(device)
    return device, num_experts, stream_key(device)


def default_workspace(num_experts: int, device: torch.device | str) -> SelectionWorkspace:
    """A workspace shared by calls that pass none: one per (device, E, stream), created on first use
    and never freed, so a CUDA graph captured with it stays valid."""
    key = workspace_key(num_experts, device)
    if key not in _workspaces:
        _workspaces[key] = SelectionWorkspace(num_experts, key[0])
    return _workspaces[key]
