"""Helpers shared by the GPU benchmarks (``scripts/bench_selection.py``, ``scripts/bench_moe_layer.py``):
CUDA-graph timing, device syncs, the git SHA and CSV output."""

from __future__ import annotations

import csv
import os
import statistics
import time
from pathlib import Path

import torch

from ..provenance import package_commit


def time_graph(fn, calls: int, replays: int) -> float:
    """Median microseconds per call of ``fn(i)`` captured ``calls`` times in one CUDA graph.

    ``fn(i)`` is warmed up (Triton compiles here) on a side stream, captured for ``i = 0..calls-1``,
    replayed once, then timed over ``replays`` replays with CUDA events; the figure is the median replay
    time divided by ``calls``.  Off CUDA (``--smoke``) it times plain calls with a wall clock: a check
    that the script runs, not a measurement.
    """
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - start) * 1e6 / calls
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return statistics.median(samples)


def count_launches(fn) -> int | None:
    """Kernels (and device memsets) one eager call ``fn(0)`` puts on the GPU, as its CUDA graph holds
    them: counted by the profiler after a warm-up call.  None off CUDA (a ``--smoke`` run)."""
    if not torch.cuda.is_available():
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(0)
        torch.cuda.synchronize()
    return sum(1 for evt in prof.events() if evt.device_type == DeviceType.CUDA and "Memcpy" not in evt.name)


def cpu_smoke_problem() -> str | None:
    """Why a ``--smoke`` run cannot start on this CPU (None: it can; torch then uses one thread)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "--smoke without a GPU needs TRITON_INTERPRET=1 in the environment"
    torch.set_num_threads(1)
    return None


def sync() -> None:
    """Wait for the GPU, if there is one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def git_sha() -> str:
    """This package's commit (see :func:`xshare_sglang.provenance.package_commit`), or ``"unknown"``."""
    return package_commit() or "unknown"


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows (dicts with the same keys, in order) as a CSV file with a header line."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
