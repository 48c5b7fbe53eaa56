"""AROUND ``sglang.srt.model_executor.model_runner.ModelRunner._forward_raw`` (checked:
model_runner.py:1963, 0.5.23).

Why: MoE layers cannot see the forward mode, the speculative layout or whether the forward belongs
to the target model; eager forwards need that scope published.
How: for the target ModelRunner, publish the forward's phase, its config and tokens-per-request (D of
EAGLE verify, plus the draft nodes' vote weights when depth decay is on, computed only if a layer
call asks) for the duration of the call; every row of an eager forward is real (SGLang's own
``num_token_non_padded`` is used where it provides one).  Replayed CUDA graphs carry the scope they
were captured with.  After a pruned forward, count it for the periodic metrics report.
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
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        runtime.leave(previous)
        if pruned and runtime.reporter is not None:
            runtime.reporter.on_pruned_forward()
