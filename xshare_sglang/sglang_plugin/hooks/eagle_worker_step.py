"""AROUND ``sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation`` (checked:
eagle_worker_v2.py:1415; a decode batch activates its bucket's step count, drafts, verifies and runs
the draft extend inside it, 0.5.23).

Why: the expert-aware speculation tiers compare whole steps (draft, verify, draft extend) at each
step count; this call is one step.
How: only with the tiers on (``PrunerRuntime.tiers``: ``--moe-pruner-guard auto`` with
``--speculative-adaptive``) and for decode batches: time the call (wall clock on CPU, CUDA events on a
GPU, read once complete) under the bucket of its batch size and the step count it ran with.  Prefill
batches and every other server pass straight through.
Remove when: SGLang's adaptive speculation takes a cost model for its tiers.
"""

from __future__ import annotations

from ..runtime import get_runtime

TARGET = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation"
KIND = "around"


def hook(original, self, batch, *args, **kwargs):
    runtime = get_runtime()
    tiers = runtime.tiers if runtime is not None else None
    if tiers is None or batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
        return original(self, batch, *args, **kwargs)
    started = tiers.clock.start()
    result = original(self, batch, *args, **kwargs)
    try:
        key = ("step", tiers.bucket_of(int(batch.seq_lens.shape[0])), int(self.speculative_num_steps))
        tiers.measured(tiers.clock.stop(started, key))
    except Exception as exc:  # the step served; only its timing is lost
        runtime.record_fault("timing a speculative step", exc)
    return result
