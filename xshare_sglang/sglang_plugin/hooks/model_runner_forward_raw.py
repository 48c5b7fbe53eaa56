"""AROUND ``sglang.srt.model_executor.model_runner.ModelRunner._forward_raw`` (checked:
model_runner.py:1963, 0.5.23).

Why: MoE layers cannot see the forward mode, the speculative layout or whether the forward belongs
to the target model; eager forwards need that scope published.
How: for the target ModelRunner, publish the forward's phase and tokens-per-request (D of EAGLE
verify) for the duration of the call; every row of an eager forward is real (SGLang's own
``num_token_non_padded`` is used where it provides one).  Replayed CUDA graphs carry the scope they
were captured with.  After a pruned forward, count it for the periodic metrics report.
Remove when: SGLang exposes the ForwardBatch (or mode and layout) in its forward context.
"""

from __future__ import annotations

from ..runtime import ForwardScope, get_runtime
from .phases import phase_of

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw"
KIND = "around"


def scope_of(forward_batch) -> ForwardScope:
    phase = phase_of(forward_batch.forward_mode)
    tokens_per_request = 1
    if phase == "verify":
        tokens_per_request = int(getattr(forward_batch.spec_info, "draft_token_num", 1) or 1)
    return ForwardScope(phase=phase, tokens_per_request=tokens_per_request, num_valid=None)


def hook(original, self, forward_batch, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None or runtime.runner is not self:
        return original(self, forward_batch, *args, **kwargs)
    previous = runtime.enter(scope_of(forward_batch))
    pruned = runtime.pruning_phase()
    try:
        return original(self, forward_batch, *args, **kwargs)
    finally:
        runtime.leave(previous)
        if pruned and runtime.reporter is not None:
            runtime.reporter.on_pruned_forward()
