"""AROUND ``sglang.srt.model_executor.model_runner.ModelRunner._forward_raw`` (checked:
model_runner.py:1963, 0.5.23).

Why: MoE layers cannot see the forward mode, the speculative layout or whether the forward belongs
to the target model; eager forwards need that scope published.
How: for the target ModelRunner, publish the forward's phase, its config and tokens-per-request (D of
EAGLE verify, plus the draft nodes' vote weights when depth decay is on, computed only if a layer
call asks) for the duration of the call; every row of an eager forward is real (SGLang's own
``num_token_non_padded`` is used where it provides one).  Replayed CUDA graphs carry the scope they
were captured with.  A forward of a pruned phase first sets the metrics gate of
``--moe-pruner-metrics-every`` (whether its layer calls add their metrics; the gate is device memory
the replayed graphs read).  After a forward that ran pruned routing, count it for the periodic metrics
report: an eager forward of a pruned phase, or the replay of a graph captured pruned (SGLang says
whether a graph replayed, ``ModelRunnerOutput.can_run_graph``; the ``load_batch`` hook says whether
a decode/verify graph was captured pruned; prefill graphs are captured without the pruner).  With
``--moe-pruner-trace-dir``, tell the trace recorder where a forward starts and ends.  With the
expert-aware speculation tiers on, time each decode/verify forward for them (``adaptive_tiers``).
Remove when: SGLang exposes the ForwardBatch (or mode and layout) in its forward context.
"""

from __future__ import annotations

from ..runtime import get_runtime
from ..verify_scope import eager_scope

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw"
KIND = "around"


def hook(original, self, forward_batch, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None or runtime.runner is not self:
        return original(self, forward_batch, *args, **kwargs)
    try:
        scope = eager_scope(runtime, forward_batch)
    except Exception as exc:  # this forward runs unpruned rather than not at all
        runtime.record_fault("the scope of an eager forward", exc)
        scope = None
    previous = runtime.enter(scope)
    pruned = runtime.pruning_phase()
    if pruned:
        runtime.sample_metrics()  # --moe-pruner-metrics-every: this forward adds its metrics or not
    runtime.replay_pruned = False
    recorder = runtime.recorder
    if recorder is not None:
        try:
            recorder.start_forward(
                scope.phase if scope is not None else None,
                getattr(forward_batch, "req_pool_indices", None),
                scope.tokens_per_request if scope is not None else 1,
            )
        except Exception as exc:  # the forward is not recorded
            recorder.current = None
            runtime.record_fault("the trace recorder", exc)
    result = None
    tiers, started = runtime.tiers, None
    if tiers is not None and scope is not None and scope.phase in ("decode", "verify"):
        started = tiers.clock.start()
    try:
        result = original(self, forward_batch, *args, **kwargs)
        if started is not None:
            key = ("target", tiers.bucket_of(int(forward_batch.batch_size)), scope.tokens_per_request)
            tiers.measured(tiers.clock.stop(started, key))
        return result
    finally:
        if recorder is not None:
            try:
                recorder.finish_forward()
            except Exception as exc:
                runtime.record_fault("the trace recorder", exc)
        runtime.leave(previous)
        # a replayed graph ran the routing it was captured with: count it only if that was pruned
        # (prefill graphs never are; decode/verify graphs unless their capture fell back)
        replayed = bool(getattr(result, "can_run_graph", False))
        if pruned and (not replayed or runtime.replay_pruned) and runtime.reporter is not None:
            runtime.reporter.on_pruned_forward(scope.tokens_per_request)
