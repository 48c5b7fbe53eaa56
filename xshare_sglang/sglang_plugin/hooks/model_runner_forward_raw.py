"""AROUND ``sglang.srt.model_executor.model_runner.ModelRunner._forward_raw`` (checked:
model_runner.py:1963, 0.5.23).

Why: MoE layers cannot see the forward mode, the speculative layout or whether the forward belongs
to the target model; eager forwards need that scope published.
How: for the target ModelRunner, publish the forward's phase, its config and tokens-per-request (D of
EAGLE verify, plus the draft nodes' vote weights when depth decay is on, computed only if a layer
call asks) for the duration of the call; every row of an eager forward is real (SGLang's own
``num_token_non_padded`` is used where it provides one).  Replayed CUDA graphs carry the scope they
were captured with.  After a pruned forward, count it for the periodic metrics report.  With
``--moe-pruner-trace-dir``, tell the trace recorder where a forward starts and ends.
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
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        if recorder is not None:
            try:
                recorder.finish_forward()
            except Exception as exc:
                runtime.record_fault("the trace recorder", exc)
        runtime.leave(previous)
        if pruned and runtime.reporter is not None:
            runtime.reporter.on_pruned_forward()
