"""Recording router logits from a running server as ``xshare-trace`` files (``--moe-pruner-trace-dir``).

Which forwards: eager decode and speculative-verify forwards of the target model, one eligible
forward in ``trace_every``; a forward replayed from a CUDA graph runs no Python and is not seen (record
decode with ``--disable-cuda-graph``).  What: every MoE layer's router logits as SGLang computed them,
before any pruning, in their own dtype (float16 when wider than 32 bits), the keep mask the pruner
applied to that layer call (absent when the call was not pruned), and the request of each row
(SGLang's request-pool slot: unique among the requests of one batch, reused by later requests).

Never blocking the forward: the layer hook only queues a device-to-host copy into pinned memory and
keeps a reference; when the forward ends, its copies and a CUDA event go into a bounded queue (a full
queue drops the sample and counts it).  A writer thread waits for the event, builds the trace and
writes one file (``trace-r{rank}-{pid}-{index:05d}.pt``) per ``FORWARDS_PER_FILE`` recorded forwards, or
what it holds once no forward came for ``IDLE_FLUSH_S`` seconds (a quiet server's trace reaches the disk
without waiting for more traffic), each written to a temporary name and renamed.  Recording stops for
good once the files reach ``trace_max_mb``.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..replay.trace import LayerCall, Trace, TraceMeta

logger = logging.getLogger(__name__)

RECORDED_PHASES = ("decode", "verify")
FORWARDS_PER_FILE = 64
QUEUE_FORWARDS = 64
IDLE_FLUSH_S = 2.0


@dataclass
class _Forward:
    step: int
    phase: str
    request_ids: torch.Tensor
    layers: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    keeps: dict[int, torch.Tensor] = field(default_factory=dict)
    on_cuda: bool = False
    event: object = None


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Queue a copy to host memory without waiting for it (pinned memory when on CUDA)."""
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor.detach(), non_blocking=True)
    return host


class TraceRecorder:
    """Samples forwards, copies router logits to the host, and writes trace files in a thread.

    Parameters
    ----------
    directory : str or Path
    meta : TraceMeta
        The model's routing (``num_layers`` counts the pruner's MoE layers, in its row order).
    every : int
        Record one eligible forward in ``every``.
    max_bytes : int
        Stop once the written files total this many bytes.
    rank : int
        Tensor-parallel rank, part of the file names.
    """

    def __init__(self, directory, meta: TraceMeta, *, every: int, max_bytes: int, rank: int = 0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.meta = meta
        self.every = every
        self.max_bytes = max_bytes
        self.prefix = f"trace-r{rank}-{os.getpid()}"
        self.eligible = 0
        self.recorded = 0
        self.dropped = 0
        self.bytes_written = 0
        self.files: list[Path] = []
        self.stopped = False
        self.current: _Forward | None = None
        self._pending: list[_Forward] = []
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_FORWARDS)
        self._write_lock = threading.Lock()  # the writer's idle flush and flush() may meet
        self._thread = threading.Thread(target=self._write_loop, name="xshare-trace-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ forward thread
    def start_forward(self, phase: str | None, request_ids: torch.Tensor | None, tokens_per_request: int) -> None:
        """Decide whether the forward about to run is recorded."""
        self.current = None
        if self.stopped or phase not in RECORDED_PHASES or request_ids is None:
            return
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        self.eligible += 1
        if (self.eligible - 1) % self.every:
            return
        rows = request_ids.repeat_interleave(tokens_per_request) if tokens_per_request > 1 else request_ids
        self.current = _Forward(step=self.eligible - 1, phase=phase, request_ids=_to_host(rows.long()))

    def record(self, row: int, router_logits: torch.Tensor) -> None:
        """Queue the copy of one layer's router logits [T, E] of the forward being recorded."""
        if self.current is not None:
            self.current.on_cuda |= router_logits.is_cuda
            logits = router_logits if router_logits.element_size() <= 4 else router_logits.to(torch.float16)
            self.current.layers.append((row, _to_host(logits)))

    def record_keep(self, row: int, keep: torch.Tensor) -> None:
        """Queue the copy of the keep mask [E] applied to a layer call of the forward being recorded."""
        if self.current is not None:
            self.current.keeps[row] = _to_host(keep)

    def finish_forward(self) -> None:
        """Hand the recorded forward to the writer; drop it when the writer is behind."""
        forward, self.current = self.current, None
        if forward is None or not forward.layers:
            return
        if forward.on_cuda:
            forward.event = torch.cuda.Event()
            forward.event.record()
        try:
            self._queue.put_nowait(forward)
        except queue.Full:
            self.dropped += 1

    # ------------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        while True:
            try:
                forward = self._queue.get(timeout=IDLE_FLUSH_S)
            except queue.Empty:
                if self._pending:
                    self._write_guarded()
                continue
            try:
                if forward is None:
                    self._flush()
                    return
                if forward.event is not None:
                    forward.event.synchronize()
                self._pending.append(forward)
                self.recorded += 1
                if len(self._pending) >= FORWARDS_PER_FILE:
                    self._flush()
            except Exception as exc:  # the server goes on; recording stops
                self.stopped = True
                logger.error("moe-pruner: trace recording stopped: %s: %s", type(exc).__name__, exc)
            finally:
                self._queue.task_done()

    def _write_guarded(self) -> None:
        try:
            self._flush()
        except Exception as exc:  # the server goes on; recording stops
            self.stopped = True
            logger.error("moe-pruner: trace recording stopped: %s: %s", type(exc).__name__, exc)

    def _flush(self) -> None:
        with self._write_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        pending, self._pending = self._pending, []
        if not pending or self.bytes_written >= self.max_bytes:
            return
        complete = [f for f in pending if all(len(logits) == len(f.request_ids) for _, logits in f.layers)]
        self.dropped += len(pending) - len(complete)  # rows that are not one per request token (DP padding)
        calls = [
            LayerCall(f.step, row, f.phase, f.request_ids, logits=logits, keep=f.keeps.get(row))
            for f in complete
            for row, logits in f.layers
        ]
        if not calls:
            return
        path = self.directory / f"{self.prefix}-{len(self.files):05d}.pt"
        temporary = path.with_suffix(".tmp")
        Trace(self.meta, calls, name=path.stem).save(temporary)
        temporary.rename(path)
        self.files.append(path)
        self.bytes_written += path.stat().st_size
        if self.bytes_written >= self.max_bytes:
            self.stopped = True
            logger.warning(
                "moe-pruner: trace recording stopped at the size limit: %d files, %.1f MiB in %s",
                len(self.files),
                self.bytes_written / 2**20,
                self.directory,
            )

    def flush(self) -> None:
        """Write what was recorded so far: waits until the writer is idle, then writes its pending
        forwards from this thread (the writer touches them only while it holds a queue item)."""
        self._queue.join()
        self._flush()

    def close(self) -> None:
        """Flush and stop the writer thread (idempotent; also runs at interpreter exit)."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout=30)
