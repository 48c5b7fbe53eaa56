"""ECHO in a serving process: the draft candidates of the current step, the scheduler's verify
slots, the cut of nodes outside the allocation, and the calibration log.

Flow of one EAGLE step (all eager except the stash, which may be recorded into the draft CUDA graph):

1. ``organize_draft_results`` (hook): copy every draft candidate's path probability, token and parent
   into buffers owned here (``copy_`` only, so the copy replays with the draft graph);
2. ``build_eagle_verify_input`` (hook): for the batch's real requests, layer confidence -> scheduler
   -> allocated nodes -> D - 1 verify slots, which replace SGLang's global top-(D - 1); after SGLang
   built the tree, the links to slots outside the allocation are cut in place, so tree verification
   never accepts them and the pruner's verify votes (which read the same links) ignore them;
3. ``eagle_sample`` (hook): one step in ``log_every`` writes (confidence, accepted length) for
   ``xshare-sglang echo-calibrate``, through a background thread.

Any exception in steps 1-3 is counted and logged (rate-limited) and the step runs as SGLang's own:
a failed cut leaves a consistent, merely uncut, tree.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..spec.echo import (
    DraftCandidates,
    EchoCalibration,
    allocate_nodes,
    cut_tree,
    echo_schedule,
    layer_confidence,
    verify_slots,
)
from ..spec.echo.settings import EchoSettings

logger = logging.getLogger(__name__)

FAULT_LOG_SECONDS = 60.0
#: Scheduled verify steps between two summary log lines (each line reads the device counters once).
SUMMARY_EVERY_STEPS = 2000


@dataclass
class EchoPlan:
    """What the scheduler decided for one verify step (tensors on the device)."""

    confidence: torch.Tensor  # [R, S]
    top_scores_index: torch.Tensor | None = None  # [R, D-1]
    draft_tokens: torch.Tensor | None = None  # [R, D-1]
    kept: torch.Tensor | None = None  # [R, D]


class EchoLogWriter:
    """Writes sampled (confidence, accepted length) records as JSON lines on a background thread."""

    def __init__(self, folder: str, *, every: int, max_records: int) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"echo-{int(time.time())}-pid{os.getpid()}.jsonl"
        self.every, self.max_records = every, max_records
        self.seen = self.written = self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=256)
        self._thread = threading.Thread(target=self._run, name="xshare-echo-log", daemon=True)
        self._thread.start()

    def offer(self, shape: tuple[int, int, int], confidence: torch.Tensor, accepted: torch.Tensor) -> None:
        """Queue one step if it is sampled; never blocks the caller."""
        self.seen += 1
        if (self.seen - 1) % self.every or self.written + self._queue.qsize() >= self.max_records:
            return
        conf_cpu = confidence.detach().to("cpu", torch.float32, non_blocking=True)
        acc_cpu = accepted.detach().to("cpu", torch.int64, non_blocking=True)
        event = None
        if confidence.is_cuda:
            event = torch.cuda.Event()
            event.record()
        try:
            self._queue.put_nowait((shape, conf_cpu, acc_cpu, event))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            (num_steps, topk, draft_tokens), conf, accepted, event = item
            try:
                if event is not None:
                    event.synchronize()
                record = {
                    "num_steps": num_steps,
                    "topk": topk,
                    "num_draft_tokens": draft_tokens,
                    "confidence": [[round(float(c), 7) for c in row] for row in conf.tolist()],
                    "accepted": [min(max(int(a), 0), num_steps) for a in accepted.tolist()],
                }
                with open(self.path, "a") as handle:
                    handle.write(json.dumps(record, separators=(",", ":")) + "\n")
                self.written += 1
            except Exception:  # the log must never take the server down
                self.dropped += 1
                logger.exception("xshare-echo: could not write a calibration record")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        self._queue.join()


class EchoRuntime:
    """Per-process ECHO state."""

    def __init__(self, settings: EchoSettings) -> None:
        self.settings = settings
        self.calibration = EchoCalibration.load(settings.calibration) if settings.scheduling else None
        self.log = (
            EchoLogWriter(settings.log_dir, every=settings.log_every, max_records=settings.log_max_records)
            if settings.logging
            else None
        )
        self._gates: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stash: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._stash_shape: tuple[int, int] | None = None
        # rows the stash hook copied this step (0: it failed); None when it did not run (a replayed
        # draft graph copied the candidates itself)
        self._stash_rows: int | None = None
        self.steps = 0
        self.requests = 0  # real requests planned (host count)
        self.faults = 0
        self._last_fault_log = 0.0
        self.totals: dict[str, torch.Tensor] = {}

    # ---------------------------------------------------------------------------------- faults

    def record_fault(self, where: str, exc: BaseException) -> None:
        self.faults += 1
        now = time.monotonic()
        if now - self._last_fault_log >= FAULT_LOG_SECONDS:
            self._last_fault_log = now
            logger.warning(
                "xshare-echo: %s failed (%s: %s); that step runs SGLang's own draft tree (%d faults so far)",
                where,
                type(exc).__name__,
                exc,
                self.faults,
            )

    # ----------------------------------------------------------------------------------- stash

    def stash(self, score_list, token_list, parents_list) -> None:
        """Copy this step's draft candidates into buffers owned here (graph-safe: ``copy_`` only).

        The buffers are allocated once (by :meth:`reserve` before the draft CUDA graphs are
        captured, or at the first eager step) and never replaced or freed afterwards: captured
        graphs copy into their memory on every replay.  A step that does not fit is a fault, and
        :meth:`candidates` refuses it, so that step runs SGLang's own draft tree.
        """
        self._stash_rows = 0
        try:
            candidates = DraftCandidates.from_sglang(score_list, token_list, parents_list)
            rows = candidates.scores.shape[0]
            shape = (candidates.num_steps, candidates.topk)
            if self._stash is None:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("no candidate buffer reserved before the draft CUDA-graph capture")
                self.reserve(rows, *shape, candidates.scores.device)
            buffers = self._stash
            if self._stash_shape != shape or buffers[0].shape[0] < rows:
                raise RuntimeError(
                    f"{rows} draft rows of a {shape[0]}-step top-{shape[1]} tree do not fit the candidate buffers "
                    f"({buffers[0].shape[0]} rows, {self._stash_shape[0]}-step top-{self._stash_shape[1]})"
                )
            buffers[0][:rows].copy_(candidates.scores)
            buffers[1][:rows].copy_(candidates.tokens)
            buffers[2][:rows].copy_(candidates.parents)
            self._stash_rows = rows
        except Exception as exc:
            self.record_fault("copying the draft candidates", exc)

    def reserve(self, rows: int, num_steps: int, topk: int, device: torch.device | str) -> None:
        """Allocate the candidate buffers, once: later calls keep the buffers already there."""
        if self._stash is not None:
            return
        width = topk + (num_steps - 1) * topk * topk
        self._stash = (
            torch.zeros((rows, width), dtype=torch.float32, device=device),
            torch.zeros((rows, width), dtype=torch.int64, device=device),
            torch.full((rows, width), -1, dtype=torch.int64, device=device),
        )
        self._stash_shape = (num_steps, topk)

    def candidates(self, num_requests: int, num_steps: int, topk: int) -> DraftCandidates | None:
        """This step's candidates of the first ``num_requests`` rows; None when they are not in the
        buffers (an eager step that did not fit; a replayed draft graph refreshes them without
        running the stash hook, and always fits: its capture did)."""
        stashed, self._stash_rows = self._stash_rows, None  # None again until the next eager stash
        if self._stash is None or self._stash_shape != (num_steps, topk) or self._stash[0].shape[0] < num_requests:
            return None
        if stashed == 0:
            return None
        scores, tokens, parents = (t[:num_requests] for t in self._stash)
        return DraftCandidates(scores, tokens, parents, num_steps, topk)

    # ---------------------------------------------------------------------------------- scheduling

    def _gate_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._gates:
            self._gates[device] = self.calibration.gate_tensors(device)
        return self._gates[device]

    def plan(
        self, num_requests: int, *, num_steps: int, topk: int, num_draft_tokens: int, top_scores_index: torch.Tensor
    ) -> EchoPlan | None:
        """Confidence, and with a calibration the verify slots, of this step's real requests."""
        candidates = self.candidates(num_requests, num_steps, topk)
        if candidates is None or tuple(top_scores_index.shape) != (num_requests, num_draft_tokens - 1):
            return None
        confidence = layer_confidence(candidates)
        plan = EchoPlan(confidence=confidence)
        if self.calibration is None:
            return plan
        gated, thresholds = self._gate_tensors(confidence.device)
        allocation = echo_schedule(
            confidence,
            gated,
            thresholds,
            self.settings.k_max(num_requests, num_draft_tokens),
            default_width=self.settings.default_width,
            max_width=self.settings.max_width or topk,
            per_request_cap=num_draft_tokens - 1,
        )
        allocated = allocate_nodes(candidates, allocation.widths)
        plan.top_scores_index, plan.kept = verify_slots(candidates, allocated, num_draft_tokens)
        plan.draft_tokens = candidates.tokens.gather(1, plan.top_scores_index)
        self.requests += num_requests  # a host count: no tensor made from a host value per step
        self._count("kept_nodes", plan.kept[:, 1:].sum())
        self._count("truncated", allocation.truncated.sum())
        self.steps += 1
        if self.steps % SUMMARY_EVERY_STEPS == 0:
            stats = self.summary()
            logger.info(
                "xshare-echo: %d verify steps, %.2f allocated draft nodes per request (of %d slots), "
                "%.1f%% of requests truncated by a gate, %d faults",
                self.steps,
                stats.get("kept_nodes_per_request", 0.0),
                num_draft_tokens - 1,
                100.0 * stats.get("truncated", 0) / max(stats.get("requests", 0), 1),
                self.faults,
            )
        return plan

    def cut(self, verify_input, plan: EchoPlan) -> None:
        """Relink ``verify_input``'s tree in place so that only the plan's kept nodes can be accepted."""
        next_token, next_sibling = verify_input.retrieve_next_token, verify_input.retrieve_next_sibling
        new_token, new_sibling = cut_tree(next_token, next_sibling, plan.kept)
        next_token.copy_(new_token)
        next_sibling.copy_(new_sibling)

    def _count(self, name: str, value: torch.Tensor) -> None:
        total = self.totals.get(name)
        self.totals[name] = value.to(torch.int64) if total is None else total + value

    def summary(self) -> dict[str, float]:
        """Host-side totals (synchronises; for periodic logs and tests)."""
        out = {name: int(value) for name, value in self.totals.items()}
        if self.requests:
            out["requests"] = self.requests
        requests = out.get("requests", 0)
        if requests:
            out["kept_nodes_per_request"] = out.get("kept_nodes", 0) / requests
        out["faults"] = self.faults
        return out


_RUNTIME: EchoRuntime | None = None
_LOADED = False


def get_echo_runtime() -> EchoRuntime | None:
    """This process's ECHO runtime, built on first use from the plugin settings; None when ECHO is off."""
    global _RUNTIME, _LOADED
    if not _LOADED:
        _LOADED = True
        from .settings import settings_from_env

        settings = settings_from_env()
        if settings is not None and settings.echo_active:
            _RUNTIME = EchoRuntime(settings.echo)
            logger.info("xshare-echo active: %s", settings.echo.to_dict())
    return _RUNTIME


def set_echo_runtime(runtime: EchoRuntime | None) -> None:
    """Install a runtime (tests, embedders); None turns ECHO off in this process."""
    global _RUNTIME, _LOADED
    _RUNTIME, _LOADED = runtime, True
